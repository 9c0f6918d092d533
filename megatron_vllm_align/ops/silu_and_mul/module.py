"""SiLU-and-mul (SwiGLU) whose forward is vLLM's and whose backward is a closed-form fp32 VJP.

Gradient contract ``silu_and_mul`` (case A, docs/method.md#backward-reuse):
- visible forward: :class:`~megatron_vllm_align.ops.silu_and_mul.kernel.VllmSiluAndMulKernel` on
  x [..., 2d] = [gate a | up b] -> y [..., d];
- trainable: the input; no parameters, no discrete state;
- save: the input; sigma(a) is recomputed in fp32 (no fp32 intermediate is kept);
- backward, fp32 with ``s = sigmoid(a)``: ``d_up = dY a s``, ``d_gate = dY b s (1 + a (1 - s))``,
  written as [d_gate | d_up] and cast once to the input dtype, in blocks of rows
  (:func:`~megatron_vllm_align.ops.silu_and_mul.vjp.silu_and_mul_vjp`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.silu_and_mul.kernel import VllmSiluAndMulKernel
from megatron_vllm_align.ops.silu_and_mul.vjp import silu_and_mul_vjp
from megatron_vllm_align.ops.vllm_context import VllmContext


class SiluAndMulFunction(torch.autograd.Function):
    """``apply(x, kernel) -> silu(gate) * up``: vLLM forward, closed-form backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: VllmSiluAndMulKernel) -> torch.Tensor:
        out = kernel(x)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        return silu_and_mul_vjp(x, grad_out), None


class VllmSiluAndMul(nn.Module):
    """``forward(x [..., 2d] = [gate | up]) -> silu(gate) * up [..., d]``; no parameters.

    The vLLM layer is the plain attribute ``kernel`` (not a submodule).
    """

    contract_name = "silu_and_mul"

    def __init__(self, *, vllm_context: VllmContext, **kwargs: Any) -> None:
        super().__init__()
        self.kernel = VllmSiluAndMulKernel(vllm_context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SiluAndMulFunction.apply(x, self.kernel)

"""SiLU-and-mul (SwiGLU) whose forward is vLLM's and whose backward is a closed-form fp32 VJP.

Gradient contract ``silu_and_mul`` (case A, docs/method.md#backward-reuse):
- visible forward: :class:`~megatron_vllm_align.ops.silu_and_mul.kernel.VllmSiluAndMulKernel` on
  x [..., 2d] = [gate a | up b] -> y [..., d];
- trainable: the input; no parameters, no discrete state;
- save: the input; sigma(a) is recomputed in fp32 (no fp32 intermediate is kept);
- backward, fp32 with ``s = sigmoid(a)``: ``d_up = dY a s``, ``d_gate = dY b s (1 + a (1 - s))``,
  written as [d_gate | d_up] and cast once to the input dtype, in blocks of rows
  (:func:`silu_and_mul_vjp`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.silu_and_mul.kernel import VllmSiluAndMulKernel
from megatron_vllm_align.ops.vllm_context import VllmContext

_BLOCK_ELEMENTS = 1 << 18


def silu_and_mul_vjp(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Input gradient of ``silu(gate) * up`` for ``x = [gate | up]`` [..., 2d]: the fp32 closed form
    (module docstring), cast once to ``x``'s dtype. Computed in blocks of rows of about
    ``_BLOCK_ELEMENTS`` fp32 values each (no fp32 copy of the whole input; the passes over a block
    stay in cache): ``d_gate`` by torch's fused ``silu_backward`` kernel on ``dY up`` (fp32),
    ``d_up = dY silu(gate)``."""
    width = x.shape[-1] // 2
    flat_x, flat_grad = x.reshape(-1, 2 * width), grad_out.reshape(-1, width)
    grad_in = torch.empty_like(flat_x)
    step = max(1, _BLOCK_ELEMENTS // max(width, 1))
    for first in range(0, flat_x.shape[0], step):
        rows = slice(first, first + step)
        gate_up = flat_x[rows].float()
        gate, up = gate_up[:, :width], gate_up[:, width:]
        grad = flat_grad[rows].float()
        grad_in[rows, :width] = torch.ops.aten.silu_backward(grad * up, gate)
        grad_in[rows, width:] = grad.mul_(torch.nn.functional.silu(gate))
    return grad_in.view(x.shape)


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

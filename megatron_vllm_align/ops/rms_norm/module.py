"""RMSNorm (optionally with the fused residual add) whose forward is vLLM's and whose backward is a
closed-form fp32 VJP.

Gradient contract ``rms_norm`` (case A, docs/method.md#backward-reuse: only rounding differs):
- visible forward: :class:`~megatron_vllm_align.ops.rms_norm.kernel.VllmRMSNormKernel` (vLLM's RMSNorm
  layer in the engine's context) with the deployed weight ``gamma = weight.to(model dtype)``;
- trainable: input (and residual), ``weight``; no discrete state, no surrogate;
- save: the inputs and the weight parameter (by reference). vLLM's kernel does not return the
  inverse RMS, so the backward recomputes ``r = rsqrt(mean(s^2) + eps)`` in fp32 from the saved
  input (docs/method.md#saved-state-and-recompute), with ``s = x`` or ``s = x + residual`` summed in
  fp32 as the forward does;
- backward, all fp32 with ``xh = s r`` and ``h = dY gamma``:
  ``ds = r (h - xh mean(h xh))`` (+ the residual output's gradient on the fused path),
  ``dx = dresidual = ds``, ``dweight = sum over tokens of dY xh``; each cast once to its
  tensor's dtype. The weight's gradient passes through the cast to the model dtype unchanged.
  Computed in blocks of rows (:func:`~megatron_vllm_align.ops.rms_norm.vjp.rms_norm_vjp`), d gamma
  summed over the blocks in fp32.

Transformer Engine's RMSNorm backward would need its own forward's rstd; none is wired here.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.rms_norm.kernel import VllmRMSNormKernel
from megatron_vllm_align.ops.rms_norm.vjp import rms_norm_vjp
from megatron_vllm_align.ops.vllm_context import VllmContext


class RMSNormFunction(torch.autograd.Function):
    """``apply(x, weight, kernel) -> y``: vLLM forward, closed-form backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, kernel: VllmRMSNormKernel) -> torch.Tensor:
        gamma = weight.detach().to(kernel.context.model_dtype)
        out = kernel(x, gamma)
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.gamma_dtype = kernel.eps, gamma.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gamma = weight.detach().to(ctx.gamma_dtype).float()
        d_x, d_weight = rms_norm_vjp(x, None, gamma, grad_out, None, ctx.eps, ctx.needs_input_grad[1])
        return d_x, None if d_weight is None else d_weight.to(weight.dtype), None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``apply(x, residual, weight, kernel) -> (y, x + residual)``: vLLM's fused add + RMSNorm
    forward (run on copies: vLLM's kernel may overwrite its inputs), closed-form backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                kernel: VllmRMSNormKernel) -> tuple[torch.Tensor, torch.Tensor]:
        gamma = weight.detach().to(kernel.context.model_dtype)
        out, new_residual = kernel(x, gamma, residual)
        ctx.save_for_backward(x, residual, weight)
        ctx.eps, ctx.gamma_dtype = kernel.eps, gamma.dtype
        return out, new_residual

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_residual: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        x, residual, weight = ctx.saved_tensors
        gamma = weight.detach().to(ctx.gamma_dtype).float()
        d_total, d_weight = rms_norm_vjp(x, residual, gamma, grad_out, grad_residual, ctx.eps,
                                         ctx.needs_input_grad[2])
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        return d_total, d_total.to(residual.dtype, copy=True), d_weight, None


class VllmRMSNorm(nn.Module):
    """RMSNorm over the last dimension with a trainable ``weight`` [hidden_size] (initialised to 1).

    ``forward(x)`` -> y; ``forward(x, residual)`` -> (y, x + residual) like vLLM's fused layer.
    Inputs must be the engine's model dtype. The vLLM layer is kept in the plain attribute
    ``kernel`` (not a submodule), so ``parameters()`` is exactly ``[weight]``. The norm weight
    needs no refresh: every call binds the current weight (cast to the model dtype).
    """

    contract_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, vllm_context: VllmContext,
                 params_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"eps must be a number > 0, got {eps!r}")
        dtype = params_dtype or vllm_context.model_dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.kernel = VllmRMSNormKernel(vllm_context, hidden_size, float(eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return RMSNormFunction.apply(x, self.weight, self.kernel)
        return FusedAddRMSNormFunction.apply(x, residual, self.weight, self.kernel)

    def extra_repr(self) -> str:
        return f"hidden_size={self.weight.shape[0]}, eps={self.kernel.eps}"

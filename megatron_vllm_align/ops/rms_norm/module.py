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
  Computed in blocks of rows (:func:`rms_norm_vjp`), d gamma summed over the blocks in fp32.

Transformer Engine's RMSNorm backward would need its own forward's rstd; none is wired here.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.rms_norm.kernel import VllmRMSNormKernel
from megatron_vllm_align.ops.vllm_context import VllmContext

_BLOCK_ELEMENTS = 1 << 18


def rms_norm_input_grad(total: torch.Tensor, gamma: torch.Tensor, grad_out: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (d total, per-token dY * xh) of ``y = total * rsqrt(mean(total^2) + eps) * gamma``.

    All arguments fp32; ``total`` and ``grad_out`` [..., H], ``gamma`` [H]; the arguments are not
    modified."""
    rstd = torch.rsqrt(total.square().mean(dim=-1, keepdim=True) + eps)
    normed = total * rstd
    h = grad_out * gamma
    projection = torch.linalg.vecdot(h, normed).unsqueeze(-1).div_(total.shape[-1])
    d_total = h.sub_(normed * projection).mul_(rstd)
    return d_total, normed.mul_(grad_out)


def rms_norm_vjp(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, grad_out: torch.Tensor,
                 grad_residual: torch.Tensor | None, eps: float, need_weight: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d total cast to ``x``'s dtype, fp32 d gamma or None) of the RMSNorm of ``total = x (+
    residual)`` (module docstring), ``+ grad_residual`` on the fused path.

    :func:`rms_norm_input_grad` on blocks of rows of about ``_BLOCK_ELEMENTS`` fp32 values (no fp32
    copy of the whole input; a block's passes stay in cache); d gamma is the fp32 sum over all rows
    of the per-token terms."""
    hidden = x.shape[-1]
    flat_x, flat_grad = x.reshape(-1, hidden), grad_out.reshape(-1, hidden)
    flat_res = None if residual is None else residual.reshape(-1, hidden)
    flat_gres = None if grad_residual is None else grad_residual.reshape(-1, hidden)
    d_total = torch.empty_like(flat_x)
    d_gamma = torch.zeros(hidden, dtype=torch.float32, device=x.device) if need_weight else None
    step = max(1, _BLOCK_ELEMENTS // hidden)
    for first in range(0, flat_x.shape[0], step):
        rows = slice(first, first + step)
        total = flat_x[rows].float() if flat_res is None else flat_x[rows].float() + flat_res[rows].float()
        block, per_token = rms_norm_input_grad(total, gamma, flat_grad[rows].float(), eps)
        if d_gamma is not None:
            d_gamma += per_token.sum(dim=0)
        d_total[rows] = block if flat_gres is None else block.add_(flat_gres[rows].float())
    return d_total.view(x.shape), d_gamma


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

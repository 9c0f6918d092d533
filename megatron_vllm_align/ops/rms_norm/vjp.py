"""The RMSNorm backward (contract ``rms_norm``, case A; the formula is in the module docstring of
:mod:`megatron_vllm_align.ops.rms_norm.module`): the closed-form fp32 VJP, recomputing the inverse
RMS from the saved input, in blocks of rows."""
from __future__ import annotations

import torch

_BLOCK_ELEMENTS = 1 << 18


def rms_norm_input_grad(total: torch.Tensor, gamma: torch.Tensor, grad_out: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (d total, per-token dY * xh) of ``y = total * rsqrt(mean(total^2) + eps) * gamma``.

    ``total`` and ``gamma`` fp32, ``grad_out`` fp32 or a lower precision (each product with it runs in
    fp32 on its exact upcast, so the result is that of ``grad_out.float()``); ``total`` and
    ``grad_out`` [..., H], ``gamma`` [H]; the arguments are not modified."""
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
        # Mixed-dtype adds and products run in fp32 on the exact upcast: the values of ``.float()`` operands.
        total = (flat_x[rows].float() if flat_res is None
                 else flat_x[rows].to(torch.float32, copy=True).add_(flat_res[rows]))
        block, per_token = rms_norm_input_grad(total, gamma, flat_grad[rows], eps)
        if d_gamma is not None:
            d_gamma += per_token.sum(dim=0)
        d_total[rows] = block if flat_gres is None else block.add_(flat_gres[rows])
    return d_total.view(x.shape), d_gamma

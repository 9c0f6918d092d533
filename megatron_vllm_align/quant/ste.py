"""Straight-through estimators (STE): the surrogate derivative of a quantize-dequantize ``Q(x)``
(docs/method.md#straight-through-estimators).

The STE is a contract record (``megatron_vllm_align.contracts.STE``); this module holds its numerics as
functions of ``(ste, x, scale)``: identity ``dQ/dx := 1``; clipped ``dQ/dx := 1`` where
``|x / s| < threshold``, ``0`` above, exactly ``value_at_threshold`` (0.0 or 1.0) at equality; none: the
tensor is not quantized and asking for its derivative is an error. ``s`` is the per-tensor (global)
scale with ``x ~= q * s``: FP8 with a static scale saturates at ``|x / s| = 448`` (``threshold=448``);
for NVFP4, whose ``global_scale`` multiplies, ``s = 1 / global_scale`` and ``threshold=2688`` (6 * 448)
clips where the block scale saturates. ``scale=None`` means ``s = 1``; a scale tensor broadcasts against
``x``. The comparison ``|x| <= threshold * s`` is made in float64, exact for an fp32 ``s`` and a
threshold of at most 29 significant bits.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_vllm_align.contracts.schema import STE


def _check_scale(scale: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"STE scale must be a torch.Tensor or None, got {type(scale).__name__}")
    if not scale.is_floating_point():
        raise ValueError(f"STE scale must be a floating tensor, got {scale.dtype}")
    if scale.device != x.device:
        raise ValueError(f"STE scale is on {scale.device} but x is on {x.device}")
    try:
        shape = torch.broadcast_shapes(scale.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(f"STE scale of shape {tuple(scale.shape)} does not broadcast to x's shape "
                         f"{tuple(x.shape)}")
    if not (bool(torch.isfinite(scale).all()) and bool((scale > 0).all())):
        raise ValueError("STE scale must be finite and > 0 everywhere")


def ste_pass_mask(ste: STE, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Bool mask of ``x``'s shape where the surrogate derivative is 1; ``None`` for identity (1
    everywhere). ``scale``: the per-tensor scale ``s`` the threshold is relative to (see the
    module docstring), ``None`` for ``s = 1``."""
    if not isinstance(ste, STE):
        raise TypeError(f"ste must be a contracts.STE, got {type(ste).__name__}")
    if ste.kind == "none":
        raise ValueError("STE kind 'none' marks an unquantized tensor; it has no surrogate derivative")
    if scale is not None:
        _check_scale(scale, x)
    if ste.kind == "identity":
        return None
    magnitude = x.detach().to(torch.float64).abs()
    limit = ste.threshold if scale is None else ste.threshold * scale.detach().to(torch.float64)
    if ste.value_at_threshold == 1.0:
        return magnitude <= limit
    return magnitude < limit


def apply_ste(grad: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``grad`` times the surrogate derivative given by ``ste_pass_mask``."""
    if mask is None:
        return grad
    return torch.where(mask, grad, torch.zeros_like(grad))


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, quant_dequant_fn: Callable[[torch.Tensor], torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        value = quant_dequant_fn(x.detach())
        if not isinstance(value, torch.Tensor) or value.shape != x.shape or value.dtype != x.dtype:
            raise ValueError("quant_dequant_fn must return a tensor with x's shape and dtype, got "
                             f"{getattr(value, 'shape', type(value))} / {getattr(value, 'dtype', None)}")
        ctx.has_mask = mask is not None
        if mask is not None:
            ctx.save_for_backward(mask)
        return value

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mask = ctx.saved_tensors[0] if ctx.has_mask else None
        return apply_ste(grad, mask), None, None


def ste_quantize(x: torch.Tensor, quant_dequant_fn: Callable[[torch.Tensor], torch.Tensor], ste: STE,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """``quant_dequant_fn(x)`` in forward; in backward the gradient times the STE derivative.

    ``quant_dequant_fn`` maps a detached ``x`` to a tensor of the same shape and dtype (it is
    never differentiated). ``ste`` and ``scale``: see ``ste_pass_mask``.
    """
    return _StraightThrough.apply(x, quant_dequant_fn, ste_pass_mask(ste, x, scale))

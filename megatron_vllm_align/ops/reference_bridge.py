"""Reference bridges: a visible (inference) value with an independent surrogate gradient.

These build the *reference* side of a layer-1 comparison (docs/method.md#layer-1-module-vjp); they
are not the production wiring.
"""
from __future__ import annotations

from typing import Callable

import torch


def _check_same_kind(visible: torch.Tensor, surrogate: torch.Tensor, name: str) -> None:
    if not isinstance(visible, torch.Tensor) or not isinstance(surrogate, torch.Tensor):
        raise TypeError(f"{name}: visible and surrogate must be tensors")
    for attr in ("shape", "dtype", "device"):
        if getattr(visible, attr) != getattr(surrogate, attr):
            raise ValueError(
                f"{name}: visible and surrogate differ in {attr}: "
                f"{getattr(visible, attr)} vs {getattr(surrogate, attr)}"
            )


class VisibleWithSurrogate(torch.autograd.Function):
    """Returns ``visible`` in forward; sends the upstream gradient to ``surrogate`` in backward.

    ``visible`` carries no gradient; ``surrogate`` must be built with grad enabled *outside*
    this Function so that its graph is the independent reference backward.
    """

    @staticmethod
    def forward(ctx, visible: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
        return visible.detach().clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return None, grad_output


def visible_with_surrogate(visible: torch.Tensor, surrogate: torch.Tensor,
                           name: str = "output") -> torch.Tensor:
    """Checked entry to :class:`VisibleWithSurrogate` (same shape, dtype and device required)."""
    _check_same_kind(visible, surrogate, name)
    return VisibleWithSurrogate.apply(visible.detach(), surrogate)


class _VisibleForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, visible_fn, native_fn, name, *inputs):
        ctx.native_fn = native_fn
        ctx.name = name
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            out = visible_fn(*inputs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{name}: visible function must return one tensor, got {type(out)}")
        return out

    @staticmethod
    def backward(ctx, grad_output):
        inputs = ctx.saved_tensors
        detached = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            native_out = ctx.native_fn(*detached)
        _check_same_kind(grad_output, native_out, f"{ctx.name} (native rerun)")
        wanted = [x for x in detached if x.requires_grad]
        grads = iter(torch.autograd.grad(native_out, wanted, grad_output, allow_unused=True))
        return (None, None, None, *[next(grads) if x.requires_grad else None for x in detached])


def visible_forward(visible: Callable[..., torch.Tensor], native: Callable[..., torch.Tensor],
                    *inputs: torch.Tensor, name: str = "visible_forward") -> torch.Tensor:
    """Output of ``visible(*inputs)``; gradient of ``native(*inputs)`` rerun on the saved inputs.

    ``visible`` is the inference implementation (run without a graph); ``native`` is a training
    implementation of the same math. Their outputs must agree in shape, dtype and device;
    this is checked when ``native`` is rerun in backward.
    """
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input {i} is {type(x).__name__}, expected a tensor")
    return _VisibleForward.apply(visible, native, name, *inputs)

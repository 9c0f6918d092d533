"""Input checks shared by the accuracy comparisons.

Every check raises an error whose message starts with the comparison's `name` and the role
of the offending tensor (e.g. ``attn: actual[3] ...``), so a failure in a long test log
points at one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


def element_index(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    """Multi-dimensional index (tuple of ints) of `flat_index` in a row-major tensor of `shape`."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))


def _check_floating(tensor: object, role: str, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {role} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: {role} has dtype {tensor.dtype}; a floating dtype is required")
    if tensor.numel() == 0:
        raise ValueError(f"{name}: {role} is empty (shape {tuple(tensor.shape)}); nothing to compare")


def _finite_float64(tensor: torch.Tensor, role: str, name: str) -> torch.Tensor:
    # float8 has no isfinite kernel; the float64 copy keeps NaN and Inf as they are.
    wide = tensor.detach().to(torch.float64)
    if bool(torch.isfinite(wide.sum())):
        return wide  # NaN or Inf anywhere makes the sum NaN or Inf; a finite sum leaves none to find
    nonfinite = ~torch.isfinite(wide)
    if bool(nonfinite.any()):
        flat = wide.reshape(-1)
        first = int(nonfinite.reshape(-1).nonzero()[0])
        n_nan = int(torch.isnan(flat).sum())
        n_inf = int(nonfinite.sum()) - n_nan
        kind = "NaN" if bool(torch.isnan(flat[first])) else "Inf"
        raise ValueError(
            f"{name}: {role} contains {n_nan} NaN and {n_inf} Inf value(s); "
            f"first is {kind} at index {element_index(first, tensor.shape)}"
        )
    return wide


def checked_float64(tensors: dict[str, object], name: str) -> list[torch.Tensor]:
    """The values of `tensors` (role -> tensor) as float64, after checking them in this order.

    Each must be a non-empty floating torch.Tensor (else TypeError / ValueError); all must
    share the first one's shape and device (else ValueError); none may hold NaN or Inf
    (else ValueError giving the counts and the index of the first one).
    """
    for role, tensor in tensors.items():
        _check_floating(tensor, role, name)
    (first_role, first), *others = tensors.items()
    for role, tensor in others:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name}: {role} has shape {tuple(tensor.shape)} but {first_role} has shape {tuple(first.shape)}"
            )
        if tensor.device != first.device:
            raise ValueError(f"{name}: {role} is on {tensor.device} but {first_role} is on {first.device}")
    return [_finite_float64(tensor, role, name) for role, tensor in tensors.items()]


def tensor_list(value: TensorOrList, role: str, name: str) -> list[torch.Tensor]:
    """`value` as a non-empty list: a tensor becomes a one-item list, a sequence is copied."""
    if isinstance(value, torch.Tensor):
        return [value]
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(
            f"{name}: {role} must be a tensor or a list of tensors, got {type(value).__name__}"
        )
    if len(value) == 0:
        raise ValueError(f"{name}: {role} is an empty list")
    return list(value)


def pooled_float64(errors: TensorOrList, role: str, name: str) -> torch.Tensor:
    """All elements of a tensor or list of tensors, checked and concatenated as one float64 vector."""
    items = tensor_list(errors, role, name)
    flats = []
    for i, tensor in enumerate(items):
        item_role = f"{role}[{i}]" if len(items) > 1 else role
        _check_floating(tensor, item_role, name)
        if tensor.device != items[0].device:
            raise ValueError(f"{name}: {item_role} is on {tensor.device} but {role}[0] is on {items[0].device}")
        flats.append(_finite_float64(tensor, item_role, name).reshape(-1))
    return flats[0] if len(flats) == 1 else torch.cat(flats)

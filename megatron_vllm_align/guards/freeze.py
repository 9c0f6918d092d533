"""Validate a declared freeze set around one optimizer step.

A parameter is frozen only if the optimizer cannot move it: its gradient is None, or it is in
no optimizer slot. A zeroed gradient is not a freeze: AdamW's decoupled weight decay and any
momentum state still move the weight (docs/method.md#false-differences).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_vllm_align.guards.optimizer_slots import slot_of, slots_by_tensor, stepped_tensor
from megatron_vllm_align.guards.parameters import ModelParameter, model_parameters
from megatron_vllm_align.utils.dtensors import is_dtensor, local_part


@dataclass(frozen=True)
class FrozenParameterReport:
    """What went wrong with one frozen parameter: reasons found before the step, and the
    largest absolute change of any element over the step (0.0: bitwise unchanged)."""

    name: str
    reasons: tuple[str, ...]
    max_abs_change: float
    moved: bool


class FreezeViolation(AssertionError):
    """Frozen parameters that could move or did move; ``reports`` has one entry per parameter."""

    def __init__(self, reports: list[FrozenParameterReport]) -> None:
        self.reports = reports
        lines = [f"  {r.name}: {'moved, max |change| = ' + format(r.max_abs_change, '.6g') if r.moved else 'unchanged'}"
                 + "".join(f"; {reason}" for reason in r.reasons) for r in reports]
        super().__init__(f"{len(reports)} frozen parameter(s) violate the freeze:\n" + "\n".join(lines))


def _pre_step_reasons(parameter: ModelParameter, slot_where: str | None) -> list[str]:
    """Why the optimizer could move this parameter (empty: it cannot)."""
    if slot_where is None:
        return []
    holders = {id(t): t for t in (parameter.master, stepped_tensor(parameter.master))}.values()
    grads = [g for t in holders for g in (t.grad, getattr(t, "main_grad", None)) if g is not None]
    if not grads:
        return []
    largest = max(float(local_part(g).detach().abs().max()) if local_part(g).numel() else 0.0 for g in grads)
    state = "zeroed, not None" if largest == 0.0 else f"max |grad| = {largest:.6g}"
    return [f"it has a gradient ({state}) and is in {slot_where}: weight decay or momentum can still move it"]


def _changes(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[list[bool], list[float]]:
    """Per pair: not bitwise equal?, max |after - before| (inf for a changed shape)."""
    moved, largest = [], []
    for old, new in zip(before, after, strict=True):
        same = old.shape == new.shape and bool(
            (old.reshape(-1).view(torch.uint8) == new.reshape(-1).view(torch.uint8)).all())
        moved.append(not same)
        if same:
            largest.append(0.0)
        elif old.shape != new.shape:
            largest.append(float("inf"))
        else:
            largest.append(float((new.double() - old.double()).abs().max()))
    return moved, largest


@contextlib.contextmanager
def validate_freeze(model: nn.Module, optimizer: object, frozen_names: Iterable[str]) -> Iterator[None]:
    """Context manager around ``optimizer.step()``: raises :class:`FreezeViolation` naming every
    parameter of ``frozen_names`` that has a gradient while in the optimizer (checked on entry)
    or whose value is not bitwise unchanged on exit (with its max absolute change).

    Values are compared on each rank's local data (FSDP2: the local shard, Megatron: the model
    parameter); when a frozen parameter is a DTensor the figures are reduced over the world,
    so every rank must run the block with the same names. Unknown names raise ValueError.
    An exception inside the block propagates unchecked.
    """
    names = list(frozen_names)
    params = model_parameters(model)
    unknown = [name for name in names if name not in params]
    if unknown:
        raise ValueError(f"validate_freeze: no parameter named {unknown} in {type(model).__name__}")
    by_slot_tensor = slots_by_tensor(optimizer)
    reasons = {}
    for name in names:
        slot = slot_of(params[name].master, by_slot_tensor)
        reasons[name] = _pre_step_reasons(params[name], None if slot is None else slot.where)
    before = [local_part(params[name].master).detach().clone() for name in names]
    yield
    after = [local_part(params[name].master).detach() for name in names]
    moved, largest = _changes(before, after)
    if any(is_dtensor(params[name].master) for name in names) and dist.is_initialized():
        stats = torch.tensor([[float(m) for m in moved], largest], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        moved, largest = [bool(m) for m in stats[0].tolist()], stats[1].tolist()
    reports = [FrozenParameterReport(name, tuple(reasons[name]), largest[i], moved[i])
               for i, name in enumerate(names) if moved[i] or reasons[name]]
    if reports:
        raise FreezeViolation(reports)

"""Keeping deployed values in step with the master weights.

A module with a deployed value (a vLLM shadow layer built from its master weight) exposes
``refresh_deployed()``. After every change of the master weights (optimizer step, checkpoint
load) the deployed values must be rebuilt; the modules refuse to run on a stale one when they
can tell (see ``VllmDenseLinear``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def master_stamp(*params: torch.Tensor | None) -> tuple[tuple[int, int], ...]:
    """Storage and autograd version of each master parameter (None skipped): changes on optimizer
    steps and in-place copies (not on writes through ``.data``), so a stale deployed value can be
    refused."""
    return tuple((p.data_ptr(), p._version) for p in params if p is not None)


def refresh_deployed_weights(model: nn.Module) -> int:
    """Rebuild the deployed value of every submodule of ``model`` that has one; returns how many.
    ValueError for a model sharded by FSDP2 (DTensor parameters): its units redeploy from the
    all-gathered master at every forward (``megatron.fsdp2``), a refresh from shards cannot."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(param, DTensor) for param in model.parameters()):
        raise ValueError("refresh_deployed_weights: the model's parameters are FSDP2 shards (DTensor); a model "
                         "sharded with fully_shard_aligned redeploys at every forward, so do not refresh it")
    count = 0
    for module in model.modules():
        refresh = getattr(module, "refresh_deployed", None)
        if callable(refresh):
            refresh()
            count += 1
    return count


def register_deployed_refresh(optimizer: Any, model: nn.Module) -> Any:
    """Refresh ``model``'s deployed values after each ``optimizer.step()``; returns the hook handle.

    Needs ``optimizer.register_step_post_hook`` (``torch.optim.Optimizer``). For optimizers
    without it (e.g. Megatron's), call :func:`refresh_deployed_weights` after each step.
    """
    register = getattr(optimizer, "register_step_post_hook", None)
    if not callable(register):
        raise TypeError(f"{type(optimizer).__name__} has no register_step_post_hook; call "
                        "refresh_deployed_weights(model) after each optimizer step instead")
    return register(lambda _optimizer, _args, _kwargs: refresh_deployed_weights(model))

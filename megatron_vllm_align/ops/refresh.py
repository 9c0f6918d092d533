"""Keeping deployed values in step with the master weights.

A module with a deployed value (a vLLM shadow layer built from its master weight) exposes
``refresh_deployed()``. After every change of the master weights (optimizer step, checkpoint
load) the deployed values must be rebuilt; the modules refuse to run on a stale one when they
can tell (see ``VllmDenseLinear``).

Whether a deployed value is still vLLM's processing of the current master is checked by its
output, not its bytes (:class:`ProbedDeployedValue`, :func:`deployed_values_match_master`): vLLM's
CPU weight processing may leave nothing readable behind (it packs a linear's weight into a oneDNN
handle, an sgl-kernel or zentorch layout, and then replaces ``layer.weight`` by an empty tensor), so
the deployed kernel and a kernel freshly built from the master run on one fixed probe input and
must agree bitwise, whatever GEMM path vLLM chose.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Rows of the fixed probe input (any M works: vLLM's GEMM path is chosen per weight, not per call).
PROBE_ROWS = 16


def probe_input(features: int, dtype: torch.dtype, rows: int = PROBE_ROWS) -> torch.Tensor:
    """The fixed probe input ``[rows, features]``: standard normal values from a generator seeded
    with 0, cast to ``dtype``; the same tensor on every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, features, generator=generator).to(dtype)


class ProbedDeployedValue:
    """Mixin of a module whose ``kernel`` holds a deployed value built from its master parameters.

    Subclasses give :meth:`_new_kernel` (an unloaded kernel configured like ``self.kernel``),
    :meth:`_load_deployed` (load a kernel from the current master: what ``refresh_deployed`` does to
    ``self.kernel``) and :meth:`_probe` (the kernel's output on a fixed input, :func:`probe_input`).
    """

    kernel: Any

    def _new_kernel(self) -> Any:
        raise NotImplementedError

    def _load_deployed(self, kernel: Any) -> None:
        raise NotImplementedError

    def _probe(self, kernel: Any) -> torch.Tensor:
        raise NotImplementedError

    def deployed_matches_master(self) -> bool:
        """Whether the deployed kernel and one freshly built from the current master give the same
        bits on the probe input (module docstring). Collective wherever a refresh is (a quantized
        row-parallel shard reduces its weight amax over the tensor-parallel group)."""
        fresh = self._new_kernel()
        with torch.no_grad():
            self._load_deployed(fresh)
            return torch.equal(self._probe(self.kernel), self._probe(fresh))


def deployed_values_match_master(model: nn.Module) -> dict[str, bool]:
    """``{module name: deployed_matches_master()}`` over every submodule of ``model`` with a
    probed deployed value (:class:`ProbedDeployedValue`); a False names a stale deployed value.
    Call it on every rank (see :meth:`ProbedDeployedValue.deployed_matches_master`)."""
    return {name: module.deployed_matches_master() for name, module in model.named_modules()
            if isinstance(module, ProbedDeployedValue)}


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

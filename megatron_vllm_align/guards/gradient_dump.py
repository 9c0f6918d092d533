"""Dump every gradient exactly as the optimizer is about to use it.

:class:`GradientDumper` is a step *pre*-hook on the (first) torch optimizer inside the
optimizer it is given, so it runs after everything that changes a gradient before the update:
DP / expert-DP scaling and reduction, loss-scale division and clipping when a wrapper (such as
Megatron-Core's optimizers, see :mod:`.optimizer_slots`) does them inside its ``step()``.
A dump taken right after ``backward()`` instead can differ from what the optimizer used by
exactly those factors (docs/method.md#false-differences).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_vllm_align.guards.dump_format import GradientDumpError, ParamRecord, write_rank_dump
from megatron_vllm_align.guards.optimizer_slots import (
    MegatronShard,
    OptimizerSlot,
    inner_torch_optimizers,
    megatron_shards,
    optimizer_slots,
    parameters_by_tensor,
)
from megatron_vllm_align.guards.parameters import ModelParameter, model_parameters
from megatron_vllm_align.guards.scaling import GradientScaling, ScalingArg, scaling_source

if TYPE_CHECKING:
    from megatron_vllm_align.megatron.vllm_tensor_parallel import ShardLayout


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_writable_directory(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove a file can be created in it; else GradientDumpError."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise GradientDumpError(f"gradient dump directory {str(path)!r} cannot be written: {error}") from error
    return path


def _local_pieces(grad: torch.Tensor, shard: MegatronShard | None, layout: ShardLayout | None, name: str
                  ) -> tuple[list[int], list[tuple[torch.Tensor, dict[str, Any]]]]:
    """(global shape, [(local piece, placement)]) of one gradient: one piece, or one per block of a
    Megatron tensor- / expert-parallel shard (a gated ``linear_fc1`` shard is two blocks)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(grad, DTensor):
        if any(placement.is_partial() for placement in grad.placements):
            raise GradientDumpError(f"gradient of {name!r} has a Partial placement {grad.placements}: "
                                    "it is not reduced yet, so it is not what the optimizer uses")
        _, offsets = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
        placement = {"kind": "block", "offsets": [int(o) for o in offsets],
                     "mesh_shape": list(grad.device_mesh.shape),
                     "mesh_ranks": grad.device_mesh.mesh.flatten().tolist(),
                     "placements": [str(p) for p in grad.placements]}
        return list(grad.shape), [(grad.to_local(), placement)]
    if shard is not None:
        if layout is not None:
            raise GradientDumpError(f"{name!r}: a distributed-optimizer range of a tensor-parallel shard is not "
                                    "recorded (its place in the full tensor would be two placements deep)")
        return list(shard.model_param.shape), [(grad, {"kind": "flat_range", "start": shard.start, "end": shard.end})]
    if layout is not None:
        global_shape = list(grad.shape)
        global_shape[layout.dim] = layout.full_size(grad.shape[layout.dim])
        group_ranks = dist.get_process_group_ranks(layout.group)
        return global_shape, [(block, {"kind": "block", "offsets": offsets, "dim": layout.dim,
                                       "group_ranks": group_ranks, "blocks": layout.blocks})
                              for block, offsets in layout.local_blocks(grad)]
    return list(grad.shape), [(grad, {"kind": "full"})]


class GradientDumper:
    """Dumps the optimizer's gradients at steps 0, every, 2*every, ... (0-based optimizer steps).

    optimizer: a ``torch.optim.Optimizer`` or a wrapper exposing one (Megatron-Core's optimizers,
        ``ChainedOptimizer`` included); the pre-hook goes on its first inner torch optimizer and
        dumps the tensors of all of them. Under FSDP2 these are the sharded DTensors.
    directory: dumps go to ``directory/step_<step>/rank_<rank>.{safetensors,json}``
        (:mod:`.dump_format`); checked writable here (GradientDumpError otherwise).
    model: names the parameters (optional; without it they are named by optimizer position).
    scaling: the factors already in the gradients (:mod:`.scaling`); by default discovered from
        the optimizer (its ``gradient_scaling()`` or, for Megatron-Core, watched during ``step()``).

    A step that a wrapper skips (Megatron on inf/nan) never reaches the hook and is not counted.
    ``remove()`` (or leaving a ``with`` block) detaches the hook.
    """

    def __init__(self, optimizer: object, directory: str | os.PathLike, every: int = 1, *,
                 model: nn.Module | None = None, scaling: ScalingArg = None) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"GradientDumper: every must be a positive integer, got {every!r}")
        inner = inner_torch_optimizers(optimizer)
        if not inner:
            raise ValueError(f"GradientDumper: {type(optimizer).__name__} holds no torch optimizer on this rank")
        self.directory = check_writable_directory(directory)
        self.every = every
        self.optimizer = optimizer
        self.model = model
        self.next_step = 0
        self.dumped_steps: list[int] = []
        self._scaling = scaling_source(optimizer, scaling)
        self._handle = inner[0].register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step, self.next_step = self.next_step, self.next_step + 1
        if step % self.every == 0:
            self.dump(step)

    @torch.no_grad()
    def dump(self, step: int) -> Path:
        """Write this rank's gradients now under ``step``; return the index path.

        The hook calls this; called by hand (e.g. right after ``backward()``) it records the
        factors the scaling source reports, which a wrapper may not have applied yet.
        """
        scaling: GradientScaling = self._scaling()
        names = {} if self.model is None else parameters_by_tensor(model_parameters(self.model), self.optimizer)
        shards = megatron_shards(self.optimizer)
        tensors: dict[str, torch.Tensor] = {}
        records: list[ParamRecord] = []
        for slot in optimizer_slots(self.optimizer):
            grad = slot.tensor.grad
            if grad is None:
                continue
            shard = shards.get(id(slot.tensor))
            parameter = names.get(id(slot.tensor))
            name = parameter.name if parameter is not None else f"<unnamed {slot.where}>"
            marked = [slot.tensor] + ([parameter.master] if parameter is not None else [])
            marked += [shard.model_param] if shard is not None else []
            is_expert = any(getattr(tensor, "allreduce", True) is False for tensor in marked)
            global_shape, pieces = _local_pieces(grad, shard, self._layout(slot, parameter, name), name)
            for part, (local, placement) in enumerate(pieces):
                key = name if len(pieces) == 1 else f"{name}#block{part}"
                key = key if key not in tensors else f"{key}@{slot.where}"
                tensors[key] = local.detach().cpu().clone().contiguous()
                records.append(ParamRecord(
                    name=name, module_class=parameter.module_class if parameter is not None else "",
                    key=key, optimizer_slot=[slot.optimizer_index, slot.group_index, slot.position],
                    tensor_id=id(slot.tensor), global_shape=global_shape, local_shape=list(local.shape),
                    dtype=str(local.dtype), placement=placement, is_expert=is_expert,
                    grad_factor=scaling.factor_for(is_expert)))
        rank, world_size = _rank_and_world()
        index = write_rank_dump(self.directory, step, rank, world_size, tensors, records, scaling.to_dict())
        self.dumped_steps.append(step)
        return index

    def _layout(self, slot: OptimizerSlot, parameter: ModelParameter | None, name: str) -> ShardLayout | None:
        """The Megatron tensor- / expert-parallel layout of a stepped tensor (None: not such a shard, or a
        DTensor, which records its own); its Megatron attributes are on the model parameter."""
        carrier = parameter.master if parameter is not None else slot.tensor
        if isinstance(carrier, DTensor) or not any(hasattr(carrier, a) for a in ("tensor_model_parallel", "allreduce")):
            return None
        from megatron_vllm_align.megatron.vllm_tensor_parallel import is_gated_fc1, shard_layout

        if self.model is None:
            if shard_layout(carrier, False) is not None:
                raise GradientDumpError(f"GradientDumper: {name!r} is a tensor-parallel shard; pass model= so "
                                        "that its place in the full tensor is known")
            return None
        return shard_layout(carrier, is_gated_fc1(self.model, name))

    def remove(self) -> None:
        """Detach the hook; no further dumps."""
        self._handle.remove()

    def __enter__(self) -> GradientDumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

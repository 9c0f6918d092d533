"""The tensors an optimizer steps, found by identity, through Megatron-Core's optimizer wrappers.

A plain ``torch.optim.Optimizer`` steps the tensors in its ``param_groups``. A Megatron-Core optimizer
(``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``: ``.optimizer``;
``ChainedOptimizer``: ``.chained_optimizers``) wraps a torch optimizer and steps each model parameter's
``main_param`` (for the distributed optimizer a 1-D fp32 shard covering the parameter's flat range), so
a step pre-hook on the first inner torch optimizer sees every member's final gradient. Any other wrapper
that exposes its torch optimizer as ``.optimizer`` is handled the same way. What each wrapper does,
read from megatron-core 0.16.1 (not run here: they need CUDA):
docs/megatron_facts.md#megatron-cores-optimizer-wrappers-guardsoptimizer_slotspy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vllm_align.guards.parameters import ModelParameter


@dataclass(frozen=True)
class OptimizerSlot:
    """One tensor an optimizer steps: ``inner_optimizers[optimizer_index].param_groups[group_index]
    ["params"][position]``."""

    optimizer_index: int
    group_index: int
    position: int
    tensor: torch.Tensor

    @property
    def where(self) -> str:
        return f"optimizer[{self.optimizer_index}].param_groups[{self.group_index}][{self.position}]"


def inner_torch_optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    """The torch optimizers that ``optimizer`` steps, in stepping order (Megatron stubs skipped).

    Raises TypeError for an object that is neither a torch optimizer nor a wrapper of one.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for member in chained for inner in inner_torch_optimizers(member)]
    if hasattr(optimizer, "optimizer"):
        inner = optimizer.optimizer
        return [] if inner is None else inner_torch_optimizers(inner)
    raise TypeError(f"{type(optimizer).__name__} is neither a torch.optim.Optimizer nor a wrapper exposing "
                    "one as .optimizer / .chained_optimizers")


def optimizer_slots(optimizer: object) -> list[OptimizerSlot]:
    """Every tensor the optimizer steps, with its position."""
    return [OptimizerSlot(opt_index, group_index, position, tensor)
            for opt_index, inner in enumerate(inner_torch_optimizers(optimizer))
            for group_index, group in enumerate(inner.param_groups)
            for position, tensor in enumerate(group["params"])]


def stepped_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor an optimizer steps for model parameter ``param``: Megatron's fp32 ``main_param``
    (full copy or distributed-optimizer shard) when the optimizer attached one, else ``param``."""
    main = getattr(param, "main_param", None)
    return param if main is None else main


@dataclass(frozen=True)
class MegatronShard:
    """A Megatron ``DistributedOptimizer`` shard: elements [start, end) of flattened ``model_param``."""

    model_param: torch.Tensor
    start: int
    end: int


def megatron_shards(optimizer: object) -> dict[int, MegatronShard]:
    """id(tensor the inner optimizer steps) -> its :class:`MegatronShard`, for the
    ``DistributedOptimizer`` members of ``optimizer``; empty for every other optimizer."""
    members = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    shards: dict[int, MegatronShard] = {}
    for member in members:
        if not hasattr(member, "_get_model_param_range_map") or getattr(member, "is_stub_optimizer", False):
            continue
        model_groups = member.model_float16_groups + member.model_fp32_groups
        shard_groups = member.shard_fp32_from_float16_groups + member.shard_fp32_groups
        for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
            for model_param, shard in zip(model_group, shard_group, strict=True):
                if shard is not None:
                    param_range = member._get_model_param_range_map(model_param)["param"]
                    shards[id(shard)] = MegatronShard(model_param, param_range.start, param_range.end)
    return shards


def slots_by_tensor(optimizer: object) -> dict[int, OptimizerSlot]:
    """id(tensor) -> its slot, for each stepped tensor and for the model parameter behind each
    Megatron distributed-optimizer shard."""
    shards = megatron_shards(optimizer)
    by_id: dict[int, OptimizerSlot] = {}
    for slot in optimizer_slots(optimizer):
        by_id[id(slot.tensor)] = slot
        shard = shards.get(id(slot.tensor))
        if shard is not None:
            by_id[id(shard.model_param)] = slot
    return by_id


def slot_of(param: torch.Tensor, by_id: dict[int, OptimizerSlot]) -> OptimizerSlot | None:
    """The slot that steps model parameter ``param`` (by identity), or None."""
    slot = by_id.get(id(stepped_tensor(param)))
    return slot if slot is not None else by_id.get(id(param))


def parameters_by_tensor(params: dict[str, ModelParameter], optimizer: object) -> dict[int, ModelParameter]:
    """id(every tensor standing for a model parameter) -> that parameter: its master, registered
    tensor and FSDP2 copy, their Megatron ``main_param``, and Megatron distributed-optimizer shards."""
    by_id: dict[int, ModelParameter] = {}
    for parameter in params.values():
        for tensor in (parameter.master, parameter.registered, parameter.unsharded):
            if tensor is not None:
                by_id.setdefault(id(tensor), parameter)
                by_id.setdefault(id(stepped_tensor(tensor)), parameter)
    for shard_id, shard in megatron_shards(optimizer).items():
        if id(shard.model_param) in by_id:
            by_id.setdefault(shard_id, by_id[id(shard.model_param)])
    return by_id

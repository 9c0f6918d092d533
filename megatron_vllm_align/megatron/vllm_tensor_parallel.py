"""Tensor parallelism of the vLLM-forward layers: a TP = T trainer computes what vLLM's engine with
``tensor_parallel_size = T`` computes.

Each rank's shadow vLLM layers are TP = 1 layers of the rank's local shapes, followed by Megatron's own
collectives on its tensor-parallel group: column-parallel linears (``linear_qkv``, ``linear_fc1``, the
output layer) keep local rows ``[out / T, in]`` with ``gather_output`` False; row-parallel ones
(``linear_proj``, ``linear_fc2``) keep local columns ``[out, in / T]`` and all-reduce (SUM) the bf16
partial outputs; the output layer all-gathers the logits. A row-parallel bias at T > 1 is refused.
FP8 per-channel weight scales of a row-parallel shard come from the whole weight's amax
(:meth:`TensorParallelShard.weight_amax_over_shards`). :func:`local_shard` slices a full (TP = 1)
state-dict entry to this rank's shard from the parameter's Megatron attributes; :func:`full_tensor`
reassembles a full tensor from every rank's shard. vLLM's sharding and reduction, and why T = 2 is
bitwise: docs/megatron_facts.md#tensor-parallelism-megatronvllm_tensor_parallelpy.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_vllm_align.utils.dtensors import is_dtensor

# vLLM pads the vocabulary to a multiple of this before sharding it (DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PADDING = 64


def tensor_parallel_group(tp_group: Any = None) -> Any:
    """Megatron's tensor-parallel group (``tp_group`` when given); None without torch.distributed."""
    return get_tensor_model_parallel_group_if_none(tp_group)


def _world_and_rank(group: Any) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), group.rank())


@dataclasses.dataclass(frozen=True)
class TensorParallelShard:
    """One linear's place in the tensor-parallel layout (module docstring).

    ``mode``: ``"column"`` (output rows sharded) or ``"row"`` (input columns sharded);
    ``world_size`` T and ``rank`` in ``group`` (Megatron's TP group; None for one process).
    """

    mode: Literal["column", "row"]
    group: Any
    world_size: int
    rank: int

    @classmethod
    def of_megatron_linear(cls, builder_kwargs: dict[str, Any], tp_group: Any) -> TensorParallelShard:
        """The shard of a linear Megatron builds with ``builder_kwargs``: ``input_is_parallel`` marks a
        row-parallel linear, ``gather_output`` a column-parallel one (Megatron's two signatures)."""
        if "input_is_parallel" in builder_kwargs:
            if not builder_kwargs["input_is_parallel"]:
                raise ValueError("a row-parallel vLLM-forward linear needs input_is_parallel=True")
            mode: Literal["column", "row"] = "row"
        elif "gather_output" in builder_kwargs:
            if builder_kwargs["gather_output"]:
                raise ValueError("a column-parallel vLLM-forward linear needs gather_output=False "
                                 "(vLLM's parallel linears keep the output sharded)")
            mode = "column"
        else:
            raise ValueError("the linear is built without gather_output or input_is_parallel: cannot tell a "
                             "column- from a row-parallel Megatron linear")
        group = tensor_parallel_group(tp_group)
        return cls(mode, group, *_world_and_rank(group))

    def local_sizes(self, input_size: int, output_size: int) -> tuple[int, int]:
        """(local input, local output) features; ValueError unless the sharded size divides by T."""
        sharded = output_size if self.mode == "column" else input_size
        if sharded % self.world_size:
            side = "output" if self.mode == "column" else "input"
            raise ValueError(f"{self.mode}-parallel linear: {side} size {sharded} is not divisible by tensor "
                             f"parallel size {self.world_size}")
        if self.mode == "column":
            return input_size, output_size // self.world_size
        return input_size // self.world_size, output_size

    def check_bias(self, bias: bool) -> None:
        """ValueError for a row-parallel bias at T > 1 (module docstring)."""
        if bias and self.mode == "row" and self.world_size > 1:
            raise ValueError("a row-parallel linear with a bias is not supported at tensor parallel size > 1 "
                             "(vLLM adds it on rank 0 before the reduction; no served Llama/Qwen layer has one)")

    def mark(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None) -> None:
        """Set Megatron's tensor-parallel attributes (read by its gradient-norm and checkpoint code)."""
        dim = 0 if self.mode == "column" else 1
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
        if bias is not None:
            set_tensor_model_parallel_attributes(bias, is_parallel=self.mode == "column", dim=0, stride=1)

    @contextlib.contextmanager
    def weight_amax_over_shards(self, quantized: bool) -> Iterator[None]:
        """While a quantized shadow processes its weight: vLLM's online FP8 methods take a weight amax
        reduced (MAX) over the engine's TP group when the weight is sharded along a dim the amax reduces
        (``amax_for_tp_weight_quant``), so a row-parallel shard's per-channel scales are the whole
        weight's. The shadow is a TP = 1 layer; here the same MAX runs over Megatron's TP group.
        Only the per-channel method is served, whose amax reduces the input dim: row-parallel only.
        Collective: every rank of the group refreshes its shard together (they do, after each step)."""
        if not quantized or self.mode != "row" or self.world_size == 1:
            yield
            return
        from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

        original = online_fp8.amax_for_tp_weight_quant

        def amax_over_shards(amax: torch.Tensor, is_sharded: bool) -> torch.Tensor:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.group)
            return amax

        online_fp8.amax_for_tp_weight_quant = amax_over_shards
        try:
            yield
        finally:
            online_fp8.amax_for_tp_weight_quant = original

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The local GEMM's input: column-parallel: identity forward, gradient all-reduced over TP."""
        if self.mode == "column" and self.world_size > 1:
            return copy_to_tensor_model_parallel_region(x, group=self.group)
        return x

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output: row-parallel: all-reduce (SUM) of the partial outputs over TP."""
        if self.mode == "row" and self.world_size > 1:
            return reduce_from_tensor_model_parallel_region(y, group=self.group)
        return y


def vocab_shard(vocab_size: int, world_size: int) -> int:
    """Rows of the output layer on one rank; ValueError unless vLLM's padded shards are the same rows."""
    if world_size == 1:
        return vocab_size
    if vocab_size % (VLLM_VOCAB_PADDING * world_size):
        raise ValueError(f"vocab_size {vocab_size} at tensor parallel size {world_size}: vLLM pads the vocabulary "
                         f"to a multiple of {VLLM_VOCAB_PADDING} before sharding it; the trainer's shards are the "
                         f"engine's only when vocab_size is a multiple of {VLLM_VOCAB_PADDING * world_size}")
    return vocab_size // world_size


def output_logits_enter(hidden: torch.Tensor) -> torch.Tensor:
    """The output layer's input: its gradient all-reduced over TP (no-op at T = 1)."""
    group = tensor_parallel_group()
    if _world_and_rank(group)[0] == 1:
        return hidden
    return copy_to_tensor_model_parallel_region(hidden, group=group)


def output_logits_gather(local_logits: torch.Tensor) -> torch.Tensor:
    """[..., V / T] -> [..., V]: the logits of every vocabulary shard, in rank order (no-op at T = 1)."""
    group = tensor_parallel_group()
    if _world_and_rank(group)[0] == 1:
        return local_logits
    return gather_from_tensor_model_parallel_region(local_logits, group=group)


def mark_megatron_shards(model: torch.nn.Module) -> None:
    """Set the tensor-parallel attributes Megatron's own ``ColumnParallelLinear`` / ``RowParallelLinear`` /
    ``VocabParallelEmbedding`` weights lack when built with ``perform_initialization=False`` (Megatron sets
    them only while initialising), so that :func:`local_shard` and Megatron's gradient norm see the shards."""
    for module in model.modules():
        dim = {ColumnParallelLinear: 0, VocabParallelEmbedding: 0, RowParallelLinear: 1}.get(type(module))
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def is_gated_fc1(model: torch.nn.Module, name: str) -> bool:
    """True for the parameter ``name`` of ``model`` that is a gated MLP's ``linear_fc1`` (``[gate; up]`` rows)."""
    return bool(getattr(getattr(model, "config", None), "gated_linear_unit", False)) and ".linear_fc1." in name


def _is_expert_parallel(param: torch.Tensor) -> bool:
    """Megatron's expert-parallel marker (``allreduce = False``)."""
    return getattr(param, "allreduce", True) is False


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where one rank's shard of a parameter sits in the full (TP = 1) tensor.

    The full tensor is ``blocks`` equal blocks along ``dim`` (2 for a gated ``linear_fc1``'s
    ``[gate; up]``, else 1); each block is cut into ``world`` equal parts, and rank ``rank`` of
    ``group`` holds part ``rank`` of every block, concatenated along ``dim``.
    """

    dim: int
    world: int
    rank: int
    blocks: int
    group: Any

    def full_size(self, local_size: int) -> int:
        """Size along ``dim`` of the full tensor whose shard has ``local_size``."""
        return local_size * self.world

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full``."""
        return torch.cat([block.chunk(self.world, dim=self.dim)[self.rank]
                          for block in full.chunk(self.blocks, dim=self.dim)], dim=self.dim)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (``parts[r]``: rank r's)."""
        cut = [part.chunk(self.blocks, dim=self.dim) for part in parts]
        return torch.cat([blocks[b] for b in range(self.blocks) for blocks in cut], dim=self.dim)

    def local_blocks(self, local: torch.Tensor) -> list[tuple[torch.Tensor, list[int]]]:
        """This rank's shard cut into its blocks, each with its element offsets in the full tensor."""
        part = local.shape[self.dim] // self.blocks
        placed = []
        for b, block in enumerate(local.chunk(self.blocks, dim=self.dim)):
            offsets = [0] * local.dim()
            offsets[self.dim] = b * part * self.world + self.rank * part
            placed.append((block, offsets))
        return placed


def shard_layout(param: torch.Tensor, gated_fc1: bool) -> ShardLayout | None:
    """The :class:`ShardLayout` of ``param`` from its Megatron attributes: an expert-parallel parameter
    holds its block of experts along dim 0 of the expert-model-parallel group, a tensor-parallel one its
    ``partition_dim`` shard over the tensor-parallel group (``gated_fc1``: a gated ``linear_fc1``, whose
    shard is ``[gate shard; up shard]``). None for a replicated parameter, a group of one rank, or without
    Megatron's parallel state (nothing is sharded by it)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    if _is_expert_parallel(param):
        group, dim = parallel_state.get_expert_model_parallel_group(), 0
    elif getattr(param, "tensor_model_parallel", False):
        group, dim = tensor_parallel_group(), param.partition_dim
    else:
        return None
    world, rank = _world_and_rank(group)
    if world == 1:
        return None
    return ShardLayout(dim, world, rank, 2 if gated_fc1 and not _is_expert_parallel(param) else 1, group)


def local_shard(name: str, full: torch.Tensor, param: torch.Tensor, gated_fc1: bool) -> torch.Tensor:
    """This rank's part of ``full`` (a TP = 1 Megatron tensor) for ``param`` (:func:`shard_layout`).
    ValueError when the shapes do not fit."""
    if full.shape == param.shape:
        return full
    layout = shard_layout(param, gated_fc1)
    if layout is None:
        raise ValueError(f"{name!r} has shape {tuple(param.shape)}, tensor has {tuple(full.shape)}")
    if full.shape[layout.dim] != layout.full_size(param.shape[layout.dim]):
        raise ValueError(f"{name!r}: shard {tuple(param.shape)} x parallel size {layout.world} along dim "
                         f"{layout.dim} does not make the tensor's {tuple(full.shape)}")
    return layout.local_part(full)


def full_tensor(local: torch.Tensor, param: torch.Tensor, gated_fc1: bool) -> torch.Tensor:
    """The TP = 1 tensor of ``param``'s shards (``local``: this rank's, e.g. its gradient); the inverse
    of :func:`local_shard`. Collective over the parameter's group (:func:`shard_layout`); a DTensor
    ``local`` (FSDP2) is gathered over its mesh."""
    if is_dtensor(local):
        return local.full_tensor()
    layout = shard_layout(param, gated_fc1)
    if layout is None:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.world)]
    torch.distributed.all_gather(parts, local.contiguous(), group=layout.group)
    return layout.assemble(parts)


def sum_head_norm_grads(model: torch.nn.Module) -> int:
    """Sum the gradients of ``q_layernorm`` / ``k_layernorm`` over the tensor-parallel group (in place);
    returns how many. Those norm weights are replicated, but each rank's norm sees only its own heads,
    so its gradient is a partial sum; Megatron's ``finalize_model_grads`` makes the same SUM when
    ``qk_layernorm`` is on (its ``_allreduce_non_tensor_model_parallel_grads`` needs Megatron's DDP
    wrapper, which the CPU trainer does not use). Call after backward, before any data-parallel
    reduction; a no-op at TP = 1. Collective."""
    group = tensor_parallel_group()
    if _world_and_rank(group)[0] == 1:
        return 0
    grads = [param.grad for name, param in model.named_parameters()
             if param.grad is not None and ("q_layernorm" in name or "k_layernorm" in name)]
    if grads:
        flat = torch.cat([grad.reshape(-1).float() for grad in grads])
        torch.distributed.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return len(grads)

"""A trainer of another tensor-parallel layout than the engine's, computing the engine's bits.

A TP = T engine splits every linear's GEMM: column-parallel linears (``qkv_proj``, ``gate_up_proj``, the
lm_head) compute a slice of the output columns per rank, row-parallel ones (``o_proj``, ``down_proj``) a
partial product over a slice of K per rank, summed by an all-reduce in the model dtype. A TP = 1 trainer
running one GEMM per linear rounds the row-parallel sums differently. Here each vLLM kernel of a TP = 1
trainer is replaced by the engine's T shard kernels (TP = 1 vLLM layers of the shards' shapes, loaded from
slices of the master weight): column-parallel outputs are copied back in the master's column order
(no arithmetic), row-parallel partial products are added in the model dtype in rank order. At T = 2 that
sum is the engine's all-reduce exactly (one rounding of ``a + b``, the same in either order); larger T
would depend on the all-reduce's order and accumulation dtype, and is refused. Attention runs each rank's
group of heads as its own kernel call (``VllmDotProductAttention(head_shards=T)``), so no kernel sees
another head count than the engine's. The rest (norms, rotary, embedding, SiLU-and-mul, the logprob) is
computed per token and is the same at any T. Only the forward changes: the backward is the TP = 1
trainer's own.
Unquantized dense models only: FP8 and MoE layouts are refused by name. Measured:
docs/megatron_facts.md#cross-layout-parity-megatronengine_layoutpy.
"""
from __future__ import annotations

from typing import Literal

import torch

from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel
from megatron_vllm_align.ops.vllm_context import VllmContext
from megatron_vllm_align.utils.engine_layouts import engine_shards_for


def engine_shards(context: VllmContext, trainer_tp: int) -> int:
    """How many engine shards each vLLM kernel of a trainer at ``trainer_tp`` runs against the engine of
    ``context`` (its ``spec.tensor_parallel_size``): ``utils.engine_layouts.engine_shards_for``."""
    return engine_shards_for(context.spec.tensor_parallel_size, trainer_tp)


def _shard_blocks(segments: tuple[int, ...], shards: int) -> list[list[tuple[slice, slice]]]:
    """Per engine rank, ``(master rows, rank output columns)`` slice pairs: the rank's slice of each segment,
    stacked in segment order in its own output (vLLM's merged column-parallel layout)."""
    blocks: list[list[tuple[slice, slice]]] = [[] for _ in range(shards)]
    start = local = 0
    for width in segments:
        if width % shards:
            raise ValueError(f"output segment of {width} rows is not divisible by the engine's {shards} shards")
        part = width // shards
        for rank in range(shards):
            blocks[rank].append((slice(start + rank * part, start + (rank + 1) * part), slice(local, local + part)))
        start, local = start + width, local + part
    return blocks


class EngineShardedLinearKernel:
    """The engine's T shard kernels of one linear, called as one kernel (``VllmLinearKernel``'s interface).

    ``mode="column"``: ``segments`` are the widths of the output's stacked blocks (``[q | k | v]``,
    ``[gate | up]``, or the whole output), each split into T consecutive slices, rank r holding slice r of
    every block (vLLM's merged column-parallel layout); ``kernel(x) [M, N]`` is in the master's row order.
    ``mode="row"``: rank r holds columns ``[r K/T, (r+1) K/T)``; ``kernel(x)`` is the rank-ordered sum of
    the partial products in the model dtype. Unquantized only; a row-parallel bias is refused (as at TP > 1).
    """

    def __init__(self, context: VllmContext, in_features: int, out_features: int, bias: bool, quantized: bool,
                 prefix: str = "", *, mode: Literal["column", "row"], shards: int,
                 segments: tuple[int, ...] | None = None) -> None:
        if quantized:
            raise ValueError(f"{prefix or 'linear'}: a quantized linear of a TP={shards} engine is not emulated at "
                             "trainer TP 1 (its weight scales are per shard); run the trainer at the engine's size")
        if mode == "row" and bias:
            raise ValueError(f"{prefix or 'linear'}: a row-parallel bias at engine TP {shards} is not supported")
        if mode == "row" and in_features % shards:
            raise ValueError(f"{prefix or 'linear'}: input size {in_features} is not divisible by {shards} shards")
        self.context, self.in_features, self.out_features = context, in_features, out_features
        self.has_bias, self.quantized, self.prefix = bias, quantized, prefix
        self.mode, self.shards = mode, shards
        self.segments = (out_features,) if segments is None else tuple(segments)
        if mode == "column":
            if sum(self.segments) != out_features:
                raise ValueError(f"output segments {self.segments} do not add up to {out_features}")
            self.shard_blocks = _shard_blocks(self.segments, shards)
            sizes = [(in_features, out_features // shards)] * shards
        else:
            sizes = [(in_features // shards, out_features)] * shards
        self.kernels = [VllmLinearKernel(context, k, n, bias, False, prefix) for k, n in sizes]

    def fresh(self) -> EngineShardedLinearKernel:
        """An unloaded kernel configured like this one."""
        return EngineShardedLinearKernel(self.context, self.in_features, self.out_features, self.has_bias,
                                         self.quantized, self.prefix, mode=self.mode, shards=self.shards,
                                         segments=self.segments)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Load each shard kernel from its slice of master ``weight`` [N, K] (and ``bias`` [N])."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight must be {(self.out_features, self.in_features)}, got {tuple(weight.shape)}")
        for rank, kernel in enumerate(self.kernels):
            if self.mode == "column":
                rows = [master for master, _ in self.shard_blocks[rank]]
                kernel.load(torch.cat([weight[r] for r in rows]),
                            None if bias is None else torch.cat([bias[r] for r in rows]))
            else:
                width = self.in_features // self.shards
                kernel.load(weight[:, rank * width:(rank + 1) * width], bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "column":
            out = x.new_empty(x.shape[0], self.out_features)
            for kernel, blocks in zip(self.kernels, self.shard_blocks):
                local = kernel(x)
                for master, columns in blocks:
                    out[:, master] = local[:, columns]
            return out
        width = self.in_features // self.shards
        out = None
        for rank, kernel in enumerate(self.kernels):
            partial = kernel(x[:, rank * width:(rank + 1) * width].contiguous())
            out = partial if out is None else out + partial
        return out


class EngineShardedLMHeadKernel:
    """The engine's T vocabulary shards of the lm_head, called as one ``VllmLMHeadKernel``: rank r's logits
    are those of rows ``[r V/T, (r+1) V/T)``, concatenated in rank order (the engine's gather)."""

    def __init__(self, context: VllmContext, vocab_size: int, hidden_size: int, logit_scale: float = 1.0, *,
                 shards: int) -> None:
        self.context, self.vocab_size, self.hidden_size, self.logit_scale = context, vocab_size, hidden_size, \
            logit_scale
        self.shards = shards
        self.kernels = [VllmLMHeadKernel(context, vocab_size // shards, hidden_size, logit_scale)
                        for _ in range(shards)]

    def fresh(self) -> EngineShardedLMHeadKernel:
        """An unloaded kernel configured like this one."""
        return EngineShardedLMHeadKernel(self.context, self.vocab_size, self.hidden_size, self.logit_scale,
                                         shards=self.shards)

    def load(self, weight: torch.Tensor) -> None:
        """Load each shard from its rows of the output weight [V, h]."""
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"output weight must be {(self.vocab_size, self.hidden_size)}, got {tuple(weight.shape)}")
        rows = self.vocab_size // self.shards
        for rank, kernel in enumerate(self.kernels):
            kernel.load(weight[rank * rows:(rank + 1) * rows])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([kernel(x) for kernel in self.kernels], dim=-1)


"""Layer-1 case of ``attention``: several sequences of unaligned lengths packed as the engine packs
prompts.

A lone one-token sequence is not a case of its own: there dq = dk = 0 exactly (softmax over one key),
only an absolute bound applies, and the contract's atol = 0 cannot absorb the fp32 cancellation noise
(~1e-7) of dS = P (dP - rowsum(dO O)); one-token sequences are covered inside the packed batches,
where the global bounds apply. (Open: derive an absolute floor in the contract.)
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.attention.module import VllmCausalAttentionFunction
from megatron_vllm_align.ops.attention.reference import ReferenceAttention
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16

PACKING = {37: (1, 7, 29), 300: (1, 16, 283)}   # sequence lengths per token count


class PackedCausalAttention(nn.Module):
    """``forward(q, k, v)`` = :class:`VllmCausalAttentionFunction` on fixed packed ``seq_lens``."""

    def __init__(self, seq_lens: tuple[int, ...], scale: float) -> None:
        super().__init__()
        self.seq_lens, self.scale = seq_lens, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return VllmCausalAttentionFunction.apply(q, k, v, self.seq_lens, self.scale)


def attention_builder(widths: Widths):
    """``build(seed, tokens)``: q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim],
    ``N(0, 1)`` in bf16, packed as :data:`PACKING`."""
    scale = widths.head_dim ** -0.5

    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        lens = PACKING[tokens]
        qkv = [seeded_bf16(gen, tokens, heads, widths.head_dim).requires_grad_()
               for heads in (widths.heads, widths.kv_heads, widths.kv_heads)]
        return PackedCausalAttention(lens, scale), ReferenceAttention(lens, scale), qkv
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    token_counts = tuple(m for m in widths.token_counts if m in PACKING)
    return [Layer1Case(f"attention[heads={widths.heads}/{widths.kv_heads}x{widths.head_dim}]",
                       get_default_contract("attention"), {"input[0]": "q", "input[1]": "k", "input[2]": "v"},
                       attention_builder(widths), VllmCausalAttentionFunction, token_counts)]


OP = Op("attention", ("attention",), cases)

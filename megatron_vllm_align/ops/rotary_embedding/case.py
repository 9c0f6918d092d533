"""Layer-1 case of ``rotary_embedding``: q and k at positions starting at the seed (so each seed reads
other rows of the cos/sin table)."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16
from megatron_vllm_align.ops.rotary_embedding.module import RotaryFunction, VllmRotaryEmbedding
from megatron_vllm_align.ops.rotary_embedding.reference import ReferenceRotary

ROPE = {"rope_theta": 10000.0}
MAX_POSITION = 4096


def rotary_builder(context, widths: Widths):
    """``build(seed, tokens)``: positions ``seed .. seed + tokens - 1``, q [tokens, heads * head_dim] and
    k [tokens, kv_heads * head_dim] ``N(0, 1)`` in bf16."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = VllmRotaryEmbedding(widths.head_dim, MAX_POSITION, dict(ROPE), vllm_context=context)
        positions = torch.arange(seed, seed + tokens)
        return candidate, ReferenceRotary(widths.head_dim, widths.head_dim, ROPE["rope_theta"]), \
            [positions, seeded_bf16(gen, tokens, widths.heads * widths.head_dim).requires_grad_(),
             seeded_bf16(gen, tokens, widths.kv_heads * widths.head_dim).requires_grad_()]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    return [Layer1Case(f"rotary_embedding[heads={widths.heads}x{widths.head_dim}]",
                       get_default_contract("rotary_embedding"), {"input[1]": "q", "input[2]": "k"},
                       rotary_builder(contexts.bf16, widths), RotaryFunction, widths.token_counts)]


OP = Op("rotary_embedding", ("rotary_embedding",), cases)

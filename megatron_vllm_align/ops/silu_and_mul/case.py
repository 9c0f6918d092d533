"""Layer-1 case of ``silu_and_mul``: inputs scaled by 3 so gates reach SiLU's curved and flat parts."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16
from megatron_vllm_align.ops.silu_and_mul.module import SiluAndMulFunction, VllmSiluAndMul
from megatron_vllm_align.ops.silu_and_mul.reference import ReferenceSiluAndMul


def silu_and_mul_builder(context, ffn: int):
    """``build(seed, tokens)``: x = [gate | up] [tokens, 2 ffn], ``3 N(0, 1)`` in bf16."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        return VllmSiluAndMul(vllm_context=context), ReferenceSiluAndMul(), \
            [seeded_bf16(gen, tokens, 2 * ffn, scale=3.0).requires_grad_()]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    return [Layer1Case(f"silu_and_mul[ffn={widths.ffn}]", get_default_contract("silu_and_mul"),
                       {"input[0]": "input"}, silu_and_mul_builder(contexts.bf16, widths.ffn), SiluAndMulFunction,
                       widths.token_counts)]


OP = Op("silu_and_mul", ("silu_and_mul",), cases)

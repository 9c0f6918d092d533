"""Layer-1 case of ``dense_linear``: vLLM's unquantized linear with a bias, seeded weights."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.dense_linear.module import DenseLinearFunction, VllmDenseLinear
from megatron_vllm_align.ops.dense_linear.reference import ReferenceDenseLinear
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seed_parameters, seeded_bf16

LINEAR_ITEMS = {"input[0]": "input", "weight": "master_weight", "bias": "bias"}


def dense_linear_builder(context, in_features: int, out_features: int):
    """``build(seed, tokens)``: x [tokens, in_features] ``N(0, 1)`` in bf16."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = VllmDenseLinear(in_features, out_features, bias=True, vllm_context=context)
        seed_parameters(candidate, gen)
        return candidate, ReferenceDenseLinear(candidate.weight, candidate.bias), \
            [seeded_bf16(gen, tokens, in_features).requires_grad_()]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    return [Layer1Case(f"dense_linear[{widths.hidden}->{widths.linear_out}]", get_default_contract("dense_linear"),
                       LINEAR_ITEMS, dense_linear_builder(contexts.bf16, widths.hidden, widths.linear_out),
                       DenseLinearFunction, widths.token_counts)]


OP = Op("dense_linear", ("dense_linear",), cases)

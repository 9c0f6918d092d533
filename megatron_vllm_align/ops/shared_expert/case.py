"""Layer-1 case of ``shared_expert``: the gated shared expert of a Qwen2-MoE block.

M = 1 is not a case: there dWg rests on one scalar dot product whose relative error is unbounded when
it cancels (docs/moe_facts.md#layer-1-of-the-shared-expert-why-m--1-is-not-a-case); from M = 37 dWg sums
over tokens and the bound holds. The other paths at M = 1 are the dense ops' VJPs, covered by their own
cases.
"""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16
from megatron_vllm_align.ops.shared_expert.module import SharedExpertFunction, VllmSharedExpert
from megatron_vllm_align.ops.shared_expert.reference import ReferenceSharedExpert

ITEMS = {"input[0]": "input", "fc1_weight": "fc1_weight", "fc2_weight": "fc2_weight", "gate_weight": "gate_weight"}
TINY_SHARED_FFN = 80


def shared_expert_builder(context, hidden: int, ffn: int,
                          candidate_cls: type[VllmSharedExpert] = VllmSharedExpert):
    """``build(seed, tokens)``: masters scaled by ``1 / sqrt(fan_in)``, x ``N(0, 1)`` in bf16; the
    reference's visible value is the candidate kernel's step-by-step output."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        module = candidate_cls(hidden, ffn, vllm_context=context)
        with torch.no_grad():
            module.fc1_weight.copy_(seeded_bf16(gen, 2 * ffn, hidden, scale=hidden ** -0.5))
            module.fc2_weight.copy_(seeded_bf16(gen, hidden, ffn, scale=ffn ** -0.5))
            module.gate_weight.copy_(seeded_bf16(gen, 1, hidden, scale=hidden ** -0.5))
        module.refresh_deployed()
        reference = ReferenceSharedExpert(module.fc1_weight, module.fc2_weight, module.gate_weight,
                                          lambda x: module.kernel.parts(x).out)
        return module, reference, [seeded_bf16(gen, tokens, hidden).requires_grad_()]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    ffn = TINY_SHARED_FFN if widths.hidden == Widths().hidden else widths.expert_ffn
    return [Layer1Case(f"shared_expert[sigmoid gate, hidden={widths.hidden}]", get_default_contract("shared_expert"),
                       ITEMS, shared_expert_builder(contexts.moe, widths.hidden, ffn), SharedExpertFunction,
                       tuple(m for m in widths.token_counts if m > 1))]


OP = Op("shared_expert", ("shared_expert",), cases)

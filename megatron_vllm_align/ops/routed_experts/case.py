"""Layer-1 case of ``routed_experts``: fixed routing in which one expert receives no token and one
receives most tokens, every token appearing top_k times."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16
from megatron_vllm_align.ops.routed_experts.module import RoutedExpertsFunction, VllmRoutedExperts
from megatron_vllm_align.ops.routed_experts.reference import ReferenceRoutedExperts

EMPTY, POPULAR = 5, 2   # expert EMPTY is never chosen, expert POPULAR by most tokens
ITEMS = {"input[0]": "input", "input[1]": "topk_weights", "fc1_weight": "expert_w13", "fc2_weight": "expert_w2"}


def fixed_routing(gen: torch.Generator, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IDs [tokens, top_k] int32 (distinct per token, :data:`EMPTY` never, :data:`POPULAR` mostly) and
    fp32 softmax weights [tokens, top_k]."""
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, POPULAR] += 0.8
    scores[:, EMPTY] = -1.0
    ids = scores.topk(top_k, dim=1).indices.int()
    return ids, torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)


def routed_experts_builder(context, widths: Widths, candidate_cls: type[VllmRoutedExperts] = VllmRoutedExperts):
    """``build(seed, tokens)``: masters scaled by ``1 / sqrt(fan_in)``, x ``N(0, 1)`` bf16, inputs
    ``[x, topk_weights, topk_ids]`` from :func:`fixed_routing`."""
    e, h, f, k = widths.experts, widths.hidden, widths.expert_ffn, widths.top_k

    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        experts = candidate_cls(e, h, f, k, vllm_context=context)
        with torch.no_grad():
            experts.fc1_weight.copy_(seeded_bf16(gen, e, 2 * f, h, scale=h ** -0.5))
            experts.fc2_weight.copy_(seeded_bf16(gen, e, h, f, scale=f ** -0.5))
        experts.refresh_deployed()
        ids, weights = fixed_routing(gen, tokens, e, k)
        reference = ReferenceRoutedExperts(experts.fc1_weight, experts.fc2_weight, experts.kernel)
        return experts, reference, [seeded_bf16(gen, tokens, h).requires_grad_(), weights.requires_grad_(), ids]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    return [Layer1Case(f"routed_experts[empty expert, repeated tokens, hidden={widths.hidden}]",
                       get_default_contract("routed_experts"), ITEMS, routed_experts_builder(contexts.moe, widths),
                       RoutedExpertsFunction, widths.token_counts)]


OP = Op("routed_experts", ("routed_experts",), cases)

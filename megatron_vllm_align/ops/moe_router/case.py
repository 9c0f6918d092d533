"""Layer-1 cases of ``moe_router``: renormalised and plain-softmax top-k, replayed IDs, many experts and
k = 1, each with exact logit ties (three router rows made identical, so the choice among tied experts
matters) and the IDs fixed by the candidate's vLLM kernel."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.moe_router.module import MoERouterFunction, VllmMoERouter
from megatron_vllm_align.ops.moe_router.reference import ReferenceMoERouter
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16

TIED = (1, 3, 5)   # router rows made identical: exact logit ties in every token
ITEMS = {"input[0]": "input", "weight": "router_weight"}


def visible_router(router: VllmMoERouter):
    """The candidate's vLLM kernel as the reference's visible forward (no gradients, IDs fixed by it)."""
    def visible(x, replay_ids):
        logits = router.kernel.logits(x)
        if replay_ids is None:
            weights, ids = router.kernel.select(x, logits)
        else:
            ids, weights = replay_ids.int(), router.kernel.weights_at(logits, replay_ids)
        return weights, ids, logits
    return visible


def router_builder(context, hidden: int, experts: int, top_k: int, renormalize: bool, replay: bool = False,
                   candidate_cls: type[VllmMoERouter] = VllmMoERouter):
    """``build(seed, tokens)``: router weight ``0.3 N(0, 1)`` with rows :data:`TIED` equal, x ``N(0, 1)``
    in bf16, and with ``replay`` random distinct IDs [tokens, top_k] as the second input."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        router = candidate_cls(hidden, experts, top_k, renormalize, vllm_context=context)
        with torch.no_grad():
            router.weight.copy_(seeded_bf16(gen, experts, hidden, scale=0.3))
            router.weight[list(TIED)] = router.weight[TIED[0]].clone()
        router.refresh_deployed()
        inputs = [seeded_bf16(gen, tokens, hidden).requires_grad_()]
        if replay:
            inputs.append(torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k])
        return router, ReferenceMoERouter(router.weight, renormalize, visible_router(router)), inputs
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    contract = get_default_contract("moe_router")
    h, e, k = widths.hidden, widths.experts, widths.top_k

    def case(label, build, token_counts=widths.token_counts):
        return Layer1Case(f"moe_router[{label}, hidden={h}]", contract, ITEMS, build, MoERouterFunction, token_counts)
    return [
        case("renormalize, ties", router_builder(contexts.moe, h, e, k, True)),
        case("no renormalisation, ties", router_builder(contexts.moe, h, e, k, False)),
        case("replayed ids", router_builder(contexts.moe, h, e, k, True, replay=True)),
        case("128 experts, k=8, ties", router_builder(contexts.moe, h, 128, 8, True)),
        case("k=1, ties", router_builder(contexts.moe, h, e, 1, True)),
    ]


OP = Op("moe_router", ("moe_router",), cases)

"""Layer 1 for the MoE router and routed experts: each against its independent float64 reference at
the same fixed expert IDs, with its contract's tolerances, over seeds, M = 1 / 37 / 300 and the
three dY kinds; exact top-k ties, empty experts, repeated routing and router replay covered; the
planted bugs of issue 4 are caught."""
import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.modules import routed_experts as routed_experts_module
from megatron_vllm_align.modules.linear import linear_vjp
from megatron_vllm_align.modules.moe_router import (
    MoERouterFunction,
    VllmMoERouter,
    routing_weights_vjp,
)
from megatron_vllm_align.modules.routed_experts import VllmRoutedExperts
from megatron_vllm_align.validation.layer1_suite import (
    Layer1Case,
    contract_tolerances,
    run_layer1_suite,
)
from megatron_vllm_align.validation.references.moe import (
    ReferenceMoERouter,
    ReferenceRoutedExperts,
)
from megatron_vllm_align.validation.vjp import compare_vjp

HIDDEN, FFN, EXPERTS, TOP_K = 128, 48, 8, 2  # FFN not a multiple of 16: vLLM pads it to 64
TIED = (1, 3, 5)        # router rows made identical: exact logit ties in every token
EMPTY, POPULAR = 5, 2   # routed-experts cases: expert 5 never chosen, expert 2 chosen by most tokens
SEEDS = range(5)  # as the README claims for every visible module
ROUTER_ITEMS = {"input[0]": "input", "weight": "router_weight"}
EXPERT_ITEMS = {"input[0]": "input", "input[1]": "topk_weights", "fc1_weight": "expert_w13",
                "fc2_weight": "expert_w2"}


@pytest.fixture(scope="module")
def context(tiny_moe_context):
    return tiny_moe_context("layer1_qwen3_moe", hidden_size=HIDDEN, intermediate_size=256,
                            moe_intermediate_size=FFN, num_attention_heads=2, num_key_value_heads=1)


def _bf16(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


def _visible_router(router):
    """The candidate's vLLM kernel as the reference's visible forward (no gradients, IDs fixed by it)."""
    def visible(x, replay_ids):
        logits = router.kernel.logits(x)
        if replay_ids is None:
            weights, ids = router.kernel.select(x, logits)
        else:
            ids, weights = replay_ids.int(), router.kernel.weights_at(logits, replay_ids)
        return weights, ids, logits
    return visible


def _router_builder(context, renormalize, replay=False, candidate_cls=VllmMoERouter, experts=EXPERTS, top_k=TOP_K):
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        router = candidate_cls(HIDDEN, experts, top_k, renormalize, vllm_context=context)
        with torch.no_grad():
            router.weight.copy_(_bf16(gen, experts, HIDDEN, scale=0.3))
            router.weight[list(TIED)] = router.weight[TIED[0]].clone()
        router.refresh_deployed()
        inputs = [_bf16(gen, tokens, HIDDEN).requires_grad_()]
        if replay:
            inputs.append(torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k])
        return router, ReferenceMoERouter(router.weight, renormalize, _visible_router(router)), inputs
    return build


def _routing(gen, tokens):
    """IDs [tokens, k] (distinct per token, expert EMPTY never, POPULAR mostly) and fp32 weights."""
    scores = torch.rand(tokens, EXPERTS, generator=gen)
    scores[:, POPULAR] += 0.8
    scores[:, EMPTY] = -1.0
    ids = scores.topk(TOP_K, dim=1).indices.int()
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)
    return ids, weights


def _experts_builder(context, candidate_cls=VllmRoutedExperts):
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        experts = candidate_cls(EXPERTS, HIDDEN, FFN, TOP_K, vllm_context=context)
        with torch.no_grad():
            experts.fc1_weight.copy_(_bf16(gen, EXPERTS, 2 * FFN, HIDDEN, scale=HIDDEN ** -0.5))
            experts.fc2_weight.copy_(_bf16(gen, EXPERTS, HIDDEN, FFN, scale=FFN ** -0.5))
        experts.refresh_deployed()
        ids, weights = _routing(gen, tokens)
        reference = ReferenceRoutedExperts(experts.fc1_weight, experts.fc2_weight, experts.kernel)
        return experts, reference, [_bf16(gen, tokens, HIDDEN).requires_grad_(), weights.requires_grad_(), ids]
    return build


def _cases(context):
    router, experts = get_default_contract("moe_router"), get_default_contract("routed_experts")
    return {
        "router[renormalize]": Layer1Case("moe_router[renormalize, ties]", router, ROUTER_ITEMS,
                                          _router_builder(context, True)),
        "router[softmax]": Layer1Case("moe_router[no renormalisation, ties]", router, ROUTER_ITEMS,
                                      _router_builder(context, False)),
        "router[replay]": Layer1Case("moe_router[replayed ids]", router, ROUTER_ITEMS,
                                     _router_builder(context, True, replay=True)),
        "router[128 experts, k=8]": Layer1Case("moe_router[128 experts, k=8, ties]", router, ROUTER_ITEMS,
                                               _router_builder(context, True, experts=128, top_k=8),
                                               token_counts=(1, 4096)),
        "router[k=1]": Layer1Case("moe_router[k=1, ties]", router, ROUTER_ITEMS,
                                  _router_builder(context, True, top_k=1)),
        "experts": Layer1Case("routed_experts[empty expert, repeated tokens]", experts, EXPERT_ITEMS,
                              _experts_builder(context)),
    }


@pytest.mark.parametrize("name", ["router[renormalize]", "router[softmax]", "router[replay]",
                                  "router[128 experts, k=8]", "router[k=1]", "experts"])
def test_moe_module_passes_layer1(context, name):
    case = _cases(context)[name]
    seeds = range(1) if name == "router[128 experts, k=8]" else SEEDS  # one seed at M = 4096 keeps it quick
    reports = run_layer1_suite([case], seeds=seeds)
    assert len(reports) == len(case.token_counts) * len(seeds)
    failures = [line for r in reports for line in r.failures]
    assert not failures, "\n".join(failures[:20])
    assert {c.dy_kind for r in reports for c in r.checks} == {"random", "zero", "sparse", "along_output"}
    assert {c.item for r in reports for c in r.checks} == set(case.variables)
    assert all(note.endswith("= 0") for r in reports for note in r.notes), "visible values are the candidate's"
    worst = {}
    for r in reports:
        for c in r.checks:
            if c.metrics is not None:
                worst[c.item] = max(worst.get(c.item, 0.0), c.metrics.rel_l2)
    print(f"{case.name}: worst rel_l2 " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))


def test_ties_are_exact_and_the_saved_ids_decide(context):
    router, _, inputs = _router_builder(context, True)(0, 37)
    logits = router.kernel.logits(inputs[0].detach())
    assert torch.equal(logits[:, TIED[0]], logits[:, TIED[1]]) and torch.equal(logits[:, TIED[0]], logits[:, TIED[2]])
    ids = router(inputs[0])[1]
    ties_at_boundary = sum(len(set(TIED) & set(row)) in (1, 2) for row in ids.tolist())
    assert ties_at_boundary > 0, "some tokens select part of the tied group: the choice among ties matters"


# Planted bugs: each must fail layer 1.

class _RecomputingRouterFunction(MoERouterFunction):
    """Planted: re-selects the top-k in backward on slightly perturbed scores (ties break the other way)."""

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids, grad_logits):
        x, weight, logits, _saved_ids = ctx.saved_tensors
        perturbed = logits.float() + 1e-3 * torch.arange(logits.shape[1], dtype=torch.float32)
        ids = perturbed.topk(_saved_ids.shape[1], dim=1).indices
        d_logits = routing_weights_vjp(grad_weights, logits, ids, ctx.renormalize) + grad_logits.float()
        grad_x, grad_w, _ = linear_vjp(d_logits.to(logits.dtype), x, weight.detach().to(ctx.model_dtype), None,
                                       x.dtype, weight.dtype, (True, True, False))
        return grad_x, grad_w, None, None


class _RecomputingRouter(VllmMoERouter):
    def forward(self, x, replay_ids=None):
        return _RecomputingRouterFunction.apply(x, self.weight, self.kernel, None)


class _DetachedCombineExperts(VllmRoutedExperts):
    def forward(self, x, topk_weights, topk_ids):
        return super().forward(x, topk_weights.detach(), topk_ids)


def _failing(case, seed=0, tokens=37):
    candidate, reference, inputs = case.build(seed, tokens)
    report = compare_vjp(candidate, reference, inputs, tolerances=contract_tolerances(case.contract, case.variables),
                         seed=seed)
    return {(c.item, c.status) for c in report.checks if not c.passed}


def test_planted_router_that_recomputes_ids_in_backward_is_caught(context):
    case = _cases(context)["router[renormalize]"]
    planted = Layer1Case("planted", case.contract, case.variables, _router_builder(context, True,
                                                                                  candidate_cls=_RecomputingRouter))
    # The re-selected experts are tied ones, whose gate rows are equal: dX = dlogits W cannot tell them
    # apart, dW (rows of other experts) can.
    assert ("weight", "tolerance") in _failing(planted)
    assert not _failing(case), "the correct router passes the same comparison"


def test_planted_detached_combine_weights_are_caught(context):
    case = _cases(context)["experts"]
    planted = Layer1Case("planted", case.contract, case.variables, _experts_builder(context, _DetachedCombineExperts))
    assert _failing(planted) == {("input[1]", "missing")}


def test_planted_wrong_inverse_permutation_is_caught(context, monkeypatch):
    monkeypatch.setattr(routed_experts_module, "_unsort", lambda values, order: values.clone())
    failing = _failing(_cases(context)["experts"])
    assert ("input[0]", "tolerance") in failing and ("input[1]", "tolerance") in failing


def test_planted_dropped_accumulation_of_repeated_tokens_is_caught(context, monkeypatch):
    monkeypatch.setattr(routed_experts_module, "_sum_token_copies",
                        lambda rows, top_k: rows.view(-1, top_k, rows.shape[-1])[:, -1])
    failing = _failing(_cases(context)["experts"])
    assert ("input[0]", "tolerance") in failing
    assert {item for item, _ in failing} == {"input[0]"}, "only dX sums a token's copies"

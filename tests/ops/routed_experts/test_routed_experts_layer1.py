"""Layer 1 for the routed experts, planted bugs: each must fail against the independent float64
reference at the same fixed expert IDs (the correct module passes in tests/ops/test_layer1_registry.py)."""
import torch

from megatron_vllm_align.ops.registry import Layer1Case, Widths, layer1_cases
from megatron_vllm_align.ops.routed_experts import case as routed_experts_case
from megatron_vllm_align.ops.routed_experts import vjp as routed_experts_vjp_module
from megatron_vllm_align.ops.routed_experts.module import VllmRoutedExperts


def _case(case_contexts):
    (case,) = routed_experts_case.cases(case_contexts, Widths())
    return case


class _DetachedCombineExperts(VllmRoutedExperts):
    def forward(self, x, topk_weights, topk_ids):
        return super().forward(x, topk_weights.detach(), topk_ids)


def test_routing_has_an_empty_and_a_popular_expert(case_contexts):
    _, _, (_, _, ids) = _case(case_contexts).build(0, 300)
    counts = torch.bincount(ids.flatten().long(), minlength=Widths().experts)
    assert counts[routed_experts_case.EMPTY] == 0 and int(counts.argmax()) == routed_experts_case.POPULAR


def test_planted_detached_combine_weights_are_caught(case_contexts, failing_checks):
    case = _case(case_contexts)
    planted = Layer1Case("planted", case.contract, case.variables,
                         routed_experts_case.routed_experts_builder(case_contexts.moe, Widths(),
                                                                    _DetachedCombineExperts),
                         case.function)
    assert failing_checks(planted) == {("input[1]", "missing")}
    assert not failing_checks(case), "the correct module passes the same comparison"


def test_planted_wrong_inverse_permutation_is_caught(case_contexts, failing_checks, monkeypatch):
    monkeypatch.setattr(routed_experts_vjp_module, "_unsort", lambda values, order: values.clone())
    failing = failing_checks(_case(case_contexts))
    assert ("input[0]", "tolerance") in failing and ("input[1]", "tolerance") in failing


def test_planted_dropped_accumulation_of_repeated_tokens_is_caught(case_contexts, failing_checks, monkeypatch):
    monkeypatch.setattr(routed_experts_vjp_module, "_sum_token_copies",
                        lambda rows, top_k: rows.view(-1, top_k, rows.shape[-1])[:, -1])
    failing = failing_checks(_case(case_contexts))
    assert ("input[0]", "tolerance") in failing
    assert {item for item, _ in failing} == {"input[0]"}, "only dX sums a token's copies"


def test_registered_under_its_contract(case_contexts):
    assert [c.name for c in layer1_cases(case_contexts) if c.contract.module_class == "routed_experts"] == \
        [_case(case_contexts).name]

"""Layer 1 for the Qwen2-MoE gated shared expert: vLLM's ``Qwen2MoeMLP`` forward, the closed-form
backward against the float64 reference with the ``routed_experts`` tolerances, over seeds,
M = 1 / 37 / 300 and the three dY kinds; its visible value is vLLM's layer bitwise; planted bugs caught."""
import sys

import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.modules import shared_expert as shared_expert_module
from megatron_vllm_align.modules.shared_expert import VllmSharedExpert
from megatron_vllm_align.validation.layer1_suite import (
    Layer1Case,
    contract_tolerances,
    run_layer1_suite,
)
from megatron_vllm_align.validation.references.moe import ReferenceSharedExpert
from megatron_vllm_align.validation.vjp import compare_vjp

HIDDEN, SHARED_FFN = 128, 80
SEEDS = range(5)  # as the README claims for every visible module
# Every shared-expert gradient passes four bf16 roundings (module docstring of modules.shared_expert),
# so each weight takes the contract's 4u bound of expert_w13 (the contract has no shared_* variables yet).
ITEMS = {"input[0]": "input", "fc1_weight": "expert_w13", "fc2_weight": "expert_w13", "gate_weight": "expert_w13"}
# At M = 1 dWg = d_logit x with the scalar d_logit = <dY, down> s (1 - s): a sparse dY makes that dot
# product cancel, and no relative bound holds (measured rel_l2 up to 0.08 at seed 0). Sparse dY is
# covered at M = 37 and 300, where dWg sums over tokens.
M1_DY_KINDS = ("random", "zero")


@pytest.fixture(scope="module")
def context(tiny_moe_context):
    """A tiny Qwen2-MoE (head_dim 64 = hidden / heads, as Qwen2-MoE derives it)."""
    return tiny_moe_context("layer1_qwen2_moe", architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                            hidden_size=HIDDEN, intermediate_size=256, moe_intermediate_size=64,
                            shared_expert_intermediate_size=SHARED_FFN, norm_topk_prob=False,
                            num_attention_heads=2, num_key_value_heads=1)


def _bf16(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


def _builder(context):
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        module = VllmSharedExpert(HIDDEN, SHARED_FFN, vllm_context=context)
        with torch.no_grad():
            module.fc1_weight.copy_(_bf16(gen, 2 * SHARED_FFN, HIDDEN, scale=HIDDEN ** -0.5))
            module.fc2_weight.copy_(_bf16(gen, HIDDEN, SHARED_FFN, scale=SHARED_FFN ** -0.5))
            module.gate_weight.copy_(_bf16(gen, 1, HIDDEN, scale=HIDDEN ** -0.5))
        module.refresh_deployed()
        reference = ReferenceSharedExpert(module.fc1_weight, module.fc2_weight, module.gate_weight,
                                          lambda x: module.kernel.parts(x).out)
        return module, reference, [_bf16(gen, tokens, HIDDEN).requires_grad_()]
    return build


def _case(context, token_counts=(37, 300)):
    return Layer1Case("routed_experts[shared expert, sigmoid gate]", get_default_contract("routed_experts"),
                      ITEMS, _builder(context), token_counts=token_counts)


@pytest.mark.parametrize("token_counts, dy_kinds", [((37, 300), ("random", "zero", "sparse")), ((1,), M1_DY_KINDS)])
def test_shared_expert_passes_layer1(context, token_counts, dy_kinds):
    case = _case(context, token_counts)
    reports = run_layer1_suite([case], seeds=SEEDS, dy_kinds=dy_kinds)
    assert len(reports) == len(case.token_counts) * len(SEEDS)
    failures = [line for r in reports for line in r.failures]
    assert not failures, "\n".join(failures[:20])
    assert {c.dy_kind for r in reports for c in r.checks} == set(dy_kinds)
    assert {c.item for r in reports for c in r.checks} == set(ITEMS)
    worst = {}
    for r in reports:
        for c in r.checks:
            if c.metrics is not None:
                worst[c.item] = max(worst.get(c.item, 0.0), c.metrics.rel_l2)
    print(f"{case.name}: worst rel_l2 " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_step_by_step_forward_is_vllms_layer_bitwise(context, tokens):
    module, _, (x,) = _builder(context)(0, tokens)
    parts = module.kernel.parts(x.detach())
    assert torch.equal(parts.out, module.kernel(x.detach()))
    assert torch.equal(module(x), parts.out)
    assert parts.gate_up.shape == (tokens, 2 * SHARED_FFN) and parts.gate_logit.shape == (tokens, 1)


def test_changed_master_without_refresh_is_refused(context):
    module, _, (x,) = _builder(context)(0, 5)
    with torch.no_grad():
        module.gate_weight.mul_(2)
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        module(x)


def test_bad_weight_shape_is_named(context):
    module, _, _ = _builder(context)(0, 1)
    with pytest.raises(ValueError, match=r"gate_weight must be a tensor of shape \(1, 128\)"):
        module.kernel.load(module.fc1_weight, module.fc2_weight, module.gate_weight.t())


def _failing(context):
    candidate, reference, inputs = _builder(context)(0, 37)
    report = compare_vjp(candidate, reference, inputs, tolerances=contract_tolerances(
        get_default_contract("routed_experts"), ITEMS), seed=0)
    return {(c.item, c.status) for c in report.checks if not c.passed}


class _DetachedGate(VllmSharedExpert):
    def forward(self, x):
        return shared_expert_module.SharedExpertFunction.apply(x, self.fc1_weight, self.fc2_weight,
                                                               self.gate_weight.detach(), self.kernel)


def test_planted_detached_gate_weight_is_caught(context, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "VllmSharedExpert", _DetachedGate)
    assert _failing(context) == {("gate_weight", "missing")}


def test_planted_gate_slope_without_sigmoid_derivative_is_caught(context, monkeypatch):
    real = shared_expert_module.shared_expert_vjp

    def flat_gate(grad_out, x, gate_up, act, down, gate_logit, *args):
        return real(grad_out, x, gate_up, act, down, torch.zeros_like(gate_logit), *args)  # s = 1/2 everywhere
    monkeypatch.setattr(shared_expert_module, "shared_expert_vjp", flat_gate)
    failing = {item for item, _ in _failing(context)}
    assert {"gate_weight", "fc2_weight", "fc1_weight", "input[0]"} <= failing


def test_planted_dropped_gate_path_in_dx_is_caught(context, monkeypatch):
    real = shared_expert_module.linear_vjp

    def no_gate_dx(grad, x_ref, w_ref, *args):
        dx, dw, db = real(grad, x_ref, w_ref, *args)
        return (None if dx is None else (dx * 0 if w_ref.shape[0] == 1 else dx)), dw, db
    monkeypatch.setattr(shared_expert_module, "linear_vjp", no_gate_dx)
    assert {item for item, _ in _failing(context)} == {"input[0]"}

"""The gated shared expert: its forward is vLLM's layer step by step, bad input is refused, and planted
backward bugs fail layer 1 (the correct module passes in tests/ops/test_layer1_registry.py)."""
import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import Layer1Case
from megatron_vllm_align.ops.shared_expert import module as shared_expert_module
from megatron_vllm_align.ops.shared_expert import vjp as shared_expert_vjp_module
from megatron_vllm_align.ops.shared_expert.case import ITEMS, TINY_SHARED_FFN, shared_expert_builder
from megatron_vllm_align.ops.shared_expert.module import SharedExpertFunction, VllmSharedExpert

HIDDEN = 128


@pytest.fixture(scope="module")
def context(tiny_moe_context):
    """A tiny Qwen2-MoE (head_dim 64 = hidden / heads, as Qwen2-MoE derives it)."""
    return tiny_moe_context("layer1_qwen2_moe", architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                            hidden_size=HIDDEN, intermediate_size=256, moe_intermediate_size=64,
                            shared_expert_intermediate_size=TINY_SHARED_FFN, norm_topk_prob=False,
                            num_attention_heads=2, num_key_value_heads=1)


def _build(context, tokens, candidate_cls=VllmSharedExpert):
    return shared_expert_builder(context, HIDDEN, TINY_SHARED_FFN, candidate_cls)(0, tokens)


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_step_by_step_forward_is_vllms_layer_bitwise(context, tokens):
    module, _, (x,) = _build(context, tokens)
    parts = module.kernel.parts(x.detach())
    assert torch.equal(parts.out, module.kernel(x.detach()))
    assert torch.equal(module(x), parts.out)
    assert parts.gate_up.shape == (tokens, 2 * TINY_SHARED_FFN) and parts.gate_logit.shape == (tokens, 1)


def test_changed_master_without_refresh_is_refused(context):
    module, _, (x,) = _build(context, 5)
    with torch.no_grad():
        module.gate_weight.mul_(2)
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        module(x)


def test_bad_weight_shape_is_named(context):
    module, _, _ = _build(context, 1)
    with pytest.raises(ValueError, match=r"gate_weight must be a tensor of shape \(1, 128\)"):
        module.kernel.load(module.fc1_weight, module.fc2_weight, module.gate_weight.t())


def _case(context, candidate_cls=VllmSharedExpert):
    return Layer1Case("shared_expert", get_default_contract("shared_expert"), ITEMS,
                      shared_expert_builder(context, HIDDEN, TINY_SHARED_FFN, candidate_cls), SharedExpertFunction)


class _DetachedGate(VllmSharedExpert):
    def forward(self, x):
        return shared_expert_module.SharedExpertFunction.apply(x, self.fc1_weight, self.fc2_weight,
                                                               self.gate_weight.detach(), self.kernel)


def test_correct_module_passes_in_the_qwen2_moe_context(context, failing_checks):
    assert not failing_checks(_case(context))


def test_planted_detached_gate_weight_is_caught(context, failing_checks):
    assert failing_checks(_case(context, _DetachedGate)) == {("gate_weight", "missing")}


def test_planted_gate_slope_without_sigmoid_derivative_is_caught(context, failing_checks, monkeypatch):
    real = shared_expert_module.shared_expert_vjp

    def flat_gate(grad_out, x, gate_up, act, down, gate_logit, *args):
        return real(grad_out, x, gate_up, act, down, torch.zeros_like(gate_logit), *args)  # s = 1/2 everywhere
    monkeypatch.setattr(shared_expert_module, "shared_expert_vjp", flat_gate)
    failing = {item for item, _ in failing_checks(_case(context))}
    assert {"gate_weight", "fc2_weight", "fc1_weight", "input[0]"} <= failing


def test_planted_dropped_gate_path_in_dx_is_caught(context, failing_checks, monkeypatch):
    real = shared_expert_vjp_module.linear_vjp

    def no_gate_dx(grad, x_ref, w_ref, *args):
        dx, dw, db = real(grad, x_ref, w_ref, *args)
        return (None if dx is None else (dx * 0 if w_ref.shape[0] == 1 else dx)), dw, db
    monkeypatch.setattr(shared_expert_vjp_module, "linear_vjp", no_gate_dx)
    assert {item for item, _ in failing_checks(_case(context))} == {"input[0]"}

"""The vLLM-forward MoE spec and Qwen3-MoE loading, without an engine: which layers are sparse,
aligned vs native loading, router replay through the model, and training (gradients, refresh).
The bitwise comparison with a real engine is tests/engine/test_forward_zero_diff_moe.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_vllm_align.engine.tiny_models import (
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import (
    MOE_PATCHES,
    active_patches,
    disable_cpu_compat,
)
from megatron_vllm_align.megatron.hf_checkpoint import hf_config_from_dict
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_moe import (
    VllmMoELayer,
    moe_layers,
    recorded_routing,
    router_replay,
    stack_expert_weights,
)
from megatron_vllm_align.ops.refresh import register_deployed_refresh

TINY_MOE = TinyModelConfig(architecture="qwen3_moe", seed=21)
MIXED_MOE = TinyModelConfig(architecture="qwen3_moe", num_layers=3, mlp_only_layers=(1,), seed=22)
SHARED_MOE = TinyModelConfig(architecture="qwen2_moe", num_layers=2, shared_expert_intermediate_size=96, seed=23)
LENGTHS = (1, 7, 17, 33, 5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {"moe": build_tiny_hf_model(root / "moe", TINY_MOE), "mixed": build_tiny_hf_model(root / "mixed", MIXED_MOE),
            "shared": build_tiny_hf_model(root / "shared", SHARED_MOE)}


@pytest.fixture(scope="module")
def prompts():
    return random_token_sequences(LENGTHS, vocab_size=TINY_MOE.vocab_size, seed=5)


@pytest.fixture(scope="module")
def aligned(megatron_cpu, checkpoints):
    return build_gpt_from_hf(checkpoints["moe"], align=True)


@pytest.fixture
def native_moe_patches():
    """Native MoE builds install MOE_PATCHES process-wide; take them off again after the test."""
    yield
    disable_cpu_compat([patch.name for patch in MOE_PATCHES])


def _raw_config(**moe_fields):
    raw = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 512,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
           "moe_intermediate_size": 128, "num_experts_per_tok": 2, "norm_topk_prob": True}
    return {**raw, **moe_fields}


@pytest.mark.parametrize("fields, sparse", [
    ({"num_experts": 8}, (0, 1, 2, 3)),
    ({"num_local_experts": 8, "decoder_sparse_step": 2}, (1, 3)),
    ({"num_experts": 8, "mlp_only_layers": [0, 2]}, (1, 3)),
])
def test_sparse_layers_are_the_ones_vllm_makes_sparse(fields, sparse):
    config = hf_config_from_dict(_raw_config(**fields))
    assert config.moe.sparse_layers == sparse and config.moe.num_experts == 8 and config.qk_norm


def test_shared_experts_are_refused():
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        hf_config_from_dict(_raw_config(num_experts=8, shared_expert_intermediate_size=64))


def test_mixed_model_gets_moe_and_dense_layers_in_both_specs(megatron_cpu, native_moe_patches, checkpoints, prompts):
    aligned = build_gpt_from_hf(checkpoints["mixed"], align=True)
    native = build_gpt_from_hf(checkpoints["mixed"])
    assert {patch.name for patch in MOE_PATCHES} <= {patch.name for patch in active_patches()}
    assert [type(layer.mlp) for layer in aligned.decoder.layers] == [VllmMoELayer, MLP, VllmMoELayer]
    assert [type(layer.mlp) for layer in native.decoder.layers] == [MoELayer, MLP, MoELayer]
    native_state = {name: p.detach() for name, p in native.named_parameters()}
    stacked = stack_expert_weights(native_state)
    for name, param in aligned.named_parameters():
        assert torch.equal(param.detach(), stacked[name]), name
    with torch.no_grad():
        ours, theirs = token_logprobs(aligned, prompts), token_logprobs(native, prompts)
    delta = torch.cat([a - b for a, b in zip(ours, theirs)]).abs()
    print(f"mixed model, aligned vs native: max {float(delta.max()):.3g}, mean {float(delta.mean()):.3g}")
    assert 0 < float(delta.max()) < 0.25 and float(delta.mean()) < 0.01  # bf16 rounding and rare routing flips


def test_stack_expert_weights_refuses_missing_experts():
    state = {f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight": torch.zeros(2, 2) for e in (0, 2)}
    with pytest.raises(ValueError, match=r"fc1_weight has experts \[0, 2\]"):
        stack_expert_weights(state)


def test_router_replay_reproduces_the_logprobs(aligned, prompts):
    with torch.no_grad():
        own = token_logprobs(aligned, prompts)
        recorded = [ids.clone() for ids in recorded_routing(aligned)]
        assert [tuple(ids.shape) for ids in recorded] == [(sum(LENGTHS), TINY_MOE.top_k)] * TINY_MOE.num_layers
        with router_replay(aligned, recorded):
            replayed = token_logprobs(aligned, prompts)
        other = [(ids + 1) % TINY_MOE.num_experts for ids in recorded]
        with router_replay(aligned, other):
            rerouted = token_logprobs(aligned, prompts)
            assert all(torch.equal(a, b.int()) for a, b in zip(recorded_routing(aligned), other))
    assert all(torch.equal(a, b) for a, b in zip(own, replayed))
    assert any(not torch.equal(a, b) for a, b in zip(own, rerouted))
    assert all(layer.replay_ids is None for layer in moe_layers(aligned))


@pytest.mark.parametrize("bad, match", [
    (lambda ids: ids[:-1], r"MoE layer 2: replay_ids must have shape \(63, 2\)"),
    (lambda ids: ids + 8, r"MoE layer 2: replay_ids must lie in \[0, 8\)"),
    (lambda ids: ids[:, :1].expand(-1, 2), "MoE layer 2: replay_ids repeat an expert within a token's top-k"),
])
def test_bad_replay_ids_through_the_model_name_the_layer(aligned, prompts, bad, match):
    with torch.no_grad():
        token_logprobs(aligned, prompts)
        good = recorded_routing(aligned)
        with router_replay(aligned, [good[0], bad(good[1])]), pytest.raises(ValueError, match=match):
            token_logprobs(aligned, prompts)


def test_router_replay_needs_one_tensor_per_moe_layer(aligned):
    replay = router_replay(aligned, [torch.zeros(3, 2, dtype=torch.int32)])
    with pytest.raises(ValueError, match="got 1 replay_ids tensors for 2 MoE layers"), replay:
        pass


def test_forward_backward_gives_finite_gradients_and_the_step_refreshes_the_experts(megatron_cpu, checkpoints,
                                                                                     prompts):
    model = build_gpt_from_hf(checkpoints["moe"], align=True)
    loss = -torch.cat(token_logprobs(model, prompts)).sum()
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        if "router" in name or "experts" in name:
            assert param.grad.abs().sum() > 0, name
    moe = moe_layers(model)[0]
    runner_before = moe.experts.kernel.runner
    with torch.no_grad():
        before = token_logprobs(model, prompts)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    register_deployed_refresh(optimizer, model)
    optimizer.step()
    assert moe.experts.kernel.runner is not runner_before
    with torch.no_grad():
        after = token_logprobs(model, prompts)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    with torch.no_grad():
        moe.experts.fc1_weight.add_(1e-2)
        with pytest.raises(RuntimeError, match="refresh_deployed"):
            token_logprobs(model, prompts)


def test_qwen2_moe_shared_expert_loads_in_both_specs_and_trains(megatron_cpu, native_moe_patches, checkpoints, prompts):
    aligned = build_gpt_from_hf(checkpoints["shared"], align=True)
    native = build_gpt_from_hf(checkpoints["shared"])
    native_state = {name: p.detach() for name, p in native.named_parameters()}
    assert native.decoder.layers[0].mlp.shared_experts.gate_weight.shape == (1, SHARED_MOE.hidden_size)
    stacked = stack_expert_weights(native_state)
    for name, param in aligned.named_parameters():
        assert torch.equal(param.detach(), stacked[name]), name
    shared = moe_layers(aligned)[0].shared_experts
    assert tuple(shared.fc1_weight.shape) == (2 * 96, SHARED_MOE.hidden_size)
    with torch.no_grad():
        ours, theirs = token_logprobs(aligned, prompts), token_logprobs(native, prompts)
    delta = torch.cat([a - b for a, b in zip(ours, theirs)]).abs()
    print(f"qwen2_moe, aligned vs native: max {float(delta.max()):.3g}, mean {float(delta.mean()):.3g}")
    assert 0 < float(delta.max()) < 0.25 and float(delta.mean()) < 0.01
    loss = -torch.cat(token_logprobs(aligned, prompts)).sum()
    loss.backward()
    for param in (shared.fc1_weight, shared.fc2_weight, shared.gate_weight):
        assert param.grad is not None and float(param.grad.abs().sum()) > 0


def test_shared_expert_without_gate_is_refused(megatron_cpu, checkpoints):
    with pytest.raises(ValueError, match="moe_shared_expert_gate"):
        build_gpt_from_hf(checkpoints["shared"], align=True, moe_shared_expert_gate=False)

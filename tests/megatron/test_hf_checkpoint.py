"""The HF -> Megatron loader: exact layouts (checked in fp32, where a layout bug cannot hide in
bf16 noise), planted layout bugs caught, and clear errors for checkpoints that do not fit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_vllm_align.engine.hf_reference import hf_token_logprobs
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.megatron.build import (
    build_gpt_from_hf,
    load_megatron_params,
    local_layer_spec,
)
from megatron_vllm_align.megatron.hf_checkpoint import (
    HFCheckpointError,
    hf_config_from_dict,
    hf_tensors_from_megatron,
    interleave_qkv,
    megatron_state_dict_from_hf,
    name_table,
    read_hf_config,
    read_hf_tensors,
)
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_moe import stack_expert_weights, unstack_expert_weights

# fp32 Megatron vs fp32 HF differ only by summation order: ~1e-6 measured on these 2-layer
# models (fp32 eps 1.2e-7 times a few roundings per logit). Any layout error moves logprobs
# by >= 1e-2 (the planted-bug tests below), so 1e-5 separates the two by three decades.
FP32_LOGPROB_ATOL = 1e-5


def max_abs_delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.cat([x - y for x, y in zip(a, b, strict=True)]).abs().max())


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama_tied"])
def test_fp32_megatron_matches_fp32_hf(megatron_cpu, tiny_checkpoints, token_sequences, name):
    model = build_gpt_from_hf(tiny_checkpoints[name], params_dtype=torch.float32)
    assert all(param.dtype == torch.float32 for param in model.parameters())
    with torch.no_grad():
        ours = token_logprobs(model, token_sequences)
    reference = hf_token_logprobs(tiny_checkpoints[name], token_sequences, torch.float32)
    delta = max_abs_delta(ours, reference)
    print(f"{name}: fp32 Megatron local vs fp32 HF max |delta logprob| = {delta:.3g}")
    assert delta < FP32_LOGPROB_ATOL


def test_bf16_build_has_bf16_params_and_tied_output(megatron_cpu, tiny_checkpoints):
    model = build_gpt_from_hf(tiny_checkpoints["llama_tied"])
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None


def _swap_norms(state, config):
    a, b = "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight"
    state[a], state[b] = state[b], state[a]


def _plain_qkv_concat(state, config):
    tensors = read_hf_tensors(config["dir"])
    attn = "model.layers.0.self_attn."
    state["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.cat(
        [tensors[attn + "q_proj.weight"], tensors[attn + "k_proj.weight"], tensors[attn + "v_proj.weight"]]
    )


def _up_gate_order(state, config):
    fc1 = state["decoder.layers.0.mlp.linear_fc1.weight"]
    state["decoder.layers.0.mlp.linear_fc1.weight"] = torch.cat(fc1.chunk(2)[::-1])


def _qkv_bias_not_interleaved(state, config):
    tensors = read_hf_tensors(config["dir"])
    attn = "model.layers.0.self_attn."
    state["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.cat(
        [tensors[attn + "q_proj.bias"], tensors[attn + "k_proj.bias"], tensors[attn + "v_proj.bias"]]
    )


@pytest.mark.parametrize(
    "name, plant",
    [
        ("llama", _swap_norms),
        ("llama", _plain_qkv_concat),
        ("llama", _up_gate_order),
        ("qwen2", _qkv_bias_not_interleaved),
    ],
)
def test_fp32_comparison_catches_planted_layout_bugs(megatron_cpu, tiny_checkpoints, token_sequences, name, plant):
    checkpoint = tiny_checkpoints[name]
    model = build_gpt_from_hf(checkpoint, params_dtype=torch.float32)
    state = megatron_state_dict_from_hf(read_hf_tensors(checkpoint), read_hf_config(checkpoint))
    plant(state, {"dir": checkpoint})
    load_megatron_params(model, state)
    with torch.no_grad():
        ours = token_logprobs(model, token_sequences)
    delta = max_abs_delta(ours, hf_token_logprobs(checkpoint, token_sequences, torch.float32))
    print(f"{plant.__name__}: max |delta logprob| = {delta:.3g}")
    assert delta > 1000 * FP32_LOGPROB_ATOL


def test_interleave_qkv_groups_q_heads_with_their_kv_head():
    # 4 query heads, 2 KV heads, head_dim 1: rows are labelled by head.
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    expected = [0, 1, 10, 20, 2, 3, 11, 21]
    assert interleave_qkv(q, k, v, num_kv_heads=2).flatten().tolist() == expected
    assert interleave_qkv(q.flatten(), k.flatten(), v.flatten(), num_kv_heads=2).tolist() == expected  # biases


def _copy_with_config(source, destination, **changes):
    shutil.copytree(source, destination)
    raw = json.loads((destination / "config.json").read_text())
    raw.update(changes)
    (destination / "config.json").write_text(json.dumps(raw))
    return destination


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"num_key_value_heads": 4},
            r"'model.layers.0.self_attn.k_proj.weight' has shape \(128, 256\), but config.json implies \(256, 256\)",
        ),
        (
            {"intermediate_size": 384},
            r"'model.layers.0.mlp.gate_proj.weight' has shape \(512, 256\), but config.json implies \(384, 256\)",
        ),
        ({"vocab_size": 1000}, r"'model.embed_tokens.weight' has shape \(512, 256\)"),
        ({"num_hidden_layers": 3}, r"checkpoint lacks tensor 'model.layers.2.input_layernorm.weight'"),
        ({"num_hidden_layers": 1}, r"does not know: \['model.layers.1."),
        ({"model_type": "qwen2"}, r"checkpoint lacks tensor 'model.layers.0.self_attn.q_proj.bias'"),
    ],
)
def test_checkpoint_that_does_not_fit_its_config_is_a_clear_error(
    megatron_cpu, tiny_checkpoints, tmp_path, changes, message
):
    broken = _copy_with_config(tiny_checkpoints["llama"], tmp_path / "broken", **changes)
    with pytest.raises(HFCheckpointError, match=message):
        build_gpt_from_hf(broken)


def test_tied_checkpoint_with_a_different_lm_head_is_an_error(tiny_checkpoints):
    config = read_hf_config(tiny_checkpoints["llama"])
    raw = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    tied = hf_config_from_dict({**raw, "tie_word_embeddings": True})
    assert not config.tie_word_embeddings and tied.tie_word_embeddings
    with pytest.raises(HFCheckpointError, match="lm_head.weight differs"):
        megatron_state_dict_from_hf(read_hf_tensors(tiny_checkpoints["llama"]), tied)


BASE_CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'.*not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope type 'mrope'"),
        ({"attention_bias": True}, "attention_bias=true on llama"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"rms_norm_eps": None}, "'rms_norm_eps' is missing"),
    ],
)
def test_unsupported_configs_are_clear_errors(changes, message):
    with pytest.raises(HFCheckpointError, match=message):
        hf_config_from_dict({**BASE_CONFIG, **changes})


def test_scaled_rope_is_read_in_both_spellings():
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    legacy = hf_config_from_dict({**BASE_CONFIG, "rope_scaling": llama3})
    without_theta = {key: value for key, value in BASE_CONFIG.items() if key != "rope_theta"}
    current = hf_config_from_dict({**without_theta, "rope_parameters": {**llama3, "rope_theta": 5e5}})
    assert legacy == current and legacy.rope_scaling == llama3 and legacy.rope_theta == 5e5
    assert hf_config_from_dict({**BASE_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope_scaling == \
        {"rope_type": "linear", "factor": 2.0}
    assert hf_config_from_dict(BASE_CONFIG).rope_scaling is None


def test_config_reading_accepts_both_transformers_spellings():
    legacy = hf_config_from_dict(BASE_CONFIG)  # transformers 4.x: top-level rope_theta
    without_theta = {key: value for key, value in BASE_CONFIG.items() if key != "rope_theta"}
    current = hf_config_from_dict({**without_theta, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert legacy == current
    assert legacy.head_dim == 64 and legacy.rope_theta == 5e5 and not legacy.qkv_bias


def test_aligned_build_needs_the_engine_dtype(megatron_cpu, tiny_checkpoints):
    with pytest.raises(ValueError, match=r"TransformerConfig.params_dtype = torch.float32; "
                                         r"the vLLM-forward layer needs torch.bfloat16"):
        build_gpt_from_hf(tiny_checkpoints["llama"], align=True, params_dtype=torch.float32)


def test_build_accepts_a_spec_function(megatron_cpu, tiny_checkpoints):
    seen = []

    def spec_of(config):
        seen.append(config.num_query_groups)
        return local_layer_spec(config)

    model = build_gpt_from_hf(tiny_checkpoints["qwen3"], align=True, transformer_layer_spec=spec_of)
    assert seen == [2]
    assert model.decoder.layers[0].self_attention.q_layernorm.weight.shape == (64,)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama_tied", "qwen3_moe", "qwen2_moe"])
def test_export_is_the_exact_inverse_of_the_import(tiny_checkpoints, tmp_path, name):
    """hf_tensors_from_megatron(megatron_state_dict_from_hf(t)) == t, bitwise, for every architecture
    (q/k/v biases, q/k norms, tied embeddings, routed and shared experts)."""
    if name in tiny_checkpoints:
        directory = tiny_checkpoints[name]
    else:
        directory = build_tiny_hf_model(tmp_path / name, TinyModelConfig(architecture=name, num_layers=2, seed=4))
    config, tensors = read_hf_config(directory), read_hf_tensors(directory)
    state = megatron_state_dict_from_hf(tensors, config)
    exported = hf_tensors_from_megatron(state, config)
    expected = {k: v for k, v in tensors.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert exported.keys() == expected.keys()
    table = name_table(config)   # the one table both directions read: each name once on each side
    assert list(state) == [entry.megatron for entry in table]
    assert list(exported) == [hf for entry in table for hf in entry.hf]
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_export_names_a_missing_or_extra_parameter(tiny_checkpoints):
    config = read_hf_config(tiny_checkpoints["llama"])
    state = megatron_state_dict_from_hf(read_hf_tensors(tiny_checkpoints["llama"]), config)
    with pytest.raises(HFCheckpointError, match="decoder.layers.1.mlp.linear_fc2.weight"):
        hf_tensors_from_megatron({k: v for k, v in state.items() if k != "decoder.layers.1.mlp.linear_fc2.weight"},
                                 config)
    with pytest.raises(HFCheckpointError, match="does not know.*extra.weight"):
        hf_tensors_from_megatron({**state, "extra.weight": torch.zeros(1)}, config)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_unstacking_the_aligned_moe_names_inverts_the_stacking(tmp_path, name):
    directory = build_tiny_hf_model(tmp_path / name, TinyModelConfig(architecture=name, num_layers=2, seed=5))
    state = megatron_state_dict_from_hf(read_hf_tensors(directory), read_hf_config(directory))
    stacked = stack_expert_weights(state)
    assert any(k.endswith("experts.fc1_weight") for k in stacked) and stacked.keys() != state.keys()
    back = unstack_expert_weights(stacked)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


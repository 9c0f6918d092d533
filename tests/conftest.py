"""Shared fixtures: the vLLM engine contexts a bf16 and an FP8 (per-channel) engine resolve for a tiny
Llama (``config.json`` only; no weights, no engine started)."""
import json

import pytest

from megatron_vllm_align.kernels.vllm_context import EngineSpec, vllm_context

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 1, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_config")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


@pytest.fixture(scope="session")
def bf16_context(engine_model_dir):
    return vllm_context(EngineSpec(engine_model_dir))


@pytest.fixture(scope="session")
def fp8_context(engine_model_dir):
    return vllm_context(EngineSpec(engine_model_dir, quantization="fp8_per_channel"))


TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def tiny_moe_context(tmp_path_factory):
    """``(name, **fields) -> VllmContext`` of a tiny Qwen3-MoE ``config.json`` (hidden 256, expert FFN
    128, 8 experts, top-2) with `fields` replacing its entries, written to a fresh directory `name`."""
    def make(name: str, **fields):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, **fields}))
        return vllm_context(EngineSpec(str(path)))
    return make

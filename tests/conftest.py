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

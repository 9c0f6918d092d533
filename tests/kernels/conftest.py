"""Engine contexts for the visible-kernel tests: the vLLM config a bf16 and an FP8 (per-channel)
engine resolve for a tiny Llama (``config.json`` only; no weights, no engine started)."""
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


def _check_elementwise_bound(actual, expected, roundings, extra=None):
    """Assert ``|actual - expected| <= roundings * u * |expected| (+ extra)`` elementwise, with u the
    unit roundoff of expected's dtype; returns the largest |difference| / (u |expected|) seen."""
    import torch

    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{actual.dtype} {tuple(actual.shape)} vs expected {expected.dtype} {tuple(expected.shape)}")
    u = torch.finfo(expected.dtype).eps / 2
    diff = (actual.double() - expected.double()).abs()
    bound = roundings * u * expected.double().abs()
    if extra is not None:
        bound = bound + extra.double()
    worst = int((diff - bound).flatten().argmax())
    assert bool((diff <= bound).all()), (
        f"elementwise bound broken at flat index {worst}: |diff| {diff.flatten()[worst]:.3g} > "
        f"{bound.flatten()[worst]:.3g} (actual {actual.flatten()[worst]}, expected {expected.flatten()[worst]})")
    scale = u * expected.double().abs()
    return float((diff / scale.clamp_min(torch.finfo(torch.float64).tiny)).max())


@pytest.fixture
def within_roundings():
    """The checker ``(actual, expected, roundings, extra=None)`` of the documented elementwise bounds."""
    return _check_elementwise_bound

"""Engine contexts for the module tests (same as tests/kernels): the vLLM config a bf16 and an FP8 (per-channel)
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


def _one_rounding_tolerance(reduction_length: int):
    """Layer-1 tolerance for a bf16 gradient computed in fp32 and rounded once, against an fp32
    autograd reference that also rounds once (derived before any comparison is run):

    each side's single rounding to bf16 errs by at most u|g| (u = 2^-8), so the two differ by at
    most 2u|g| <= 2u max|g_ref| per element and 2u in relative L2; the fp32 arithmetic before the
    rounding (sums of up to ``reduction_length`` terms in a different order on each side) adds
    about 4 sqrt(n) 2^-24 (4 sigma). atol = 0: a zero dY must give exactly zero gradients.
    """
    import math

    from megatron_vllm_align.contracts import Tolerance

    u = 2.0 ** -8
    bound = 2 * u + 4 * math.sqrt(reduction_length) * 2.0 ** -24
    return Tolerance(rel_l2=bound, rtol=bound, atol=0.0)


@pytest.fixture
def one_rounding_tolerance():
    """``(reduction_length) -> Tolerance`` of :func:`_one_rounding_tolerance`."""
    return _one_rounding_tolerance

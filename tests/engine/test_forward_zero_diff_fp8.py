"""FP8 W8A8: the vLLM-forward Megatron GPTModel against a real engine serving FP8, bitwise.

The engine serves the session's tiny random Llama (bf16 checkpoint) with
``quantization="fp8_per_channel"``: vLLM quantizes every linear (qkv_proj, o_proj, gate_up_proj,
down_proj) per output channel at load and each activation per token (``Fp8PtpcOnlineLinearMethod``,
``ChannelWiseTorchFP8ScaledMMLinearKernel`` on CPU); embedding and lm_head stay bf16. The aligned
model (``build_gpt_from_hf(..., align=True, quantization="fp8_per_channel")``) must give
max |delta logprob| == 0.0 on every token of 9 zero_diff_prompts of unaligned lengths sent together; the
bf16 aligned model and the local spec are printed beside it (they differ by the FP8 error).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_linear import (
    VllmMegatronFP8Linear,
    VllmMegatronFP8QKVLinear,
)

pytestmark = pytest.mark.engine

FP8 = "fp8_per_channel"
# A bf16 model against the FP8 engine differs by the FP8 quantization error of 8 GEMMs: measured
# 0.071 on this model; the bound only guards against a comparison that is broken altogether.
FP8_VS_BF16_MAX_DELTA = 1.0


@pytest.fixture
def max_delta(delta_stats):
    """The conftest's max |delta logprob|, printed against the FP8 engine."""
    return lambda name, ours, engine: delta_stats(name, ours, engine, reference_name="FP8 engine")[0]


@pytest.fixture(scope="module")
def fp8_engine_logprobs(engine_checkpoint, zero_diff_prompts) -> list[torch.Tensor]:
    """The FP8 engine's prompt logprobs of all zero_diff_prompts sent together (engine stopped afterwards)."""
    llm = start_reference_engine(engine_checkpoint, ReferenceEngineConfig(kv_cache_bytes=32 * 1024 * 1024,
                                                                          quantization=FP8))
    try:
        return prompt_logprobs(llm, zero_diff_prompts)
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="module")
def fp8_model(fp8_engine_logprobs, megatron_world, engine_checkpoint):
    """Built after the FP8 engine ran: its shutdown destroys the world megatron_world then renews."""
    return build_gpt_from_hf(engine_checkpoint, align=True, quantization=FP8)


def test_fp8_model_quantizes_exactly_the_engines_linears(fp8_model):
    layer = fp8_model.decoder.layers[0]
    assert type(layer.self_attention.linear_qkv) is VllmMegatronFP8QKVLinear
    for linear in (layer.self_attention.linear_proj, layer.mlp.linear_fc1, layer.mlp.linear_fc2):
        assert type(linear) is VllmMegatronFP8Linear
        assert linear.kernel.fp8_weight()[0].dtype == torch.float8_e4m3fn
    assert fp8_model.output_layer.kernel.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in fp8_model.parameters())  # master weights


def test_fp8_aligned_megatron_equals_the_fp8_engine_bitwise(max_delta, fp8_model, engine_checkpoint, zero_diff_prompts,
                                                           fp8_engine_logprobs):
    with torch.no_grad():
        ours = token_logprobs(fp8_model, zero_diff_prompts)
        bf16_aligned = token_logprobs(build_gpt_from_hf(engine_checkpoint, align=True), zero_diff_prompts)
        local = token_logprobs(build_gpt_from_hf(engine_checkpoint), zero_diff_prompts)
    for prompt, mine, theirs in zip(zero_diff_prompts, ours, fp8_engine_logprobs, strict=True):
        assert mine.dtype == theirs.dtype == torch.float32 and mine.shape == (len(prompt) - 1,)
    bf16_delta = max_delta("Megatron vLLM spec bf16", bf16_aligned, fp8_engine_logprobs)
    max_delta("Megatron local spec bf16", local, fp8_engine_logprobs)
    assert max_delta("Megatron vLLM spec FP8 (all at once)", ours, fp8_engine_logprobs) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ours, fp8_engine_logprobs, strict=True))
    assert 0.0 < bf16_delta < FP8_VS_BF16_MAX_DELTA


def test_a_stale_deployed_fp8_weight_is_no_longer_bitwise_equal(max_delta, fp8_model, zero_diff_prompts,
                                                                fp8_engine_logprobs):
    """The comparison can fail and the refresh matters: nudging one master row of linear_fc2 by
    1% and refreshing changes the FP8 deployed value and the logprobs; restoring it and
    refreshing gives the engine's values back."""
    fc2 = fp8_model.decoder.layers[1].mlp.linear_fc2
    saved = fc2.weight.detach().clone()
    try:
        with torch.no_grad():
            fc2.weight[5].mul_(1.01)
        fc2.refresh_deployed()
        with torch.no_grad():
            nudged = token_logprobs(fp8_model, zero_diff_prompts)
        assert max_delta("FP8 spec, one fc2 row scaled by 1.01", nudged, fp8_engine_logprobs) > 0.0
    finally:
        with torch.no_grad():
            fc2.weight.copy_(saved)
        fc2.refresh_deployed()
    with torch.no_grad():
        assert max_delta("FP8 spec, restored", token_logprobs(fp8_model, zero_diff_prompts), fp8_engine_logprobs) == 0.0

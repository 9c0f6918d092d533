"""Processed logprobs of sampled tokens: an engine started with ``logprobs_mode='processed_logprobs'``
samples, in one batch, requests each with its own ``SamplingParams`` (temperature 0.6 and 1.3, top_p 0.9,
top_k 20, min_p 0.05, and all combined); with MVA_INVARIANT=1 the aligned trainer's processed logprob of
every sampled token (``completion_logprobs(..., sampling_params=...)``, the same objects) equals the
engine's bit for bit, on a dense and an MoE tiny model. The raw logprobs of the same samples (the same
engine's prompt logprobs of prompt + completion: raw in every mode) equal the trainer's raw ones.

Control: a planted renormalisation bug, the trainer's logprobs over the full vocabulary at the same
temperature (the filters dropped), differs from the engine on the requests with a filter. One engine
start per model; prompts of 5 to 25 tokens, 24 tokens sampled each.
"""
from __future__ import annotations

import time

import pytest
import torch

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
from megatron_vllm_align.megatron.logprobs import completion_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

# name: SamplingParams fields; "filtered": a filter drops tokens (the control's rows)
SETTINGS = {"temperature=0.6": dict(temperature=0.6), "temperature=1.3": dict(temperature=1.3),
            "top_p=0.9": dict(top_p=0.9), "top_k=20": dict(top_k=20), "min_p=0.05": dict(min_p=0.05),
            "combined": dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05)}
FILTERED = ("top_p=0.9", "top_k=20", "min_p=0.05", "combined")
PROMPT_LENGTHS = (5, 9, 13, 17, 21, 25)
MAX_TOKENS = 24
KV_CACHE_BYTES = 32 * 1024 * 1024
# initializer_range 0.1 (the default 0.02 gives near-uniform next-token distributions, where min_p 0.05 drops
# no token): every filter then drops tokens
MODELS = {"llama": TinyModelConfig(seed=21, initializer_range=0.1),
          "qwen3_moe": TinyModelConfig(architecture="qwen3_moe", seed=22, initializer_range=0.1)}


@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_equals_processed_and_raw_sampled_logprobs_bitwise(name, tmp_path, max_delta):
    from vllm import SamplingParams

    began = time.perf_counter()
    config = MODELS[name]
    checkpoint = build_tiny_hf_model(tmp_path / name, config)
    prompts = random_token_sequences(PROMPT_LENGTHS, vocab_size=config.vocab_size, seed=23)
    params = [SamplingParams(**fields, max_tokens=MAX_TOKENS, logprobs=0, seed=300 + i, ignore_eos=True)
              for i, fields in enumerate(SETTINGS.values())]
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES,
                                                                   logprobs_mode="processed_logprobs"))
    try:
        sampled = sample_completions(llm, prompts, params)   # one batch, per-request parameters
        raw_engine = prompt_logprobs(llm, [c.sequence for c in sampled])
    finally:
        shutdown_engine(llm)
    init_single_process_cpu(seed=1234)
    tokens = [c.tokens for c in sampled]
    engine = [c.logprobs for c in sampled]
    raw_engine = [values[len(prompt) - 1:] for values, prompt in zip(raw_engine, prompts, strict=True)]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    model = build_gpt_from_hf(checkpoint, align=True)
    with torch.no_grad():
        ours = completion_logprobs(model, prompts, tokens, sampling_params=params)
        raw = completion_logprobs(model, prompts, tokens)
        full_vocab = completion_logprobs(model, prompts, tokens,
                                         sampling_params=[SamplingParams(temperature=p.temperature) for p in params])
    assert max_delta(f"{name}: trainer processed", ours, engine, "engine processed_logprobs") == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True))
    assert max_delta(f"{name}: trainer raw", raw, raw_engine, "engine prompt logprobs") == 0.0
    assert all(torch.equal(a, b) for a, b in zip(raw, raw_engine, strict=True))
    # the engine really returned processed values: they differ from the raw ones on every request
    for setting, processed_values, raw_values in zip(SETTINGS, engine, raw_engine, strict=True):
        assert not torch.equal(processed_values, raw_values), setting
    filtered = [i for i, setting in enumerate(SETTINGS) if setting in FILTERED]
    control = max_delta(f"{name}: control, renormalised over the full vocabulary",
                        [full_vocab[i] for i in filtered], [engine[i] for i in filtered], "engine processed")
    assert control > 0.0
    print(f"{name}: {sum(map(len, tokens))} sampled tokens, wall {time.perf_counter() - began:.1f} s")

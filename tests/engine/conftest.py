"""One real vLLM engine per test session, on a tiny random Llama, with a bounded KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.tiny_models import (
    UNALIGNED_LENGTHS,
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    shutdown_engine,
    start_reference_engine,
)

ENGINE_KV_CACHE_BYTES = 64 * 1024 * 1024  # 65536 tokens of the tiny model: far more than the tests use


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("engine") / "tiny_llama", TinyModelConfig(seed=0))


@pytest.fixture(scope="session")
def engine(engine_checkpoint):
    """The in-process vllm.LLM, started once and shut down at the end of the session."""
    llm = start_reference_engine(engine_checkpoint, ReferenceEngineConfig(kv_cache_bytes=ENGINE_KV_CACHE_BYTES))
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="session")
def engine_sequences() -> list[list[int]]:
    return random_token_sequences(UNALIGNED_LENGTHS, vocab_size=TinyModelConfig().vocab_size, seed=0)


@pytest.fixture(scope="session")
def engine_logprobs(engine, engine_sequences) -> list[torch.Tensor]:
    """The engine's prompt logprobs of engine_sequences, all submitted at once."""
    return prompt_logprobs(engine, engine_sequences)


@pytest.fixture(scope="session")
def zero_diff_lengths() -> tuple[int, ...]:
    """Prompt lengths of the zero-diff tests (unaligned, 64 included, sent in this order)."""
    return (1, 7, 16, 17, 31, 33, 37, 64, 2)


@pytest.fixture(scope="session")
def zero_diff_prompts(zero_diff_lengths) -> list[list[int]]:
    """The zero-diff tests' prompts: zero_diff_lengths over the tiny vocabulary, seed 7."""
    return random_token_sequences(zero_diff_lengths, vocab_size=TinyModelConfig().vocab_size, seed=7)


@pytest.fixture(scope="module")
def megatron_world() -> None:
    """Megatron's state on a live torch.distributed world, once per module: an engine's shutdown
    earlier in the session destroys the world."""
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu(seed=1234)


@pytest.fixture(scope="session")
def megatron_cpu() -> None:
    """Megatron's model-parallel state on the engine's (or a new) gloo world of one; CPU patches on."""
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu(seed=1234)


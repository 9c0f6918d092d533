"""Fixtures for the Megatron-Core tests: one single-process CPU setup and tiny HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vllm_align.engine.tiny_models import (
    UNALIGNED_LENGTHS,
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context


@pytest.fixture(scope="session")
def megatron_cpu() -> None:
    """Gloo world of one, megatron model-parallel state of size 1, CPU patches on."""
    init_single_process_cpu(seed=1234)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random llama / qwen2 / qwen3 / tied-embedding llama checkpoints, by name."""
    root = tmp_path_factory.mktemp("tiny_hf")
    configs = {
        "llama": TinyModelConfig(architecture="llama", seed=0),
        "qwen2": TinyModelConfig(architecture="qwen2", seed=1),
        "qwen3": TinyModelConfig(architecture="qwen3", seed=2),
        "llama_tied": TinyModelConfig(architecture="llama", tie_word_embeddings=True, seed=3),
    }
    return {name: build_tiny_hf_model(root / name, config) for name, config in configs.items()}


@pytest.fixture(scope="session")
def token_sequences() -> list[list[int]]:
    """Random token sequences of UNALIGNED_LENGTHS over the tiny vocabulary (512)."""
    return random_token_sequences(UNALIGNED_LENGTHS, vocab_size=512)


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoints) -> Path:
    """The tiny random llama checkpoint of tiny_checkpoints."""
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def engine_context(llama_dir):
    """The vLLM context an engine serving llama_dir resolves (no engine started)."""
    return vllm_context(EngineSpec(str(llama_dir)))

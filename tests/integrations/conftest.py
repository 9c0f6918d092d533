"""Fixtures for the integration tests: a one-process CPU Megatron setup and a tiny Llama checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu


@pytest.fixture(scope="session")
def megatron_cpu() -> None:
    init_single_process_cpu(seed=1234)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("tiny_hf") / "llama",
                               TinyModelConfig(architecture="llama", seed=0))

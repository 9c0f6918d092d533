"""Fixtures for the quantization tests: a vLLM config context for vLLM's own quant ops."""
import pytest


@pytest.fixture(scope="module")
def vllm_config():
    """vLLM ``CustomOp``s (``QuantFP8``) and kernel selection need a current ``VllmConfig``."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config

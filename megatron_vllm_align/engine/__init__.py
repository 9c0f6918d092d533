"""The inference side as ground truth: tiny local checkpoints and a real in-process vLLM engine
(prompt logprobs, sampled completions with their logprobs and routed experts)."""

from megatron_vllm_align.engine.engine_facts import EngineFacts, measure_engine_facts
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.engine.vllm_reference import (
    DEFAULT_KV_CACHE_BYTES,
    EngineStartError,
    ReferenceEngineConfig,
    SampledCompletion,
    engine_prompt_logprobs,
    engine_sample_completions,
    engine_vocab_size,
    prompt_logprobs,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "EngineFacts",
    "EngineStartError",
    "ReferenceEngineConfig",
    "SampledCompletion",
    "TinyModelConfig",
    "build_tiny_hf_model",
    "engine_prompt_logprobs",
    "engine_sample_completions",
    "engine_vocab_size",
    "measure_engine_facts",
    "prompt_logprobs",
    "sample_completions",
    "shutdown_engine",
    "start_reference_engine",
]

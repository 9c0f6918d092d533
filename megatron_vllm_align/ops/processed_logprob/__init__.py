"""The logprob of a sampled token under the engine's processed distribution (temperature, top-k,
top-p, min-p): vLLM's sampler steps forward, a closed-form backward (docs/sampling.md)."""
from megatron_vllm_align.ops.processed_logprob.kernel import (
    check_sampling_params,
    vllm_processed_logprobs,
    vllm_processed_selected_logprob,
)
from megatron_vllm_align.ops.processed_logprob.module import ProcessedLogprobFunction, VllmProcessedLogprob
from megatron_vllm_align.ops.processed_logprob.vjp import processed_logprob_vjp

__all__ = [
    "ProcessedLogprobFunction", "VllmProcessedLogprob", "check_sampling_params", "processed_logprob_vjp",
    "vllm_processed_logprobs", "vllm_processed_selected_logprob",
]

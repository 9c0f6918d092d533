"""The logprob of a selected token: vLLM's sampler formula forward, a closed-form backward."""
from megatron_vllm_align.ops.selected_logprob.kernel import (
    check_logprob_inputs,
    selected_logprob_native,
    vllm_selected_logprob,
)
from megatron_vllm_align.ops.selected_logprob.module import SelectedLogprobFunction, VllmSelectedLogprob
from megatron_vllm_align.ops.selected_logprob.reference import ReferenceSelectedLogprob
from megatron_vllm_align.ops.selected_logprob.vjp import selected_logprob_vjp

__all__ = [
    "ReferenceSelectedLogprob", "SelectedLogprobFunction", "VllmSelectedLogprob",
    "check_logprob_inputs", "selected_logprob_native", "selected_logprob_vjp", "vllm_selected_logprob",
]

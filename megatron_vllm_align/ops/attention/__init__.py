"""Causal prefill attention: vLLM's CPU attention backend forward, a training attention backward."""
from megatron_vllm_align.ops.attention.kernel import (
    attention_native,
    seq_lens_from_cu_seqlens,
    validate_attention_inputs,
    vllm_prefill_attention,
)
from megatron_vllm_align.ops.attention.module import (
    VllmCausalAttentionFunction,
    VllmDotProductAttention,
    training_attention_vjp,
)
from megatron_vllm_align.ops.attention.reference import ReferenceAttention

__all__ = [
    "ReferenceAttention", "VllmCausalAttentionFunction", "VllmDotProductAttention", "attention_native",
    "seq_lens_from_cu_seqlens", "training_attention_vjp", "validate_attention_inputs",
    "vllm_prefill_attention",
]

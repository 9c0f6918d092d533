"""Causal prefill attention: vLLM's CPU attention backend forward, a training attention backward."""
from megatron_vllm_align.ops.attention.kernel import (
    attention_native,
    seq_lens_from_cu_seqlens,
    validate_attention_inputs,
    vllm_prefill_attention,
)
from megatron_vllm_align.ops.attention.module import VllmCausalAttentionFunction, VllmDotProductAttention
from megatron_vllm_align.ops.attention.reference import ReferenceAttention
from megatron_vllm_align.ops.attention.vjp import training_attention_vjp

__all__ = [
    "ReferenceAttention", "VllmCausalAttentionFunction", "VllmDotProductAttention", "attention_native",
    "seq_lens_from_cu_seqlens", "training_attention_vjp", "validate_attention_inputs",
    "vllm_prefill_attention",
]

"""Rotary position embedding: vLLM's ``get_rope`` layer forward, the exact rotation transpose as backward."""
from megatron_vllm_align.ops.rotary_embedding.kernel import (
    VllmRotaryKernel,
    check_positions,
    cos_sin_at,
    cpu_rotary_dim_supported,
    neox_rotate,
    rotary_native,
)
from megatron_vllm_align.ops.rotary_embedding.module import RotaryFunction, VllmRotaryEmbedding
from megatron_vllm_align.ops.rotary_embedding.reference import ReferenceRotary
from megatron_vllm_align.ops.rotary_embedding.vjp import rotary_embedding_vjp

__all__ = [
    "ReferenceRotary", "RotaryFunction", "VllmRotaryEmbedding", "VllmRotaryKernel", "check_positions",
    "cos_sin_at", "cpu_rotary_dim_supported", "neox_rotate", "rotary_embedding_vjp", "rotary_native",
]

"""The gated shared expert of a Qwen2-MoE block: vLLM's ``Qwen2MoeMLP`` forward, the reused linear and SwiGLU VJPs
chained."""
from megatron_vllm_align.ops.shared_expert.kernel import SharedExpertParts, VllmSharedExpertKernel
from megatron_vllm_align.ops.shared_expert.module import SharedExpertFunction, VllmSharedExpert
from megatron_vllm_align.ops.shared_expert.reference import ReferenceSharedExpert
from megatron_vllm_align.ops.shared_expert.vjp import shared_expert_vjp

__all__ = [
    "ReferenceSharedExpert", "SharedExpertFunction", "SharedExpertParts", "VllmSharedExpert",
    "VllmSharedExpertKernel", "shared_expert_vjp",
]

"""The routed experts: vLLM's fused-MoE forward, a dispatch-free closed-form backward at the saved expert IDs;
``expert_map``: a rank's routing under expert parallelism and the vLLM plugin that makes the CPU engine use it."""
from megatron_vllm_align.ops.routed_experts.kernel import (
    VllmRoutedExpertsKernel,
    check_routing,
    routed_experts_bound,
    routed_experts_native,
)
from megatron_vllm_align.ops.routed_experts.module import RoutedExpertsFunction, VllmRoutedExperts
from megatron_vllm_align.ops.routed_experts.reference import ReferenceRoutedExperts
from megatron_vllm_align.ops.routed_experts.vjp import DispatchPlan, dispatch_plan, routed_experts_vjp

__all__ = [
    "DispatchPlan", "ReferenceRoutedExperts", "RoutedExpertsFunction", "VllmRoutedExperts",
    "VllmRoutedExpertsKernel", "check_routing", "dispatch_plan", "routed_experts_bound",
    "routed_experts_native", "routed_experts_vjp",
]

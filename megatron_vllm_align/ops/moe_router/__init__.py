"""The MoE router: vLLM's gate GEMM and top-k selection forward, the routing-weights VJP at the saved expert IDs."""
from megatron_vllm_align.ops.moe_router.kernel import (
    VllmRouterKernel,
    check_positive_int,
    check_unquantized,
    router_native,
)
from megatron_vllm_align.ops.moe_router.module import (
    MoERouterFunction,
    VllmMoERouter,
    check_replay_ids,
)
from megatron_vllm_align.ops.moe_router.reference import ReferenceMoERouter
from megatron_vllm_align.ops.moe_router.vjp import routing_weights_vjp

__all__ = [
    "MoERouterFunction", "ReferenceMoERouter", "VllmMoERouter", "VllmRouterKernel",
    "check_positive_int", "check_replay_ids", "check_unquantized", "router_native",
    "routing_weights_vjp",
]

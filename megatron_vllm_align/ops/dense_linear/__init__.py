"""The unquantized linear: vLLM's ``ReplicatedLinear`` forward, the reused linear VJP (TE's GEMMs on CUDA)."""
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel, linear_native
from megatron_vllm_align.ops.dense_linear.module import DenseLinearFunction, DeployedLinear, VllmDenseLinear
from megatron_vllm_align.ops.dense_linear.reference import ReferenceDenseLinear
from megatron_vllm_align.ops.dense_linear.vjp import (
    BACKWARD_PRECISIONS,
    backward_precision,
    current_backward_precision,
    linear_vjp,
    set_backward_precision,
)

__all__ = [
    "BACKWARD_PRECISIONS", "DenseLinearFunction", "DeployedLinear", "ReferenceDenseLinear", "VllmDenseLinear",
    "VllmLinearKernel", "backward_precision", "current_backward_precision", "linear_native", "linear_vjp",
    "set_backward_precision",
]

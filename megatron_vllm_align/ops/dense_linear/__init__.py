"""The unquantized linear: vLLM's ``ReplicatedLinear`` forward, the reused linear VJP (TE's GEMMs on CUDA)."""
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel, linear_native
from megatron_vllm_align.ops.dense_linear.module import DenseLinearFunction, DeployedLinear, VllmDenseLinear
from megatron_vllm_align.ops.dense_linear.reference import ReferenceDenseLinear
from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp

__all__ = [
    "DenseLinearFunction", "DeployedLinear", "ReferenceDenseLinear", "VllmDenseLinear",
    "VllmLinearKernel", "linear_native", "linear_vjp",
]

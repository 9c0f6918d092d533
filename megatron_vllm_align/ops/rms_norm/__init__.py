"""RMSNorm (optionally with the fused residual add): vLLM's ``RMSNorm`` forward, a closed-form backward."""
from megatron_vllm_align.ops.rms_norm.kernel import VllmRMSNormKernel, check_norm_inputs, rms_norm_native
from megatron_vllm_align.ops.rms_norm.module import FusedAddRMSNormFunction, RMSNormFunction, VllmRMSNorm
from megatron_vllm_align.ops.rms_norm.reference import ReferenceRMSNorm
from megatron_vllm_align.ops.rms_norm.vjp import rms_norm_input_grad

__all__ = [
    "FusedAddRMSNormFunction", "RMSNormFunction", "ReferenceRMSNorm", "VllmRMSNorm",
    "VllmRMSNormKernel", "check_norm_inputs", "rms_norm_input_grad", "rms_norm_native",
]

"""The W4A4 NVFP4 linear (contract ``nvfp4_linear``): vLLM's ModelOpt NVFP4 method on its emulation kernel in
forward, the linear VJP on the contract's references (clipped activation STE) in backward."""
from megatron_vllm_align.ops.nvfp4_linear.kernel import (
    MODELOPT_NVFP4_QUANT_CONFIG,
    VllmNVFP4LinearKernel,
    deployed_nvfp4_weight,
    nvfp4_linear_native,
    pack_e2m1,
)
from megatron_vllm_align.ops.nvfp4_linear.module import VllmNVFP4Linear, VllmNVFP4LinearFunction
from megatron_vllm_align.ops.nvfp4_linear.reference import NVFP4_LINEAR_VARIABLES, ReferenceNVFP4Linear
from megatron_vllm_align.ops.nvfp4_linear.vjp import nvfp4_linear_vjp, saved_tensor_names

__all__ = [
    "MODELOPT_NVFP4_QUANT_CONFIG", "NVFP4_LINEAR_VARIABLES", "ReferenceNVFP4Linear", "VllmNVFP4Linear",
    "VllmNVFP4LinearFunction", "VllmNVFP4LinearKernel", "deployed_nvfp4_weight", "nvfp4_linear_native",
    "nvfp4_linear_vjp", "pack_e2m1", "saved_tensor_names",
]

"""The gated SiLU activation ``silu(gate) * up``: vLLM's ``SiluAndMul`` forward, a closed-form backward."""
from megatron_vllm_align.ops.silu_and_mul.kernel import VllmSiluAndMulKernel, check_gated_input, silu_and_mul_native
from megatron_vllm_align.ops.silu_and_mul.module import SiluAndMulFunction, VllmSiluAndMul
from megatron_vllm_align.ops.silu_and_mul.reference import ReferenceSiluAndMul
from megatron_vllm_align.ops.silu_and_mul.vjp import silu_and_mul_vjp

__all__ = [
    "ReferenceSiluAndMul", "SiluAndMulFunction", "VllmSiluAndMul", "VllmSiluAndMulKernel",
    "check_gated_input", "silu_and_mul_native", "silu_and_mul_vjp",
]

"""Quantization numerics (vLLM's FP8 and NVFP4 rules), the FP8 GEMM emulations and straight-through
estimators. The FP8 linear module and its backward live in ``ops.fp8_linear``."""
from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8, quantize_fp8
from megatron_vllm_align.quant.fp8_contract import FP8Position, fp8_position
from megatron_vllm_align.quant.fp8_gemm import DequantFP8Gemm, VisibleGemm, vllm_fp8_scaled_mm
from megatron_vllm_align.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from megatron_vllm_align.quant.ste import apply_ste, ste_pass_mask, ste_quantize

__all__ = [
    "DequantFP8Gemm",
    "FP8Position",
    "FP8Scheme",
    "NVFP4Tensor",
    "VisibleGemm",
    "apply_ste",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "fp8_position",
    "quantize_fp8",
    "quantize_nvfp4",
    "ste_pass_mask",
    "ste_quantize",
    "vllm_fp8_scaled_mm",
]

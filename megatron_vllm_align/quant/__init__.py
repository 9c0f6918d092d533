"""Quantization numerics (vLLM's FP8 and NVFP4 rules), straight-through estimators, an FP8 linear and
the linear backward every linear module reuses."""
from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8, quantize_fp8
from megatron_vllm_align.quant.fp8_contract import FP8Position, fp8_position
from megatron_vllm_align.quant.fp8_gemm import DequantFP8Gemm, VisibleGemm, vllm_fp8_scaled_mm
from megatron_vllm_align.quant.linear_vjp import linear_vjp
from megatron_vllm_align.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from megatron_vllm_align.quant.quantized_linear import (
    FP8Linear,
    FP8LinearConfig,
    FP8LinearFunction,
    default_fp8_linear_config,
    fp8_linear,
)
from megatron_vllm_align.quant.ste import apply_ste, ste_pass_mask, ste_quantize

__all__ = [
    "DequantFP8Gemm",
    "FP8Linear",
    "FP8LinearConfig",
    "FP8LinearFunction",
    "FP8Position",
    "FP8Scheme",
    "NVFP4Tensor",
    "VisibleGemm",
    "apply_ste",
    "default_fp8_linear_config",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "fp8_linear",
    "fp8_position",
    "linear_vjp",
    "quantize_fp8",
    "quantize_nvfp4",
    "ste_pass_mask",
    "ste_quantize",
    "vllm_fp8_scaled_mm",
]

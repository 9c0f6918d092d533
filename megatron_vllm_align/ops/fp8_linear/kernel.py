"""The W8A8 FP8 linear as the engine runs it with ``quantization="fp8_per_channel"``: vLLM's
``Fp8PtpcOnlineLinearMethod`` inside the shared shadow layer
(:class:`~megatron_vllm_align.ops.dense_linear.kernel.VllmLinearKernel` with ``quantized=True``),
per-output-channel weight scales and dynamic per-token activation scales, and its native reference.
"""
from __future__ import annotations

import torch

from megatron_vllm_align.quant.fp8 import FP8Scheme, quantize_fp8
from megatron_vllm_align.quant.fp8_gemm import DequantFP8Gemm

__all__ = ["FP8_ACTIVATION_SCHEME", "FP8_WEIGHT_SCHEME", "fp8_linear_native"]

FP8_ACTIVATION_SCHEME = FP8Scheme("per_token")
FP8_WEIGHT_SCHEME = FP8Scheme("per_channel")


def fp8_linear_native(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 reference: x quantized per token (vLLM's rule), both operands dequantized in fp32,
    fp32 matmul and bias, one cast to x's dtype."""
    x_q, x_scale = quantize_fp8(x, FP8_ACTIVATION_SCHEME)
    return DequantFP8Gemm(FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME)(x_q, x_scale, w_q, w_scale, bias, x.dtype)

"""Visible FP8 GEMMs ``Y = dequant(x_q) @ dequant(w_q)^T + bias``: vLLM's CPU kernel and a native reference.

A visible GEMM is any callable ``gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor[M, N]``
with ``x_q`` fp8 ``[M, K]``, ``w_q`` fp8 ``[N, K]`` (``nn.Linear`` layout), fp32 scales in the shapes of
``megatron_vllm_align.quant.fp8`` and ``bias`` ``[N]`` or ``None``.

* ``vllm_fp8_scaled_mm``: vLLM's own ``ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm``, the
  kernel vLLM selects on CPUs without AMX-FP8 for per-token activations with per-channel or per-tensor
  weights (fp32 ``torch._scaled_mm`` with unit scales, the scales and bias applied in fp32, one cast).
* ``DequantFP8Gemm``: the documented emulation for every granularity: dequantize both operands in fp32,
  then :func:`linear_native` (fp32 matmul, ``+ bias`` in fp32, one cast), the native linear reference
  also used by ``ops.dense_linear.kernel``.

vLLM's other CPU FP8 kernels and why they do not fit: docs/fp8_facts.md#vllms-fp8-linear-on-cpu.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8


class VisibleGemm(Protocol):
    """``(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor[M, N]`` of dtype ``out_dtype``."""

    def __call__(self, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor: ...


@functools.cache
def _vllm_channelwise_kernel() -> Any:
    """vLLM's ChannelWise FP8 kernel, built once through vLLM's kernel selection (forced).

    Its ``apply_scaled_mm`` uses no layer state, so the weight shape given here is irrelevant.

    Why any ``VllmConfig`` will do here (not only the engine's ``ops.vllm_context``, which
    needs a model directory this function does not have), read in vllm 0.32
    ``model_executor/kernels/linear``: the forced selection (``choose_scaled_mm_linear_kernel``)
    reads only ``current_platform`` and ``VLLM_DISABLED_KERNELS``; the config is read only by
    the kernel's constructor, for its activation quantizer ``quant_fp8`` (token padding from the
    compilation mode, the ``QuantFP8`` custom-op dispatch), which this module never calls (the
    activation is quantized by ``quant.fp8``) but whose token padding it applies: with fewer rows
    than ``num_token_padding`` (17 in eager mode) vLLM zero-pads the quantized activation, and
    ``torch._scaled_mm`` is not row-invariant on every CPU (AVX2: M = 1 and M = 17 differ in the
    last fp32 bit); ``apply_scaled_mm`` reads no config. vLLM's
    constructor needs some current config, so the current one (e.g. the engine's) or a default
    is set. ``tests/ops/dense_linear/test_linear_kernel.py`` checks the output bitwise against the
    engine-context ``Fp8PtpcOnlineLinearMethod`` layer, which selects this same kernel class.
    """
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym, kFp8StaticChannelSym

    config = get_current_vllm_config_or_none() or VllmConfig()
    with set_current_vllm_config(config):
        kernel = init_fp8_linear_kernel(
            activation_quant_key=kFp8DynamicTokenSym, weight_quant_key=kFp8StaticChannelSym,
            input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(128, 128),
            force_kernel=ChannelWiseTorchFP8ScaledMMLinearKernel,
        )
    if not isinstance(kernel, ChannelWiseTorchFP8ScaledMMLinearKernel):
        raise RuntimeError(f"vLLM refused ChannelWiseTorchFP8ScaledMMLinearKernel, chose {type(kernel).__name__}")
    return kernel


def vllm_fp8_scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """vLLM's CPU W8A8 FP8 GEMM for per-token ``x_scale [M, 1]`` and ``w_scale [N, 1]`` or ``[1]``."""
    rows, _ = x_q.shape
    out_features = w_q.shape[0]
    if tuple(x_scale.shape) != (rows, 1):
        raise ValueError(f"vllm_fp8_scaled_mm needs a per-token x_scale of shape {(rows, 1)}, "
                         f"got {tuple(x_scale.shape)}")
    if tuple(w_scale.shape) not in ((out_features, 1), (1,)):
        raise ValueError(f"vllm_fp8_scaled_mm needs a per-channel [{out_features}, 1] or per-tensor [1] "
                         f"w_scale, got {tuple(w_scale.shape)}; use DequantFP8Gemm for block scales")
    if x_q.dtype != torch.float8_e4m3fn or w_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"vllm_fp8_scaled_mm needs float8_e4m3fn operands, got {x_q.dtype} / {w_q.dtype}")
    kernel = _vllm_channelwise_kernel()
    padding = kernel.quant_fp8.num_token_padding  # vLLM zero-pads the quantized rows up to this count
    if padding is not None and rows < padding:
        x_q = F.pad(x_q, (0, 0, 0, padding - rows))
    return kernel.apply_scaled_mm(
        A=x_q, B=w_q.t(), out_dtype=out_dtype, As=x_scale, Bs=w_scale, bias=bias,
        output_shape=[rows, out_features],
    )


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` in fp32 (x [M, K], weight [N, K], bias [N]), one cast to
    ``out_dtype`` (default: x's dtype)."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype if out_dtype is None else out_dtype)


@dataclass(frozen=True)
class DequantFP8Gemm:
    """Native visible GEMM: fp32 dequantize (``dequantize_fp8``), then :func:`linear_native`."""

    activation_scheme: FP8Scheme
    weight_scheme: FP8Scheme

    def __call__(self, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        x_ref = dequantize_fp8(x_q, x_scale, self.activation_scheme)
        w_ref = dequantize_fp8(w_q, w_scale, self.weight_scheme)
        return linear_native(x_ref, w_ref, bias, out_dtype)

"""The W4A4 NVFP4 linear as vLLM runs it where no FP4 GEMM exists, and its native reference.

Visible: :class:`VllmNVFP4LinearKernel` builds vLLM's ModelOpt NVFP4 linear method
(``ModelOptLinearMethod``, ``quant_algo: NVFP4``) on a shadow layer as ``create_weights`` does, with
vLLM's plain-PyTorch emulation kernel ``EmulationNvFp4LinearKernel`` in place of vLLM's CPU kernel
selection (empty: the engine refuses NVFP4 on CPU), then runs vLLM's ``process_weights_after_loading``
and ``apply``. :meth:`VllmNVFP4LinearKernel.load` deploys the master weight with vLLM's online NVFP4
rule. Native reference :func:`nvfp4_linear_native`: x quantized by ``quant.nvfp4``, both operands
dequantized to the model dtype with vLLM's formulas, fp32 matmul, one cast, bias added in the model
dtype. Bound against the visible forward, elementwise:
``|visible - native| <= 2 u |native| + 2 K 2^-24 (|X_dq| |W_dq|^T)`` (accumulation order only).
What vLLM selects and computes, measured: docs/nvfp4_facts.md#the-engine-does-not-serve-nvfp4-on-cpu
and the emulation section after it.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.dense_linear.kernel import check_linear_input, check_linear_operands
from megatron_vllm_align.ops.vllm_context import VllmContext
from megatron_vllm_align.quant.nvfp4 import BLOCK_SIZE, E2M1_MAX, E4M3_MAX, NVFP4Tensor, quantize_nvfp4

__all__ = ["MODELOPT_NVFP4_QUANT_CONFIG", "VllmNVFP4LinearKernel", "deployed_nvfp4_weight", "nvfp4_linear_native",
           "pack_e2m1"]

#: The ``hf_quant_config.json`` of a ModelOpt NVFP4 (W4A4) checkpoint, as vLLM's
#: ``ModelOptNvFp4Config.from_config`` reads it.
MODELOPT_NVFP4_QUANT_CONFIG: dict[str, Any] = {
    "producer": {"name": "modelopt"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": BLOCK_SIZE,
                     "exclude_modules": []},
}
_MIN_AMAX = 1e-8
# Nibble index of 2 * |code| for the E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (-1: not a code).
_INDEX_OF_TWICE = (0, 1, 2, 3, 4, -1, 5, -1, 6, -1, -1, -1, 7)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``uint8 [M, K/2]`` of E2M1 values ``codes [M, K]`` (fp32, as vLLM's ``ref_nvfp4_quant``
    returns them): sign bit ``0x8`` (kept for ``-0.0``), grid index in the low 3 bits, element ``2i``
    in the low nibble (vLLM's ``break_fp4_bytes`` order)."""
    lut = torch.tensor(_INDEX_OF_TWICE, dtype=torch.uint8, device=codes.device)
    twice = (codes.abs() * 2).to(torch.int64)
    nibbles = lut[twice] | (torch.signbit(codes).to(torch.uint8) << 3)
    nibbles = nibbles.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def _vllm_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [M, K/2], block scales e4m3 [M, K/16]) of vLLM's ``ref_nvfp4_quant``."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant

    codes, scales = ref_nvfp4_quant(x, global_scale, BLOCK_SIZE)
    return pack_e2m1(codes), scales.to(torch.float8_e4m3fn)  # scales are e4m3 values: exact


def deployed_nvfp4_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed [N, K/2] uint8, weight_scale [N, K/16] e4m3, weight_scale_2 [1] fp32)`` of
    ``weight [N, K]`` under vLLM's online NVFP4 rule (module docstring), as a ModelOpt checkpoint
    stores them."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    amax = weight_amax(weight).to(torch.float32).clamp_min(_MIN_AMAX).reshape(1)
    global_scale = (E2M1_MAX * E4M3_MAX) / amax
    packed, block_scale = _vllm_quantize(weight, global_scale)
    return packed, block_scale, (1.0 / global_scale).to(torch.float32)


class VllmNVFP4LinearKernel:
    """A shadow vLLM NVFP4 (W4A4) linear ``in_features -> out_features``; call :meth:`load` first.

    ``kernel(x [M, K]) -> y [M, N]`` in the model dtype. ``context`` supplies the model dtype and
    vLLM's configuration context; its quantization config is used when it is ModelOpt NVFP4
    (W4A4), otherwise the one a ModelOpt NVFP4 checkpoint gives (:data:`MODELOPT_NVFP4_QUANT_CONFIG`).
    The shadow is a plain attribute of its owner and none of its tensors requires grad.
    """

    def __init__(self, context: VllmContext, in_features: int, out_features: int, bias: bool,
                 prefix: str = "") -> None:
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if in_features % BLOCK_SIZE:
            raise ValueError(f"NVFP4 quantizes in blocks of {BLOCK_SIZE} input features: in_features must be a "
                             f"multiple of {BLOCK_SIZE}, got {in_features}")
        if not isinstance(context, VllmContext):
            raise TypeError(f"context must be a VllmContext, got {type(context).__name__}")
        config = context.quant_config
        if not (isinstance(config, ModelOptNvFp4Config) and config.quant_method == "NVFP4"):
            config = ModelOptNvFp4Config.from_config(MODELOPT_NVFP4_QUANT_CONFIG)
        self.context, self.quant_config = context, config
        self.in_features, self.out_features = in_features, out_features
        self.has_bias, self.prefix = bias, prefix
        self.layer: Any = None
        self.method: Any = None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor) -> None:
        """Rebuild the shadow from master ``weight`` [N, K] (cast to the model dtype, then quantized),
        ``bias`` [N] and the calibrated ``input_scale`` (fp32 [1], ``amax / 2688``), through vLLM's
        ModelOpt weight processing."""
        from vllm.model_executor.kernels.linear import NvFp4LinearLayerConfig
        from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
        from vllm.model_executor.layers.quantization.modelopt import ACT, WEIGHT, Shapes, build_linear_method
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        check_linear_operands(weight, bias, self.out_features, self.in_features, self.has_bias)
        if not (isinstance(input_scale, torch.Tensor) and input_scale.dtype == torch.float32
                and input_scale.numel() == 1 and bool(torch.isfinite(input_scale).all())
                and bool((input_scale > 0).all())):
            raise ValueError(f"input_scale must be a finite positive float32 tensor with one element, got "
                             f"{input_scale!r}")
        dtype = self.context.model_dtype
        with torch.no_grad():
            packed, block_scale, weight_scale_2 = deployed_nvfp4_weight(weight.detach().to(dtype))
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            method = build_linear_method(self.quant_config, self.quant_config.quant_method, self.prefix)
            layer = torch.nn.Module()
            shapes = Shapes([self.out_features], self.in_features, dtype)
            # ModelOptLinearMethod.create_weights, with the emulation kernel instead of vLLM's selection.
            method.wkey.create_weights(layer, WEIGHT, method.ctx, shapes, default_weight_loader)
            method.akey.create_weights(layer, ACT, method.ctx, shapes, default_weight_loader)
            method.fmt.extra_weights(layer, shapes, method.ctx, default_weight_loader)
            method.kernel = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
            for name, value in (("weight", packed), ("weight_scale", block_scale),
                                ("weight_scale_2", weight_scale_2), ("input_scale", input_scale.detach())):
                param = getattr(layer, name)
                param.weight_loader(param, value.reshape(param.shape))
            layer.bias = None
            if bias is not None:
                layer.bias = torch.nn.Parameter(bias.detach().to(dtype).clone(), requires_grad=False)
            method.process_weights_after_loading(layer)
        self.layer, self.method = layer, method

    def _check_loaded(self) -> None:
        if self.layer is None:
            raise RuntimeError("the shadow vLLM NVFP4 layer has no deployed value yet: call load(weight, bias, "
                               "input_scale)")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._check_loaded()
        check_linear_input(x, self.context.model_dtype, self.in_features)
        with torch.no_grad(), self.context.active(parallel_state=True):
            return self.method.apply(self.layer, x.detach(), self.layer.bias)

    def deployed_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The deployed weight as vLLM holds it: ``(packed [N, K/2] uint8, weight_scale [N, K/16] e4m3,
        weight_global_scale fp32 scalar = weight_scale_2)`` (views)."""
        self._check_loaded()
        return self.layer.weight.data, self.layer.weight_scale.data, self.layer.weight_global_scale.data

    def input_scale(self) -> torch.Tensor:
        """vLLM's ``input_global_scale`` (the calibrated ``input_scale``, fp32 scalar): ``x ~ code * s * g``."""
        self._check_loaded()
        return self.layer.input_global_scale.data

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(packed [M, K/2] uint8, block scales [M, K/16] e4m3, global scale)`` of ``x`` from the
        quantizer vLLM's emulation runs on it (``ref_nvfp4_quant`` with ``input_global_scale_inv``)."""
        self._check_loaded()
        global_scale = self.layer.input_global_scale_inv.data
        with torch.no_grad():
            packed, block_scale = _vllm_quantize(x.detach(), global_scale)
        return packed, block_scale, global_scale


def nvfp4_linear_native(x: torch.Tensor, weight: NVFP4Tensor, weight_scale_2: torch.Tensor,
                        input_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W4A4 reference of the visible forward (module docstring): x quantized with ``quant.nvfp4`` at
    ``gs = fp32(1 / input_scale)``, operands dequantized to x's dtype with vLLM's formulas (x:
    ``code * (s / gs)``, W: ``code * (s * weight_scale_2)``), fp32 matmul, one cast, + bias."""
    x_q = quantize_nvfp4(x, (1.0 / input_scale.reshape(1)).to(torch.float32))
    x_dq = _dequantize(x_q, x_q.block_scales.to(torch.float32).unsqueeze(-1) / x_q.global_scale, x.dtype)
    w_dq = _dequantize(weight, weight.block_scales.to(torch.float32).unsqueeze(-1) * weight_scale_2.reshape(1),
                       x.dtype)
    out = (x_dq.float() @ w_dq.float().t()).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def _dequantize(t: NVFP4Tensor, unit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes = t.codes().reshape(*t.shape[:-1], t.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    return (codes * unit).reshape(t.shape).to(dtype)

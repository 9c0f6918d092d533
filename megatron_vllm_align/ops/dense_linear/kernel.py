"""Linear layers exactly as the vLLM engine runs them: a vLLM "shadow" layer holds the deployed value.

vLLM's CPU linear is not ``F.linear``: ``process_weights_after_loading`` prepacks (or quantizes) the
weight and ``apply`` runs the matching kernel, chosen by shape and CPU. :class:`VllmLinearKernel` builds
vLLM's own ``ReplicatedLinear`` (TP = 1) in the engine's config context, loads the master weight (cast
to the model dtype) through the layer's weight loaders, lets vLLM process it and calls the layer; the
processed layer is the *deployed value*, rebuilt from a new master by :meth:`VllmLinearKernel.load`.
Unquantized: ``UnquantizedLinearMethod``; ``quantized=True``: the engine's quantization config for
``prefix`` (``fp8_per_channel``: ``Fp8PtpcOnlineLinearMethod``). Native references (fp32 arithmetic, one
cast): :func:`linear_native` and, for W8A8 FP8,
:func:`~megatron_vllm_align.ops.fp8_linear.kernel.fp8_linear_native` on the dequantized operands.
Tolerance, elementwise: ``|visible - native| <= 2 u |native| + 2 K 2^-24 (|x| |W|^T)``. vLLM's CPU
dispatch: docs/engine_facts.md#op-by-op-bitwise-facts-on-the-engines-tensors; its FP8 kernels and the
per-tensor FP8 that does not run on CPU: docs/fp8_facts.md#vllms-fp8-linear-on-cpu.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.vllm_context import VllmContext
from megatron_vllm_align.quant.fp8_gemm import linear_native

__all__ = ["VllmLinearKernel", "linear_native"]


def check_linear_input(x: torch.Tensor, dtype: torch.dtype, in_features: int) -> None:
    """TypeError / ValueError unless ``x`` is a 2-D ``[M >= 1, in_features]`` tensor of the engine's ``dtype``."""
    if not isinstance(x, torch.Tensor) or x.dtype != dtype:
        raise TypeError(f"x must be a {dtype} tensor (the engine's dtype), got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] != in_features or x.shape[0] == 0:
        raise ValueError(f"x must be [M >= 1, K={in_features}], got {tuple(x.shape)}")


def check_linear_operands(weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int,
                          has_bias: bool) -> None:
    """ValueError unless ``weight`` is [out_features, in_features] and ``bias`` is [out_features] exactly
    when the layer has one."""
    expected = (out_features, in_features)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != expected:
        raise ValueError(f"weight must be a tensor of shape {expected}, got {tuple(getattr(weight, 'shape', ()))}")
    if (bias is not None) != has_bias:
        raise ValueError(f"bias must be {'a tensor' if has_bias else 'None'} for this layer")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape {(out_features,)}, got {tuple(bias.shape)}")


class VllmLinearKernel:
    """A shadow vLLM ``ReplicatedLinear(in_features -> out_features)``; call :meth:`load` first.

    ``kernel(x [M, K]) -> y [M, N]`` in the model dtype. The shadow is a plain attribute of its
    owner (never a submodule) and its tensors never require grad, so no optimizer sees them.
    """

    def __init__(self, context: VllmContext, in_features: int, out_features: int, bias: bool,
                 quantized: bool, prefix: str = "") -> None:
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if quantized and context.quant_config is None:
            raise ValueError(f"quantized=True needs an engine with quantization; {context.spec} has none")
        self.context = context
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.quantized = quantized
        self.prefix = prefix
        self.layer: Any = None

    def fresh(self) -> VllmLinearKernel:
        """An unloaded kernel configured like this one."""
        return VllmLinearKernel(self.context, self.in_features, self.out_features, self.has_bias, self.quantized,
                                self.prefix)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Rebuild the shadow from master ``weight`` [N, K] (and ``bias`` [N]), cast to the model dtype."""
        from vllm.model_executor.layers.linear import ReplicatedLinear

        check_linear_operands(weight, bias, self.out_features, self.in_features, self.has_bias)
        dtype = self.context.model_dtype
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            layer = ReplicatedLinear(self.in_features, self.out_features, bias=self.has_bias,
                                     params_dtype=dtype, return_bias=False, prefix=self.prefix,
                                     quant_config=self.context.quant_config if self.quantized else None)
            layer.weight.weight_loader(layer.weight, weight.detach().to(dtype))
            if bias is not None:
                layer.bias.weight_loader(layer.bias, bias.detach().to(dtype))
            if not getattr(layer, "_already_called_process_weights_after_loading", False):
                layer.quant_method.process_weights_after_loading(layer)
        self.layer = layer

    @property
    def quant_method(self) -> Any:
        """vLLM's quant method object of the loaded shadow layer."""
        self._check_loaded()
        return self.layer.quant_method

    def _check_loaded(self) -> None:
        if self.layer is None:
            raise RuntimeError("the shadow vLLM layer has no deployed value yet: call load(weight, bias)")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._check_loaded()
        check_linear_input(x, self.context.model_dtype, self.in_features)
        with torch.no_grad(), self.context.active(parallel_state=True):
            return self.layer(x.detach())

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The deployed FP8 weight as ``(w_q [N, K] float8_e4m3fn, w_scale [N, 1] fp32)`` (views)."""
        self._check_loaded()
        weight, scale = self.layer.weight, self.layer.weight_scale
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (self.in_features, self.out_features):
            raise RuntimeError(f"the shadow layer holds no per-channel FP8 weight [K, N] "
                               f"(got {weight.dtype} {tuple(weight.shape)})")
        return weight.data.t(), scale.data.reshape(self.out_features, 1)

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_q [M, K], x_scale [M, 1])`` from the FP8 kernel's own activation quantizer (the
        ``QuantFP8`` object its ``apply`` runs), unpadded."""
        self._check_loaded()
        with torch.no_grad(), self.context.active(parallel_state=True):
            x_q, x_scale = self.quant_method.fp8_linear.quant_fp8(x.detach())
        return x_q[: x.shape[0]], x_scale

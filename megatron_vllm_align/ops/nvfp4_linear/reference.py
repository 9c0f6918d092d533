"""Layer-1 reference of the NVFP4 linear ``Y = X W^T + b``, built from its gradient contract alone.

Value: the visible output, under ``no_grad``, from ``visible(x, weight, bias)`` (the candidate's vLLM
kernel in the layer-1 cases; default the native W4A4 forward). Gradient: float64 autograd of
``surrogate = F.linear(X_ref, W_ref, b)``, bridged to the value by ``visible_with_surrogate``;
``VllmNVFP4LinearFunction``'s backward is never called. ``W_ref`` is ``dequant(quant(W))``
(``dx_weight: dequantized``) or ``W`` (``master``), reaching the master through the identity STE;
``X_ref`` is ``dequant(quant(X))`` (``activation_ref: quantized``) or ``X`` (``original``), reaching X
through the clipped STE, whose 0/1 derivative (``|x / g| < threshold``, ``value_at_threshold`` at
equality) is written here from its definition, not taken from ``quant.ste``. Dequantization is exact
float64 ``code * s / gs``. The quantizer is the project's own ``quant.nvfp4.quantize_nvfp4`` (bitwise
vLLM's ``ref_nvfp4_quant``, not the candidate's), with the contract's global scales (weight
``2688 / max(amax|W|, 1e-8)``, input ``fp32(1 / g)``) and vLLM's fp32 rounding decisions, so the
reference shares the forward's discrete state; why fp32, measured:
docs/nvfp4_facts.md#quantizer-decisions-are-fp32-decisions.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.contracts import STE, ContractError, GradientContract
from megatron_vllm_align.ops.reference_bridge import visible_with_surrogate
from megatron_vllm_align.quant.nvfp4 import BLOCK_SIZE, NVFP4Tensor, default_global_scale, quantize_nvfp4

#: Harness item (``compare_vjp``) -> the NVFP4 linear contract's trainable variable.
NVFP4_LINEAR_VARIABLES = {"input[0]": "input", "weight": "master_weight", "bias": "bias"}

VisibleLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _dequantize64(t: NVFP4Tensor) -> torch.Tensor:
    """``code * s / gs`` in float64 (exact: a 3-bit code times a 4-bit scale, one division)."""
    codes = t.codes().double().reshape(*t.shape[:-1], t.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    unit = t.block_scales.double().unsqueeze(-1) / t.global_scale.double()
    return (codes * unit).reshape(t.shape)


def _clipped_derivative(ste: STE, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """0/1 derivative of ``ste`` at ``x`` relative to the input global scale ``g`` (None: identity)."""
    if ste.kind == "identity":
        return None
    ratio = x.detach().double().abs() / g.double()
    return (ratio < ste.threshold) | ((ratio == ste.threshold) & (ste.value_at_threshold == 1.0))


class ReferenceNVFP4Linear(nn.Module):
    """Independent reference for a module implementing ``contract`` (the NVFP4 linear, case B).

    Parameters ``weight [out, in]`` and ``bias [out]`` (if ``bias``); buffer ``input_scale`` (fp32
    [1], the fixed ``g``). ``visible``: ``(x, weight, bias) -> Y`` giving the output value.
    """

    def __init__(self, contract: GradientContract, in_features: int, out_features: int, bias: bool = True, *,
                 input_scale: torch.Tensor, visible: VisibleLinear, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(contract, GradientContract):
            raise TypeError(f"contract must be a GradientContract, got {type(contract).__name__}")
        surrogate = contract.surrogate
        if surrogate.weight_ste.kind != "identity":
            raise ContractError("the NVFP4 weight's global scale follows its amax (nothing saturates): its STE "
                                "must be identity", contract=contract.module_class, field="surrogate.weight_ste")
        if surrogate.activation_ste.kind not in ("identity", "clipped"):
            raise ContractError("the NVFP4 input is quantized: its STE must be identity or clipped",
                                contract=contract.module_class, field="surrogate.activation_ste")
        if contract.trainable.scales.get("input.global") != "fixed":
            raise ContractError("the clipped STE is relative to a fixed input global scale",
                                contract=contract.module_class, field="trainable.scales.input.global")
        if not callable(visible):
            raise TypeError("visible must be callable")
        self.contract, self.visible = contract, visible
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.register_buffer("input_scale", input_scale.detach().to(torch.float32).reshape(1).clone())
        self._weight_cache: tuple[tuple, torch.Tensor] | None = None

    @classmethod
    def like(cls, module: nn.Module, contract: GradientContract, **kwargs) -> ReferenceNVFP4Linear:
        """A reference with independent copies of ``module``'s ``weight``, ``bias`` and ``input_scale``."""
        weight, bias = module.weight, getattr(module, "bias", None)
        reference = cls(contract, weight.shape[1], weight.shape[0], bias is not None, input_scale=module.input_scale,
                        device=weight.device, dtype=weight.dtype, **kwargs)
        with torch.no_grad():
            reference.weight.copy_(weight)
            if bias is not None:
                reference.bias.copy_(bias)
        return reference

    def _weight_value(self, dtype: torch.dtype) -> torch.Tensor:
        """float64 value of ``W_ref``: ``dequant(quant(W))`` of the master cast to ``dtype`` (the deployed
        value's source) or that cast master; kept while the weight's storage and version are unchanged."""
        key = (self.weight.data_ptr(), self.weight._version, dtype)
        if self._weight_cache is not None and self._weight_cache[0] == key:
            return self._weight_cache[1]
        w_model = self.weight.detach().to(dtype)
        if self.contract.surrogate.dx_weight == "dequantized":
            value = _dequantize64(quantize_nvfp4(w_model, default_global_scale(w_model)))
        else:
            value = w_model.double()
        self._weight_cache = (key, value)
        return value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be a tensor [..., {self.in_features}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        with torch.no_grad():
            visible = self.visible(x, self.weight, self.bias)
        surrogate = self.contract.surrogate
        x2d = x.reshape(-1, self.in_features)
        x64 = x2d.double()
        if surrogate.activation_ref == "quantized":
            gs = (1.0 / self.input_scale).to(torch.float32)
            x_value = _dequantize64(quantize_nvfp4(x2d.detach(), gs))
        else:
            x_value = x64.detach()
        d = _clipped_derivative(surrogate.activation_ste, x2d, self.input_scale)
        x_ref = visible_with_surrogate(x_value, x64 if d is None else torch.where(d, x64, x64.detach()), name="STE")
        w_ref = visible_with_surrogate(self._weight_value(visible.dtype), self.weight.double(), name="STE")
        bias = None if self.bias is None else self.bias.double()
        out = F.linear(x_ref, w_ref, bias).to(visible.dtype).reshape(visible.shape)
        return visible_with_surrogate(visible, out, name="ReferenceNVFP4Linear")

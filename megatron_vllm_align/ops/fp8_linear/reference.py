"""Layer-1 reference of an FP8 linear ``Y = X W^T + b``, built from its gradient contract alone.

Value: the visible output, under ``no_grad``, from ``visible(x, weight, bias)`` (default the quant
module's forward configured from the same contract). Gradient: float64 autograd of
``surrogate = F.linear(X_ref, W_ref, b)``, bridged to the value by ``visible_with_surrogate``;
``FP8LinearFunction``'s backward is never called. ``W_ref`` is ``dequant(quant(W))``
(``dx_weight: dequantized``) or ``W`` (``master``); ``X_ref`` is ``dequant(quant(X))``
(``activation_ref: quantized``) or ``X`` (``original``); each reaches its variable through the
contract's STE of its role, ``visible_with_surrogate(value, torch.where(d, t, t.detach()))``, with the
0/1 derivative ``d`` of a clipped STE (``|t / s|`` against the threshold, ``s`` the tensor's fixed
per-tensor scale) written here from the contract, not taken from ``quant.ste``. Shared with the
candidate on purpose: the forward quantizer ``quant.fp8`` (its FP8 values are the visible forward's;
why not an independent one, measured: docs/fp8_facts.md#why-the-layer-1-reference-shares-the-fp8-quantizer)
and the contract's quantize positions (``quant.fp8_contract``). Everything after the quantizer is
float64 and written here.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.contracts import STE, ContractError, GradientContract
from megatron_vllm_align.ops.fp8_linear.emulated import FP8LinearConfig, fp8_linear
from megatron_vllm_align.ops.reference_bridge import visible_with_surrogate
from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8, quantize_fp8
from megatron_vllm_align.quant.fp8_contract import fp8_position

#: Harness item (``compare_vjp``) -> the FP8 linear contract's trainable variable.
FP8_LINEAR_VARIABLES = {"input[0]": "input", "weight": "master_weight", "bias": "bias"}

VisibleLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _surrogate_derivative(ste: STE, tensor: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | None:
    """0/1 derivative of the contract's STE at ``tensor`` (bool), or None for identity."""
    if ste.kind == "identity":
        return None
    ratio = (tensor.detach().double() / scale.double()).abs()
    at_threshold = ratio == ste.threshold
    return (ratio < ste.threshold) | (at_threshold & (ste.value_at_threshold == 1.0))


class _Role:
    """How one role (activation or weight) enters the surrogate, read from the contract."""

    def __init__(self, contract: GradientContract, role: str, quantized_value: bool, ste: STE,
                 static_scales: dict[str, torch.Tensor]) -> None:
        position = fp8_position(contract, role)
        self.scheme: FP8Scheme = position.scheme
        self.scale = static_scales.get(position.tensor) if position.scheme.static else None
        if position.scheme.static and self.scale is None:
            raise ContractError(f"the fixed scale of {position.tensor!r} must be given in static_scales",
                                contract=contract.module_class, field=f"trainable.scales.{position.tensor}")
        if ste.kind == "clipped" and not (position.scheme.static and position.scheme.granularity == "per_tensor"):
            raise ContractError(f"a clipped STE on {position.tensor!r} is relative to a fixed per-tensor scale, "
                                f"but its scale is {position.scheme.granularity} "
                                f"{'static' if position.scheme.static else 'dynamic'}",
                                contract=contract.module_class, field=f"surrogate.{role}_ste")
        self.quantized_value, self.ste = quantized_value, ste

    def reference(self, tensor64: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``tensor64`` (float64 view of ``source``) valued per the contract, gradient via the STE."""
        if self.quantized_value:
            q, s = quantize_fp8(source.detach(), self.scheme, self.scale)
            value = dequantize_fp8(q, s, self.scheme).double()
        else:
            value = tensor64.detach()
        derivative = _surrogate_derivative(self.ste, source, self.scale)
        passing = tensor64 if derivative is None else torch.where(derivative, tensor64, tensor64.detach())
        return visible_with_surrogate(value, passing, name="STE")


class ReferenceFP8Linear(nn.Module):
    """Independent reference for a module implementing ``contract`` (an FP8 linear, case B).

    Parameters ``weight [out, in]`` and ``bias [out]`` (if ``bias``), as ``FP8Linear``; called as
    ``module(x [..., in])``. ``static_scales``: fp32 ``[1]`` tensors of the contract's tensors with
    a ``fixed`` scale, keyed by tensor name. ``visible``: ``(x, weight, bias) -> Y`` giving the
    output value; default ``fp8_linear`` under ``FP8LinearConfig.from_contract(contract)``.
    """

    def __init__(self, contract: GradientContract, in_features: int, out_features: int, bias: bool = True, *,
                 static_scales: dict[str, torch.Tensor] | None = None, visible: VisibleLinear | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(contract, GradientContract):
            raise TypeError(f"contract must be a GradientContract, got {type(contract).__name__}")
        scales = dict(static_scales or {})
        surrogate = contract.surrogate
        self.contract = contract
        self.activation_role = _Role(contract, "activation", surrogate.activation_ref == "quantized",
                                surrogate.activation_ste, scales)
        self.weight_role = _Role(contract, "weight", surrogate.dx_weight == "dequantized", surrogate.weight_ste,
                                 scales)
        if visible is None:
            visible = functools.partial(fp8_linear, config=FP8LinearConfig.from_contract(contract,
                                                                                         static_scales=scales))
        self.visible = visible
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def like(cls, module: nn.Module, contract: GradientContract, **kwargs) -> ReferenceFP8Linear:
        """A reference with independent copies of ``module``'s ``weight`` and ``bias`` values."""
        weight, bias = module.weight, getattr(module, "bias", None)
        reference = cls(contract, weight.shape[1], weight.shape[0], bias is not None, device=weight.device,
                        dtype=weight.dtype, **kwargs)
        with torch.no_grad():
            reference.weight.copy_(weight)
            if bias is not None:
                reference.bias.copy_(bias)
        return reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be a tensor [..., {self.in_features}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        with torch.no_grad():
            visible = self.visible(x, self.weight, self.bias)
        x2d = x.reshape(-1, self.in_features)
        x_ref = self.activation_role.reference(x2d.double(), x2d)
        w_ref = self.weight_role.reference(self.weight.double(), self.weight)
        bias = None if self.bias is None else self.bias.double()
        surrogate = F.linear(x_ref, w_ref, bias).to(visible.dtype).reshape(visible.shape)
        return visible_with_surrogate(visible, surrogate, name="ReferenceFP8Linear")

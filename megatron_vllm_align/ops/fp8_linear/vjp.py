"""The FP8 linears' backward: :func:`~megatron_vllm_align.ops.dense_linear.vjp.linear_vjp` on
references rebuilt from what the forward saved.

FP8 linears save their references under the tensor names a contract's ``save_recompute.save``
uses (:func:`saved_tensor_names`), and :func:`fp8_linear_vjp` rebuilds them: ``W_ref`` =
``dequant(weight_fp8, weight_scale)`` for ``dx_weight="dequantized"``, else ``master_weight``;
``X_ref`` = ``dequant(input_fp8, input_scale)`` for ``dw_activation="dequantized"``, else
``input``; the activation mask is ``input_clip_mask``. Dequantization is the fp32 product rounded
once to dY's dtype (the model dtype): :func:`linear_vjp` is the ordinary BF16 GEMM backward, reused
once the STE proxy is fixed, and its operands are in the model dtype.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8

DX_WEIGHT_CHOICES: tuple[str, ...] = ("dequantized", "master")
DW_ACTIVATION_CHOICES: tuple[str, ...] = ("dequantized", "original")


def check_reference_choices(dx_weight: str, dw_activation: str, owner: str = "") -> None:
    """``ValueError`` (field names prefixed by ``owner``) unless both are allowed choices."""
    if dx_weight not in DX_WEIGHT_CHOICES:
        raise ValueError(f"{owner}dx_weight must be one of {DX_WEIGHT_CHOICES}, got {dx_weight!r}")
    if dw_activation not in DW_ACTIVATION_CHOICES:
        raise ValueError(f"{owner}dw_activation must be one of {DW_ACTIVATION_CHOICES}, got {dw_activation!r}")


def saved_tensor_names(dx_weight: str, dw_activation: str, need_dx: bool, need_dw: bool,
                       clip_activation: bool = False, clip_weight: bool = False) -> tuple[str, ...]:
    """Names of the tensors an FP8 linear saves for the requested gradients, in save order.

    ``clip_activation`` / ``clip_weight``: the activation / weight STE is clipped (its mask is
    saved as ``input_clip_mask`` / recomputed from the saved ``master_weight``)."""
    names: list[str] = []
    if need_dx:
        names += ["weight_fp8", "weight_scale"] if dx_weight == "dequantized" else ["master_weight"]
        if clip_activation:
            names.append("input_clip_mask")
    if need_dw:
        names += ["input_fp8", "input_scale"] if dw_activation == "dequantized" else ["input"]
        if clip_weight and "master_weight" not in names:
            names.append("master_weight")
    return tuple(names)


def fp8_linear_vjp(grad_out: torch.Tensor, saved: Mapping[str, torch.Tensor], weight_scheme: FP8Scheme,
                   activation_scheme: FP8Scheme, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
                   needs: tuple[bool, bool, bool], weight_mask: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor | None, ...]:
    """:func:`linear_vjp` from the tensors ``saved`` under :func:`saved_tensor_names`.

    ``weight_scheme`` / ``activation_scheme`` dequantize ``weight_fp8`` / ``input_fp8``;
    ``dtypes`` = (x, weight, bias) dtypes; ``weight_mask``: the weight STE's pass mask or None.
    """
    w_ref = saved.get("master_weight")
    if "weight_fp8" in saved:
        w_ref = dequantize_fp8(saved["weight_fp8"], saved["weight_scale"], weight_scheme, grad_out.dtype)
    x_ref = saved.get("input")
    if "input_fp8" in saved:
        x_ref = dequantize_fp8(saved["input_fp8"], saved["input_scale"], activation_scheme, grad_out.dtype)
    x_dtype, w_dtype, bias_dtype = dtypes
    return linear_vjp(grad_out, x_ref, w_ref, bias_dtype, x_dtype, w_dtype, needs,
                      input_mask=saved.get("input_clip_mask"), weight_mask=weight_mask)

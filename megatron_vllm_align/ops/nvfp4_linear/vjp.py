"""The NVFP4 linear's backward: :func:`~megatron_vllm_align.ops.dense_linear.vjp.linear_vjp` on
references rebuilt from what the forward saved.

Saved tensors carry the contract's names (``save_recompute.save`` of ``nvfp4_linear``;
:func:`saved_tensor_names`). :func:`nvfp4_linear_vjp` rebuilds, in the model dtype (one rounding
each, as vLLM's emulation materialises them):

* ``W_ref`` = vLLM's ``dequantize_to_dtype(weight_fp4, weight_block_scale, weight_global_scale)``,
  i.e. ``code * (s * weight_scale_2)``: bitwise the weight the forward's GEMM used
  (``dx_weight="dequantized"``), else the ``master_weight`` cast to the model dtype;
* ``X_ref`` = ``code * (s / input_global_scale)`` (``ref_nvfp4_quant_dequant``'s formula on the
  forward's own codes): bitwise the activation the forward's GEMM used
  (``dw_activation="dequantized"``), else the ``input``;
* the activation STE's pass mask ``input_clip_mask`` (clipped STE), applied to dX.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.quant.nvfp4 import BLOCK_SIZE

DX_WEIGHT_CHOICES: tuple[str, ...] = ("dequantized", "master")
DW_ACTIVATION_CHOICES: tuple[str, ...] = ("dequantized", "original")
WEIGHT_NAMES = ("weight_fp4", "weight_block_scale", "weight_global_scale")
INPUT_NAMES = ("input_fp4", "input_block_scale", "input_global_scale")


def check_reference_choices(dx_weight: str, dw_activation: str) -> None:
    """``ValueError`` unless both are allowed choices."""
    if dx_weight not in DX_WEIGHT_CHOICES:
        raise ValueError(f"dx_weight must be one of {DX_WEIGHT_CHOICES}, got {dx_weight!r}")
    if dw_activation not in DW_ACTIVATION_CHOICES:
        raise ValueError(f"dw_activation must be one of {DW_ACTIVATION_CHOICES}, got {dw_activation!r}")


def saved_tensor_names(dx_weight: str, dw_activation: str, need_dx: bool, need_dw: bool,
                       clip_activation: bool) -> tuple[str, ...]:
    """Names of the tensors the NVFP4 linear saves for the requested gradients, in save order."""
    names: list[str] = []
    if need_dx:
        names += list(WEIGHT_NAMES) if dx_weight == "dequantized" else ["master_weight"]
        if clip_activation:
            names.append("input_clip_mask")
    if need_dw:
        names += list(INPUT_NAMES) if dw_activation == "dequantized" else ["input"]
    return tuple(names)


def dequantize_input(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``[M, K]`` in ``dtype``: ``code * (s / gs)``, as vLLM's ``ref_nvfp4_quant_dequant``."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    m, k = packed.shape[0], packed.shape[1] * 2
    codes = break_fp4_bytes(packed, torch.float32).reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    unit = block_scale.to(torch.float32).unsqueeze(-1) / global_scale
    return (codes * unit).reshape(m, k).to(dtype)


def dequantize_weight(packed: torch.Tensor, block_scale: torch.Tensor, weight_global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` in ``dtype``: vLLM's ``dequantize_to_dtype`` (unswizzled scales), as its emulation."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    return dequantize_to_dtype(packed, block_scale, weight_global_scale, dtype, BLOCK_SIZE, swizzle=False)


def nvfp4_linear_vjp(grad_out: torch.Tensor, saved: Mapping[str, torch.Tensor], model_dtype: torch.dtype,
                     dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
                     needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """:func:`linear_vjp` from the tensors ``saved`` under :func:`saved_tensor_names`; ``dtypes`` =
    (x, weight, bias) dtypes; references are materialised in ``model_dtype``."""
    w_ref = saved.get("master_weight")
    if w_ref is not None:
        w_ref = w_ref.detach().to(model_dtype)  # the master as the deployed value is cast before quantizing
    if "weight_fp4" in saved:
        w_ref = dequantize_weight(*(saved[name] for name in WEIGHT_NAMES), model_dtype)
    x_ref = saved.get("input")
    if "input_fp4" in saved:
        x_ref = dequantize_input(*(saved[name] for name in INPUT_NAMES), model_dtype)
    x_dtype, w_dtype, bias_dtype = dtypes
    return linear_vjp(grad_out, x_ref, w_ref, bias_dtype, x_dtype, w_dtype, needs,
                      input_mask=saved.get("input_clip_mask"))

"""The reused linear backward, the one implementation behind every linear module here
(``quant.FP8Linear`` and the vLLM-forward layers of ``modules.linear``).

For ``Y = X W^T + b`` with ``G = dL/dY`` [M, N], ``X_ref`` [M, K] and ``W_ref`` [N, K] (which
values these are is the module's gradient contract), :func:`linear_vjp` computes

* ``dX = STE_act(G @ W_ref)``, ``dW = STE_w(G^T @ X_ref)``, ``db = sum over tokens of G``;
* in fp32, each result cast once to its tensor's dtype; on CUDA with Transformer Engine
  importable, dX and dW come from TE's GEMMs (:mod:`.te_gemm`) instead;
* ``STE_act`` / ``STE_w``: an optional bool pass mask (``quant.ste.ste_pass_mask``) of X's / W's
  shape, ``None`` for the identity STE. A 0/1 mask commutes with rounding, so applying it
  before (fp32 path) or after (TE's dX) the cast gives the same bits.

FP8 linears save their references under the tensor names a contract's ``save_recompute.save``
uses (:func:`saved_tensor_names`), and :func:`fp8_linear_vjp` rebuilds them: ``W_ref`` =
``dequant(weight_fp8, weight_scale)`` in fp32 for ``dx_weight="dequantized"``, else
``master_weight``; ``X_ref`` = ``dequant(input_fp8, input_scale)`` for
``dw_activation="dequantized"``, else ``input``; the activation mask is ``input_clip_mask``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8
from megatron_vllm_align.quant.ste import apply_ste

DX_WEIGHT_CHOICES: tuple[str, ...] = ("dequantized", "master")
DW_ACTIVATION_CHOICES: tuple[str, ...] = ("dequantized", "original")


def check_reference_choices(dx_weight: str, dw_activation: str, owner: str = "") -> None:
    """``ValueError`` (field names prefixed by ``owner``) unless both are allowed choices."""
    if dx_weight not in DX_WEIGHT_CHOICES:
        raise ValueError(f"{owner}dx_weight must be one of {DX_WEIGHT_CHOICES}, got {dx_weight!r}")
    if dw_activation not in DW_ACTIVATION_CHOICES:
        raise ValueError(f"{owner}dw_activation must be one of {DW_ACTIVATION_CHOICES}, got {dw_activation!r}")


def linear_vjp(grad_out: torch.Tensor, x_ref: torch.Tensor | None, w_ref: torch.Tensor | None,
               bias_dtype: torch.dtype | None, x_dtype: torch.dtype, w_dtype: torch.dtype,
               needs: tuple[bool, bool, bool], input_mask: torch.Tensor | None = None,
               weight_mask: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """(dX, dW, db) of ``Y = X W^T + b`` for grad_out [M, N], x_ref [M, K], w_ref [N, K].

    ``needs`` = (dX, dW, db) wanted; unneeded operands may be None. ``input_mask`` [M, K] /
    ``weight_mask`` [N, K]: STE pass masks, None for identity. Results in ``x_dtype`` /
    ``w_dtype`` / ``bias_dtype`` (module docstring).
    """
    # Imported on use: the modules package imports this file, so a top-level import would be a cycle.
    from megatron_vllm_align.quant.te_gemm import te_available, te_linear_grads

    need_dx, need_dw, need_db = needs
    if te_available(grad_out.device):
        grad_x, grad_w = te_linear_grads(grad_out, x_ref, w_ref, need_dx, need_dw, x_dtype)
    else:
        grad = grad_out.float()
        grad_x = grad @ w_ref.float() if need_dx else None
        grad_w = grad.t() @ x_ref.float() if need_dw else None
    grad_b = grad_out.float().sum(dim=0).to(bias_dtype) if need_db else None
    return (None if grad_x is None else apply_ste(grad_x, input_mask).to(x_dtype),
            None if grad_w is None else apply_ste(grad_w, weight_mask).to(w_dtype), grad_b)


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
        w_ref = dequantize_fp8(saved["weight_fp8"], saved["weight_scale"], weight_scheme)
    x_ref = saved.get("input")
    if "input_fp8" in saved:
        x_ref = dequantize_fp8(saved["input_fp8"], saved["input_scale"], activation_scheme)
    x_dtype, w_dtype, bias_dtype = dtypes
    return linear_vjp(grad_out, x_ref, w_ref, bias_dtype, x_dtype, w_dtype, needs,
                      input_mask=saved.get("input_clip_mask"), weight_mask=weight_mask)

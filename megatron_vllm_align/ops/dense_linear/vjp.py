"""The reused linear backward, the one implementation behind every linear module here (dense, FP8,
the output layer, the MoE and shared-expert linears).

For ``Y = X W^T + b`` with ``G = dL/dY`` [M, N], ``X_ref`` [M, K] and ``W_ref`` [N, K] (which
values these are is the module's gradient contract), :func:`linear_vjp` computes

* ``dX = STE_act(G @ W_ref)``, ``dW = STE_w(G^T @ X_ref)``, ``db = sum over tokens of G``;
* in fp32, each result cast once to its tensor's dtype; on CUDA with Transformer Engine
  importable, dX and dW come from TE's GEMMs (:mod:`.te_gemm`) instead;
* ``STE_act`` / ``STE_w``: an optional bool pass mask (``quant.ste.ste_pass_mask``) of X's / W's
  shape, ``None`` for the identity STE. A 0/1 mask commutes with rounding, so applying it
  before (fp32 path) or after (TE's dX) the cast gives the same bits.
"""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.dense_linear.te_gemm import te_available, te_linear_grads
from megatron_vllm_align.quant.ste import apply_ste


def linear_vjp(grad_out: torch.Tensor, x_ref: torch.Tensor | None, w_ref: torch.Tensor | None,
               bias_dtype: torch.dtype | None, x_dtype: torch.dtype, w_dtype: torch.dtype,
               needs: tuple[bool, bool, bool], input_mask: torch.Tensor | None = None,
               weight_mask: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """(dX, dW, db) of ``Y = X W^T + b`` for grad_out [M, N], x_ref [M, K], w_ref [N, K].

    ``needs`` = (dX, dW, db) wanted; unneeded operands may be None. ``input_mask`` [M, K] /
    ``weight_mask`` [N, K]: STE pass masks, None for identity. Results in ``x_dtype`` /
    ``w_dtype`` / ``bias_dtype`` (module docstring).
    """
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

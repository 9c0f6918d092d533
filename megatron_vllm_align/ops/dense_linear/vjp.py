"""The reused linear backward, the one implementation behind every linear module here (dense, FP8,
the output layer, the MoE and shared-expert linears).

For ``Y = X W^T + b`` with ``G = dL/dY`` [M, N], ``X_ref`` [M, K] and ``W_ref`` [N, K] (which
values these are is the module's gradient contract), :func:`linear_vjp` computes

* ``dX = STE_act(G @ W_ref)``, ``dW = STE_w(G^T @ X_ref)``, ``db = sum over tokens of G``;
* in fp32, each result cast once to its tensor's dtype; on CUDA with Transformer Engine
  importable, dX and dW come from TE's GEMMs (:mod:`.te_gemm`) instead;
* fp32 path: dW is computed and cast in near-equal blocks of its rows, each at most
  ``DW_BLOCK_BYTES`` of fp32 (one block whenever the whole fp32 dW fits), so a wide weight's dW (the
  output layer's [vocab, hidden]: 594 MiB at Qwen3-0.6B widths) never exists whole in fp32. The
  bits are the unblocked product's (measured with MKL on AVX2 at 1 and 2 threads, Qwen3-0.6B widths
  and ``tests/ops/dense_linear``; blocks of under 8 rows did differ there, and a block here holds
  at least half of ``DW_BLOCK_BYTES``: thousands of rows at hidden widths up to 4096);
* ``STE_act`` / ``STE_w``: an optional bool pass mask (``quant.ste.ste_pass_mask``) of X's / W's
  shape, ``None`` for the identity STE. A 0/1 mask commutes with rounding, so applying it
  before (fp32 path) or after (TE's dX) the cast gives the same bits.
"""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.dense_linear.te_gemm import te_available, te_linear_grads
from megatron_vllm_align.quant.ste import apply_ste

# Most bytes of fp32 dW one block holds (module docstring): 64 MiB.
DW_BLOCK_BYTES = 64 * 2**20


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
        grad_w = None if grad_w is None else apply_ste(grad_w, weight_mask).to(w_dtype)
    else:
        grad = grad_out.float()
        grad_x = grad @ w_ref.float() if need_dx else None
        grad_w = weight_grad_in_blocks(grad, x_ref.float(), weight_mask, w_dtype) if need_dw else None
    grad_b = grad_out.float().sum(dim=0).to(bias_dtype) if need_db else None
    return None if grad_x is None else apply_ste(grad_x, input_mask).to(x_dtype), grad_w, grad_b


def weight_grad_in_blocks(grad: torch.Tensor, x: torch.Tensor, weight_mask: torch.Tensor | None,
                          w_dtype: torch.dtype) -> torch.Tensor:
    """``STE_w(grad^T @ x)`` [N, K] in ``w_dtype`` for fp32 grad [M, N] and x [M, K]: the fp32 product
    and its cast one block of dW rows at a time (:func:`row_blocks`, module docstring)."""
    grad_w = torch.empty(grad.shape[1], x.shape[1], dtype=w_dtype, device=grad.device)
    for rows in row_blocks(grad.shape[1], x.shape[1] * x.element_size()):
        grad_w[rows] = apply_ste(grad[:, rows].t() @ x, None if weight_mask is None else weight_mask[rows])
    return grad_w


def row_blocks(rows: int, row_bytes: int) -> list[slice]:
    """``range(rows)`` as the fewest near-equal consecutive slices of at most ``DW_BLOCK_BYTES`` each
    at ``row_bytes`` bytes per row (a single row may exceed it): one slice when all rows fit."""
    count = min(rows, max(1, -(-rows * row_bytes // DW_BLOCK_BYTES)))
    bounds = [rows * i // count for i in range(count + 1)]
    return [slice(start, end) for start, end in zip(bounds, bounds[1:])]

"""The reused linear backward, the one implementation behind every linear module here (dense, FP8,
NVFP4, the output layer, the MoE router and the routed and shared experts' linears).

For ``Y = X W^T + b`` with ``G = dL/dY`` [M, N], ``X_ref`` [M, K] and ``W_ref`` [N, K] (which
values these are is the module's gradient contract), :func:`linear_vjp` computes
``dX = STE_act(G W_ref)``, ``dW = STE_w(G^T X_ref)``, ``db = sum over tokens of G`` as the training
library does (the unquantized linear's backward is reused as it is; the quantized linears reuse the
ordinary BF16 GEMM backward on their reference values):

* on CPU (and on CUDA without Transformer Engine) by the calls of Megatron-Core's local linear
  backward (``tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward``
  without gradient-accumulation fusion), on 2-D operands in G's dtype (the model dtype: references in
  another dtype, such as an FP8 linear's fp32 dequantized weight, are cast to it first):
  ``dX = G.matmul(W_ref)``, ``dW = G.contiguous().t().matmul(X_ref.contiguous())``,
  ``db = G.sum(dim=0)``. Each GEMM accumulates in fp32 inside the kernel and returns the model dtype,
  so for the same G, X_ref and W_ref, dX and dW are Megatron's bits (asserted at Qwen3-0.6B widths
  and on a [16384, 1024] output layer by ``tests/megatron/test_linear_backward_bitwise.py``), and no
  fp32 copy of an operand or of dW exists (the output layer's [vocab, hidden] dW is one model-dtype
  GEMM, as in Megatron);
* where torch's CPU bf16 GEMM is its reference kernel (no oneDNN bf16 on the CPU, e.g. AVX2), dX is
  computed by :func:`input_grad_matmul` in a cache-friendly arrangement of the same kernel that gives
  ``G.matmul(W_ref)``'s bits (its docstring says why);
* on CUDA with Transformer Engine importable, by TE's GEMMs (:mod:`.te_gemm`, TE's own ``Linear``
  backward; dW in fp32, cast once);
* results are then cast to the dtype each caller asks for (``x_dtype``, ``w_dtype``,
  ``bias_dtype``): an upcast of the model-dtype result is exact, so a caller that keeps dX in fp32
  for a later sum (the experts) or whose master weight is fp32 gets Megatron's values;
* ``STE_act`` / ``STE_w``: an optional bool pass mask (``quant.ste.ste_pass_mask``) of X's / W's
  shape, ``None`` for the identity STE, applied to the GEMM's result: a 0/1 mask commutes with
  rounding and with the casts, so the unmasked entries keep the library's bits.

:func:`backward_precision` ``"fp32"`` (the recipe's ``align.backward_precision``) replaces the GEMMs
by the fp32 closed form instead: operands cast to fp32, ``dX = G W_ref`` and ``dW = G^T X_ref`` in
fp32, one rounding to the caller's dtype. Not Megatron's bits; it exists for CPUs without bf16
matrix units (AVX2), where torch's bf16 GEMM is its reference kernel and the fp32 GEMM is much
faster; on CPUs with bf16 matrix units and on GPUs it is slower and allocates fp32 copies of the
operands and of dW (measured per ISA: docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import functools
import typing
from collections.abc import Iterator
from typing import Literal

import torch

from megatron_vllm_align.ops.dense_linear.te_gemm import te_available, te_linear_grads
from megatron_vllm_align.quant.ste import apply_ste


def linear_vjp(grad_out: torch.Tensor, x_ref: torch.Tensor | None, w_ref: torch.Tensor | None,
               bias_dtype: torch.dtype | None, x_dtype: torch.dtype, w_dtype: torch.dtype,
               needs: tuple[bool, bool, bool], input_mask: torch.Tensor | None = None,
               weight_mask: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """(dX, dW, db) of ``Y = X W^T + b`` for grad_out [M, N], x_ref [M, K], w_ref [N, K].

    ``needs`` = (dX, dW, db) wanted; unneeded operands may be None. The GEMMs run in grad_out's
    dtype (module docstring). ``input_mask`` [M, K] / ``weight_mask`` [N, K]: STE pass masks, None
    for identity. Results in ``x_dtype`` / ``w_dtype`` / ``bias_dtype``.
    """
    need_dx, need_dw, need_db = needs
    dtype = grad_out.dtype
    if _precision == "fp32":
        grad_fp32 = grad_out.float()
        grad_x = grad_fp32.matmul(w_ref.float()) if need_dx else None
        grad_w = grad_fp32.t().matmul(x_ref.float()) if need_dw else None
    elif te_available(grad_out.device):
        grad_x, grad_w = te_linear_grads(grad_out, x_ref, w_ref, need_dx, need_dw, x_dtype)
    else:
        grad_x = input_grad_matmul(grad_out, w_ref.to(dtype)) if need_dx else None
        grad_w = grad_out.contiguous().t().matmul(x_ref.to(dtype).contiguous()) if need_dw else None
    grad_b = grad_out.sum(dim=0).to(bias_dtype) if need_db else None
    grad_x = None if grad_x is None else apply_ste(grad_x, input_mask).to(x_dtype)
    grad_w = None if grad_w is None else apply_ste(grad_w, weight_mask).to(w_dtype)
    return grad_x, grad_w, grad_b


#: a value of :func:`backward_precision` (the recipe's ``align.backward_precision``)
BackwardPrecision = Literal["library", "fp32"]
BACKWARD_PRECISIONS: tuple[str, ...] = typing.get_args(BackwardPrecision)
_precision = "library"


def set_backward_precision(precision: str) -> str:
    """Make every linear VJP of this process run in ``precision`` (one of :data:`BACKWARD_PRECISIONS`,
    module docstring) from now on, like a ``torch.backends`` flag; returns the previous value.
    ValueError for another name."""
    global _precision
    if precision not in BACKWARD_PRECISIONS:
        raise ValueError(f"backward precision must be one of {list(BACKWARD_PRECISIONS)}, got {precision!r}")
    previous, _precision = _precision, precision
    return previous


def current_backward_precision() -> str:
    """The precision every linear VJP of this process runs in now (:func:`set_backward_precision`)."""
    return _precision


@contextlib.contextmanager
def backward_precision(precision: str) -> Iterator[None]:
    """:func:`set_backward_precision` for the backward passes run inside the block, restored after it."""
    previous = set_backward_precision(precision)
    try:
        yield
    finally:
        set_backward_precision(previous)


INPUT_GRAD_BLOCK = (16, 256)  # (rows of G, columns of W) per GEMM call of the reference-kernel arrangement


def input_grad_matmul(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_out.matmul(weight)`` for G [M, N] and W [N, K] (Megatron's dX GEMM), with its bits.

    Where :func:`reference_bf16_gemm` holds (bf16 on such a CPU) and M, K >= 2, the result is assembled
    from ``(W[:, c]^T G[r]^T)^T`` over blocks of about ``INPUT_GRAD_BLOCK`` rows r and columns c, each
    GEMM on contiguous copies. torch's reference GEMM kernel computes every output element as its own
    fp32 dot product over N (the same four partial sums in the same order, whichever operand is which;
    bf16 products are exact in fp32), so each element is the same; what changes is that the operand the
    kernel reads with a stride is the short G block instead of W. No block is one row or one column
    wide: torch sends such a product to its vectorised GEMV, whose sums are ordered differently
    (measured speed-ups: docs/megatron_facts.md). Transient memory: one [256, N] copy of W and one
    [N, 16] copy of G. Elsewhere (oneDNN, fp32, CUDA, a single row or column) it is
    ``grad_out.matmul(weight)``.
    """
    if (grad_out.dtype != torch.bfloat16 or grad_out.device.type != "cpu" or min(grad_out.shape[0], weight.shape[1]) < 2
            or not reference_bf16_gemm()):
        return grad_out.matmul(weight)
    return _blocked_transposed_matmul(grad_out, weight)


def _blocks(length: int, size: int) -> list[slice]:
    """``range(length)`` in slices of ``size``; a last slice of one element joins the one before."""
    starts = list(range(0, length, size))
    if len(starts) > 1 and length - starts[-1] == 1:
        starts.pop()
    return [slice(start, end) for start, end in zip(starts, [*starts[1:], length])]


def _blocked_transposed_matmul(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows, columns = INPUT_GRAD_BLOCK
    out = torch.empty(grad_out.shape[0], weight.shape[1], dtype=grad_out.dtype, device=grad_out.device)
    row_blocks = _blocks(grad_out.shape[0], rows)
    for c in _blocks(weight.shape[1], columns):
        weight_t = weight[:, c].t().contiguous()
        for r in row_blocks:
            out[r, c] = weight_t.matmul(grad_out[r].t().contiguous()).t()
    return out


@functools.cache
def reference_bf16_gemm() -> bool:
    """True where every CPU bf16 GEMM runs torch's reference kernel (oneDNN has no bf16 on this CPU)
    and the blocked arrangement gives ``matmul``'s bits on a probe (2, 17 and 33 rows, a dot length
    that is not a multiple of 4, one to three column blocks, trailing blocks of one row or column); a
    torch whose kernel changed fails the probe and gets ``matmul`` itself."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    for rows, columns in ((2, 5), (17, 257), (33, 600)):
        g = torch.randn(rows, 1023, generator=gen).bfloat16()
        w = (torch.randn(1023, columns, generator=gen) * 0.03).bfloat16()
        if not torch.equal(g.matmul(w), _blocked_transposed_matmul(g, w)):
            return False
    return True

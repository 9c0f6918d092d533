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
* on CUDA with Transformer Engine importable, by TE's GEMMs (:mod:`.te_gemm`, TE's own ``Linear``
  backward; dW in fp32, cast once);
* results are then cast to the dtype each caller asks for (``x_dtype``, ``w_dtype``,
  ``bias_dtype``): an upcast of the model-dtype result is exact, so a caller that keeps dX in fp32
  for a later sum (the experts) or whose master weight is fp32 gets Megatron's values;
* ``STE_act`` / ``STE_w``: an optional bool pass mask (``quant.ste.ste_pass_mask``) of X's / W's
  shape, ``None`` for the identity STE, applied to the GEMM's result: a 0/1 mask commutes with
  rounding and with the casts, so the unmasked entries keep the library's bits.

There is no fp32 option: the former fp32 closed form (operands cast to fp32, one rounding per result)
gave other bits than Megatron's and was slower on CPUs with bf16 matrix units (docs/benchmarks.md
has the measured step ratios per ISA).
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

    ``needs`` = (dX, dW, db) wanted; unneeded operands may be None. The GEMMs run in grad_out's
    dtype (module docstring). ``input_mask`` [M, K] / ``weight_mask`` [N, K]: STE pass masks, None
    for identity. Results in ``x_dtype`` / ``w_dtype`` / ``bias_dtype``.
    """
    need_dx, need_dw, need_db = needs
    dtype = grad_out.dtype
    if te_available(grad_out.device):
        grad_x, grad_w = te_linear_grads(grad_out, x_ref, w_ref, need_dx, need_dw, x_dtype)
    else:
        grad_x = grad_out.matmul(w_ref.to(dtype)) if need_dx else None
        grad_w = grad_out.contiguous().t().matmul(x_ref.to(dtype).contiguous()) if need_dw else None
    grad_b = grad_out.sum(dim=0).to(bias_dtype) if need_db else None
    grad_x = None if grad_x is None else apply_ste(grad_x, input_mask).to(x_dtype)
    grad_w = None if grad_w is None else apply_ste(grad_w, weight_mask).to(w_dtype)
    return grad_x, grad_w, grad_b

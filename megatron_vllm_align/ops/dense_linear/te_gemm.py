"""Transformer Engine GEMMs for the linear backward: the reused training backward on CUDA.

Import-guarded and selected only for CUDA tensors when ``transformer_engine`` imports. It is NOT
exercised by this project's tests: Transformer Engine cannot be installed on the CPU machines
nor on the lent GPU machine. It follows TE's own ``Linear`` backward: dgrad
``general_gemm(weight, dY, layout="NN")`` = dY @ W and wgrad ``general_gemm(x, dY, layout="NT")``
= dY^T @ x, operands in dY's dtype, fp32 accumulation in cuBLAS (``grad=True``).
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def _general_gemm() -> Callable[..., Any] | None:
    """TE's ``general_gemm`` with its workspace bound when this TE version takes one, or None."""
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm
    except ImportError:
        return None
    if "workspace" not in inspect.signature(general_gemm).parameters:
        return general_gemm
    from transformer_engine.pytorch.module.base import get_workspace
    return lambda a, b, **kw: general_gemm(a, b, get_workspace(), **kw)


def te_available(device: torch.device) -> bool:
    """Whether the TE backward is selected for tensors on ``device``."""
    return device.type == "cuda" and _general_gemm() is not None


def te_linear_grads(grad_out: torch.Tensor, x_ref: torch.Tensor, w_ref: torch.Tensor, need_dx: bool,
                    need_dw: bool, x_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dX [M, K] in ``x_dtype``, dW [N, K] fp32) by TE GEMMs; grad_out [M, N], x_ref [M, K], w_ref [N, K]."""
    gemm = _general_gemm()
    if gemm is None:
        raise RuntimeError("transformer_engine is not importable")
    dtype = grad_out.dtype
    grad_x = grad_w = None
    if need_dx:
        grad_x = gemm(w_ref.to(dtype).contiguous(), grad_out.contiguous(), layout="NN", grad=True,
                      out_dtype=x_dtype)[0]
    if need_dw:
        grad_w = gemm(x_ref.to(dtype).contiguous(), grad_out.contiguous(), layout="NT", grad=True,
                      out_dtype=torch.float32)[0]
    return grad_x, grad_w

"""Row-invariant linear layers: vLLM's linear ``apply`` on fixed tiles of rows.

A GEMM library may pick its blocking, and so the order of the K-reduction, from the row count M:
measured on oneDNN, a row's bits differ between M = 1, 2 and 33+ (docs/invariance.md). Running
every call as tiles of exactly :data:`~megatron_vllm_align.invariance.ROW_TILE` rows (the last
tile zero-padded, padding rows dropped) makes the kernel see one M only, so a row's output depends
on that row alone. Per-token FP8 activation quantization is row-wise and stays exact under tiling.

Wrapped methods (every linear, LM-head and MoE-gate path of the covered models and quantizations):
``UnquantizedLinearMethod``, ``UnquantizedEmbeddingMethod`` (the LM head's GEMM),
``Fp8PtpcOnlineLinearMethod`` (``quantization="fp8_per_channel"``) and
``CompressedTensorsLinearMethod`` (compressed-tensors W8A8 checkpoints).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_vllm_align.invariance import ROW_TILE, requested

_WRAPPED = "_mva_row_tiled"


def run_in_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     tile: int = ROW_TILE) -> torch.Tensor:
    """``fn`` applied to ``x [..., K]`` as calls on ``[tile, K]`` row blocks; returns ``[..., N]``.

    ``fn`` must map ``[tile, K] -> [tile, N]`` row by row. The last block is padded with zero rows,
    whose outputs are discarded. An empty ``x`` is passed through as one call."""
    if x.dim() < 1:
        raise ValueError(f"x must have a row dimension, got a scalar of shape {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 0:
        out = fn(rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    padding = (-count) % tile
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    outputs = [fn(rows[start:start + tile]) for start in range(0, rows.shape[0], tile)]
    out = torch.cat(outputs)[:count]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def row_tiled_apply(apply: Callable) -> Callable:
    """Wrap a vLLM quant method's ``apply(self, layer, x, bias=None)``: while invariance is
    requested, run it with :func:`run_in_row_tiles`; otherwise call it unchanged."""
    if getattr(apply, _WRAPPED, False):
        return apply

    @functools.wraps(apply)
    def tiled(self, layer, x, bias=None):
        if not requested():
            return apply(self, layer, x, bias)
        return run_in_row_tiles(lambda rows: apply(self, layer, rows, bias), x)

    setattr(tiled, _WRAPPED, True)
    return tiled


def linear_method_classes() -> list[type]:
    """The vLLM quant-method classes whose ``apply`` is tiled (module docstring)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod,
    )
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return [UnquantizedLinearMethod, UnquantizedEmbeddingMethod, Fp8PtpcOnlineLinearMethod,
            CompressedTensorsLinearMethod]


def install_row_tiles() -> None:
    """Wrap each class's ``apply`` in place (idempotent)."""
    for cls in linear_method_classes():
        cls.apply = row_tiled_apply(cls.apply)

"""Causal prefill attention exactly as the vLLM CPU engine computes it, and its native reference.

``vllm_prefill_attention`` runs the two ops vLLM's ``CPU_ATTN`` backend runs for a prefill step:
``cpu_attn_reshape_and_cache`` writes K/V into a paged cache, then ``cpu_attention_with_kv_cache``
attends every query token to its sequence's cached prefix. The decisions (ISA, KV splitting, supported
head sizes and dtypes) come from vLLM itself; what vLLM builds only inside a running engine (block
table and slot mapping of a fresh cache, the scheduler metadata, the cache's key/value views) is
re-created here. ``attention_native`` is the readable fp32 formula beside it. Layout: a packed
variable-length batch in vLLM's ``[num_tokens, num_heads, head_dim]``, sequence i at tokens
``[cu_seqlens[i], cu_seqlens[i+1])``, every token a prefill token. The engine's path, what is
re-created and how the bytes were checked:
docs/attention_facts.md#what-vllm_prefill_attention-calls-and-what-it-re-creates.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator, Sequence

import torch

from megatron_vllm_align import invariance
from megatron_vllm_align.invariance.attention import (
    ENGINE_BLOCK_SIZE,
    ENGINE_KV_CACHE_DTYPE,
    attend_on_fresh_cache,
    query_group,
)
from megatron_vllm_align.utils.amx import request_amx_permission


def seq_lens_from_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """Sequence lengths from cumulative offsets ``[0, l0, l0+l1, ...]`` (Megatron / flash-attn)."""
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least 2 offsets, got {offsets}")
    return tuple(int(b) - int(a) for a, b in zip(offsets[:-1], offsets[1:]))


def validate_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              seq_lens: Sequence[int] | torch.Tensor, scale: float
                              ) -> tuple[int, ...]:
    """Check q [T, Hq, D], k/v [T, Hkv, D] (one float dtype, Hq a multiple of Hkv), positive
    ``seq_lens`` summing to T and a finite ``scale`` > 0; return seq_lens as a tuple of ints.
    Raises ValueError / TypeError naming the offending tensor or field."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [num_tokens, num_heads, head_dim], "
                             f"got {getattr(t, 'shape', type(t))}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k/v have {k.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k/v head_dim {k.shape[2]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                       and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    if not lens or any(not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1
                       for n in lens):
        raise ValueError(f"seq_lens must be a non-empty list of positive ints, got {lens}")
    if sum(lens) != q.shape[0]:
        raise ValueError(f"seq_lens sum to {sum(lens)} but q/k/v hold {q.shape[0]} tokens")
    return tuple(int(n) for n in lens)


@contextlib.contextmanager
def _omp_threads(num_threads: int | None) -> Iterator[None]:
    """Run with ``num_threads`` OpenMP threads (None: leave torch's setting), then restore."""
    if num_threads is None:
        yield
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"omp_threads must be a positive int or None, got {num_threads!r}")
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def vllm_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           seq_lens: Sequence[int] | torch.Tensor, scale: float, *,
                           omp_threads: int | None = None) -> torch.Tensor:
    """Causal self-attention of a packed prefill batch through vLLM's CPU attention ops.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], one dtype
        from the backend's list (bf16, fp16, fp32), on CPU; head_dim one the backend serves.
        Query head h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).
    seq_lens: positive lengths summing to num_tokens (see ``seq_lens_from_cu_seqlens``).
    scale: softmax scale applied to q·k (usually head_dim ** -0.5).
    omp_threads: OpenMP threads for the ops (None: torch's current setting). The kernel's work
        split depends on it, and for long GQA sequences so do the output bytes (measured): use
        the engine's thread count to match its bytes.
    Returns the attention output [num_tokens, num_heads, head_dim] in q's dtype, byte-equal to
    the engine's for the same (q, k, v), batch, thread count and CPU (ISA, L2 size). With
    ``MVA_INVARIANT=1`` it runs the invariant engine's layout (requests of the probed query group, no KV
    split; :mod:`megatron_vllm_align.invariance.attention`): then each token's bytes equal the
    engine's for that token in any batch, prefill or decode.
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    lens = validate_attention_inputs(q, k, v, seq_lens, scale)
    if q.device.type != "cpu" or k.device.type != "cpu" or v.device.type != "cpu":
        raise ValueError(f"q, k, v must be on CPU for the vLLM CPU kernel, got {q.device}, "
                         f"{k.device}, {v.device}")
    if q.dtype not in CPUAttentionBackend.supported_dtypes:
        raise TypeError(f"q/k/v dtype {q.dtype} is not served by vLLM CPU_ATTN "
                        f"(supported: {CPUAttentionBackend.supported_dtypes})")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if head_dim not in CPUAttentionBackend.get_supported_head_sizes():
        raise ValueError(f"head_dim {head_dim} is not served by vLLM CPU_ATTN "
                         f"(supported: {CPUAttentionBackend.get_supported_head_sizes()})")

    isa = _get_attn_isa(q.dtype, ENGINE_BLOCK_SIZE, head_dim, ENGINE_KV_CACHE_DTYPE)
    if isa == "amx":
        request_amx_permission()
    with _omp_threads(omp_threads):
        group = query_group(isa, num_heads, num_kv_heads, head_dim, q.dtype) if invariance.requested() else None
        return attend_on_fresh_cache(q, k, v, lens, lens, scale, isa, group=group)


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     seq_lens: Sequence[int] | torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 reference: per sequence, softmax(Q·Kᵀ·scale + causal mask)·V with each KV head
    repeated for its ``num_heads // num_kv_heads`` query heads. Same inputs as
    ``vllm_prefill_attention`` (any head_dim, any float dtype, any device); returns fp32
    [num_tokens, num_heads, head_dim]. Plain differentiable torch ops."""
    lens = validate_attention_inputs(q, k, v, seq_lens, scale)
    group = q.shape[1] // k.shape[1]
    outputs = []
    start = 0
    for n in lens:
        qi = q[start:start + n].float().transpose(0, 1)                              # [H, n, D]
        ki = k[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qi @ ki.transpose(1, 2)) * scale                                  # [H, n, n]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        outputs.append((probs @ vi).transpose(0, 1))
        start += n
    return torch.cat(outputs)

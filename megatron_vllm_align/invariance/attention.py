"""Prefill/decode-invariant attention: every query token is its own request of vLLM's CPU kernel.

vLLM's CPU attention (``cpu_attention_with_kv_cache``) computes a request's queries in tiles and,
with ``VLLM_CPU_ATTN_SPLIT_KV`` (default on), splits a long KV range across threads when the batch
is small: measured, a decode query at position >= ~100 gets different bits alone than beside other
requests (docs/invariance.md). With invariance on, :func:`per_query_layout` rewrites the batch so
that every query token is a request with one query over its cached prefix (the decode form) and
the scheduler is built without KV splitting. A token then runs the same computation in a prefill,
a chunked prefill, over a prefix-cache hit or in decode, alone or in any batch.

The engine gets it by wrapping ``CPUAttentionMetadataBuilder.build``; the trainer's
:func:`~megatron_vllm_align.ops.attention.kernel.vllm_prefill_attention` calls the same layout.
"""
from __future__ import annotations

import functools

import torch

from megatron_vllm_align.invariance import InvarianceUnsupported, requested

_WRAPPED = "_mva_per_query"


def per_query_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewrite an attention batch of R requests and T query tokens into T one-query requests.

    query_start_loc: int32 [R + 1] query offsets; seq_lens: int32 [>= R] tokens in the KV cache per
    request, its queries being the last ones; block_table: int32 [>= R, max_blocks].
    Returns (query_start_loc [T + 1] = 0..T, seq_lens [T] = each token's position + 1,
    block_table [T, max_blocks] = its request's row), in the dtypes given.
    """
    num_reqs = query_start_loc.numel() - 1
    starts = query_start_loc.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    total = int(starts[-1])
    request = torch.repeat_interleave(torch.arange(num_reqs, device=query_start_loc.device), query_lens)
    offset = torch.arange(total, device=query_start_loc.device) - starts[:-1][request]
    context = seq_lens[:num_reqs].to(torch.int64) - query_lens
    token_seq_lens = (context[request] + offset + 1).to(seq_lens.dtype)
    token_starts = torch.arange(total + 1, dtype=query_start_loc.dtype, device=query_start_loc.device)
    return token_starts, token_seq_lens, block_table[:num_reqs][request].contiguous()


def per_query_build(build):
    """Wrap ``CPUAttentionMetadataBuilder.build``: with invariance requested, return the metadata in
    :func:`per_query_layout` with a scheduler built without KV splitting; refuse what it does not
    cover (encoder / cross attention, non-causal or dynamic masks, sliding windows)."""
    if getattr(build, _WRAPPED, False):
        return build

    @functools.wraps(build)
    def invariant_build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = build(self, common_prefix_len, common_attn_metadata, fast_build)
        if not requested():
            return metadata
        from vllm import _custom_ops as ops

        if self.is_cross_attention or self.is_encoder_only_attention or metadata.causal is not True \
                or metadata.dynamic_causal is not None:
            raise InvarianceUnsupported("MVA_INVARIANT=1 covers causal decoder self-attention only; this "
                                        "attention group is cross, encoder-only or non-causal")
        if self.window_size != -1:
            raise InvarianceUnsupported(f"MVA_INVARIANT=1 does not cover sliding-window attention "
                                        f"(window {self.window_size})")
        starts, lens, table = per_query_layout(metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = starts, lens, table
        metadata.max_query_len = 1
        metadata.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=lens, dtype=self.dtype, query_start_loc=starts, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=False, kv_cache_dtype=self.kv_cache_dtype)
        return metadata

    setattr(invariant_build, _WRAPPED, True)
    return invariant_build


def install_per_query_attention() -> None:
    """Wrap vLLM's CPU attention metadata builder (idempotent)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    CPUAttentionMetadataBuilder.build = per_query_build(CPUAttentionMetadataBuilder.build)

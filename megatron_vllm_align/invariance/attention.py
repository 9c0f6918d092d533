"""Prefill/decode-invariant attention: query groups of vLLM's CPU kernel, each over its cached prefix.

vLLM's CPU attention (``cpu_attention_with_kv_cache``) splits a request's KV range into tiles whose
length follows the work item's query tile and, with ``VLLM_CPU_ATTN_SPLIT_KV`` (default on), splits a
long KV range across threads when the batch is small; the online softmax's sums follow the tiles, so a
token's bits depend on its batch (docs/invariance.md). A work item of a few consecutive query tokens gets
the same KV tiles as a lone decode query; more get others (docs/invariance.md#query-groups-attention). With
invariance on, :func:`query_group_layout` rewrites the batch into requests of at most :func:`query_group`
query tokens, each over its cached prefix (a decode is a group of one), and the scheduler is built
without KV splitting. A token then runs the same computation in a prefill, a chunked prefill, over a
prefix-cache hit or in decode, alone or in any batch. The group size is measured by :func:`probe_query_group`,
not assumed: where the kernel's tiles change is a property of its ISA's C++ implementation.

The engine gets it by wrapping ``CPUAttentionMetadataBuilder.build``; the trainer's
:func:`~megatron_vllm_align.ops.attention.kernel.vllm_prefill_attention` runs the same layout through
:func:`attend_on_fresh_cache`.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_vllm_align.invariance import InvarianceUnsupported, requested

_WRAPPED = "_mva_query_groups"

# The CPU platform's default KV block size (CpuPlatform.check_and_update_config, used when the
# user gives none). Measured: 32, 64, 128 and 256 give the same output bytes.
ENGINE_BLOCK_SIZE = 128
# KV cache dtype "auto" = the model dtype (no fp8 KV cache), with unit k/v scales.
ENGINE_KV_CACHE_DTYPE = "auto"
# Query groups the probe tries, largest first; 1 (one request per query token) needs no probe.
GROUP_CANDIDATES = (64, 32, 16, 8, 4, 2)
# The probe's queries: the last PROBE_QUERIES tokens of one long sequence (two groups of the largest candidate).
PROBE_QUERIES = 2 * GROUP_CANDIDATES[0]


def fresh_cache_addresses(seq_lens: Sequence[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(block_table int32 [num_seqs, max_blocks], slot_mapping int64 [num_tokens], num_blocks)
    for an empty cache filled sequence by sequence, as the runner addresses a fresh prefill."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    first_block = [0]
    for count in blocks_per_seq[:-1]:
        first_block.append(first_block[-1] + count)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots = []
    for i, (n, first) in enumerate(zip(seq_lens, first_block)):
        block_table[i, :blocks_per_seq[i]] = torch.arange(first, first + blocks_per_seq[i])
        slots.append(first * block_size + torch.arange(n, dtype=torch.int64))
    return block_table, torch.cat(slots), sum(blocks_per_seq)


def query_group_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewrite an attention batch of R requests and T query tokens into requests of at most ``group``
    consecutive query tokens of one request, each over its cached prefix (``group`` 1: one per token).

    query_start_loc: int32 [R + 1] query offsets; seq_lens: int32 [>= R] tokens in the KV cache per
    request, its queries being the last ones; block_table: int32 [>= R, max_blocks].
    Returns (query_start_loc [G + 1], seq_lens [G] = each group's last position + 1,
    block_table [G, max_blocks] = its request's row), in the dtypes given.
    """
    num_reqs = query_start_loc.numel() - 1
    device = query_start_loc.device
    starts = query_start_loc.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    groups_per_request = (query_lens + group - 1) // group
    request = torch.repeat_interleave(torch.arange(num_reqs, device=device), groups_per_request)
    first_group = torch.cumsum(groups_per_request, 0) - groups_per_request
    offset = (torch.arange(request.numel(), device=device) - first_group[request]) * group
    size = torch.clamp(query_lens[request] - offset, max=group)
    context = seq_lens[:num_reqs].to(torch.int64) - query_lens
    group_starts = torch.zeros(request.numel() + 1, dtype=query_start_loc.dtype, device=device)
    torch.cumsum(size, 0, out=group_starts[1:])
    group_seq_lens = (context[request] + offset + size).to(seq_lens.dtype)
    return group_starts, group_seq_lens, block_table[:num_reqs][request].contiguous()


def attend_on_fresh_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: Sequence[int],
                          query_lens: Sequence[int], scale: float, isa: str, *, group: int | None) -> torch.Tensor:
    """vLLM's CPU attention of sequences written to a fresh, zeroed paged cache (blocks in order from 0).

    key, value: [sum(seq_lens), num_kv_heads, head_dim], the sequences' K/V; query: [sum(query_lens),
    num_heads, head_dim], the last ``query_lens[i]`` tokens of sequence i; causal, the kernel ``isa``.
    ``group`` None: the batch as given, the scheduler splitting KV as ``VLLM_CPU_ATTN_SPLIT_KV`` says (the
    default engine); else :func:`query_group_layout` with that group and no KV split (the invariant engine).
    Returns the output [sum(query_lens), num_heads, head_dim] in query's dtype, on torch's current threads."""
    from vllm import _custom_ops as ops
    from vllm import envs

    if (len(query_lens) != len(seq_lens) or any(not 0 < n <= total for n, total in zip(query_lens, seq_lens))
            or query.shape[0] != sum(query_lens) or key.shape[0] != sum(seq_lens) or value.shape != key.shape):
        raise ValueError(f"query [{query.shape[0]} tokens] / key, value [{key.shape[0]}, {value.shape[0]} tokens] do "
                         f"not match query_lens {list(query_lens)} within seq_lens {list(seq_lens)}")
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    block_table, slot_mapping, num_blocks = fresh_cache_addresses(seq_lens, ENGINE_BLOCK_SIZE)
    # Engine layout: [num_blocks, num_kv_heads, block_size, 2 * head_dim], zeroed on allocation;
    # within a block and head, block_size rows of K are followed by block_size rows of V.
    kv_cache = torch.zeros(num_blocks, num_kv_heads, ENGINE_BLOCK_SIZE, 2 * head_dim, dtype=key.dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * ENGINE_BLOCK_SIZE,
                                           head_dim).chunk(2, dim=2)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(list(query_lens), dtype=torch.int32), 0, out=query_start_loc[1:])
    kv_split = envs.VLLM_CPU_ATTN_SPLIT_KV
    if group is not None:
        query_start_loc, lens, block_table = query_group_layout(query_start_loc, lens, block_table, group)
        kv_split = False
    query = query.detach().contiguous()
    output = torch.empty_like(query)
    ops.cpu_attn_reshape_and_cache(key.detach().contiguous(), value.detach().contiguous(), key_cache, value_cache,
                                   slot_mapping, isa, kv_cache_dtype=ENGINE_KV_CACHE_DTYPE)
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.numel(), num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
        seq_lens=lens, dtype=query.dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=kv_split, kv_cache_dtype=ENGINE_KV_CACHE_DTYPE)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=lens, scale=float(scale), causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=scheduler_metadata,
        s_aux=None, kv_cache_dtype=ENGINE_KV_CACHE_DTYPE)
    return output


def l2_cache_bytes() -> int:
    """This CPU's L2 cache per core in bytes (Linux sysfs, cpu0), or 4 MiB where it is not readable."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2" and (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            break
    return 4 << 20


def probe_context(head_dim: int, dtype: torch.dtype) -> int:
    """The probe's sequence length: twice the KV tokens of the L2 cache, so that a query tile over the
    kernel's one-round limit (KV tile at most half the L2 over one token's K and V) meets several tiles."""
    tokens = 2 * l2_cache_bytes() // (head_dim * torch.finfo(dtype).bits // 8)
    return int(min(max(tokens, 1024), 1 << 16))


def probe_query_group(isa: str, heads_per_kv: int, head_dim: int, dtype: torch.dtype
                      ) -> tuple[int, dict[int, str]]:
    """The largest :data:`GROUP_CANDIDATES` group whose queries get the bits of one request per query token,
    and for each larger candidate what differed (1 when none holds).

    Measured on one sequence of :func:`probe_context` + 5 tokens with ``heads_per_kv`` query heads on one KV head
    (the kernel's tiling does not depend on the number of KV heads), fixed random inputs, its last
    :data:`PROBE_QUERIES` tokens as queries over the rest (a chunked prefill)."""
    length = probe_context(head_dim, dtype) + 5     # the first query at an odd position
    gen = torch.Generator().manual_seed(20261205)
    key, value = (torch.randn(length, 1, head_dim, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(PROBE_QUERIES, heads_per_kv, head_dim, generator=gen).to(dtype)

    def attend(group):
        return attend_on_fresh_cache(query, key, value, [length], [PROBE_QUERIES], head_dim ** -0.5, isa,
                                     group=group)

    reference = attend(1)
    failures = {}
    for group in GROUP_CANDIDATES:
        out = attend(group)
        if torch.equal(out, reference):
            return group, failures
        failures[group] = (f"{int((out != reference).any(dim=(1, 2)).sum())} of {PROBE_QUERIES} queries over "
                           f"{length} tokens differ")
    return 1, failures


_groups: dict[tuple, int] = {}


def query_group(isa: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The query group of the invariant layout for this attention shape on this kernel, probed once per
    process and (ISA, query heads per KV head, head_dim, dtype)."""
    key = (isa, num_heads // num_kv_heads, head_dim, dtype)
    if key not in _groups:
        with torch.no_grad():
            _groups[key] = probe_query_group(isa, num_heads // num_kv_heads, head_dim, dtype)[0]
    return _groups[key]


def measured_groups() -> dict[str, int]:
    """The query groups measured in this process: ``"<isa> <heads per KV head> x <head_dim> <dtype>"`` -> group."""
    return {f"{isa} {per_kv} x {head_dim} {str(dtype).removeprefix('torch.')}": group
            for (isa, per_kv, head_dim, dtype), group in _groups.items()}


def query_group_build(build):
    """Wrap ``CPUAttentionMetadataBuilder.build``: with invariance requested, return the metadata in
    :func:`query_group_layout` (the probed :func:`query_group`; 1 for a quantized KV cache) with a scheduler
    built without KV splitting; refuse what it does not cover (encoder / cross attention, non-causal or
    dynamic masks, sliding windows)."""
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
        group = (query_group(self.isa, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
                 if self.kv_cache_dtype == ENGINE_KV_CACHE_DTYPE else 1)
        starts, lens, table = query_group_layout(metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
                                                 group)
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = starts, lens, table
        metadata.max_query_len = min(group, metadata.max_query_len)
        metadata.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=lens, dtype=self.dtype, query_start_loc=starts, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=False, kv_cache_dtype=self.kv_cache_dtype)
        return metadata

    setattr(invariant_build, _WRAPPED, True)
    return invariant_build


def install_query_group_attention() -> None:
    """Wrap vLLM's CPU attention metadata builder (idempotent)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    CPUAttentionMetadataBuilder.build = query_group_build(CPUAttentionMetadataBuilder.build)

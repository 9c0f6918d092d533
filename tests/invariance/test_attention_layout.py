"""Query-group attention: requests of at most the probed query group, each over its cached prefix; a token's
bits do not depend on the batch, and equal those of one request per query token."""
import pytest
import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from megatron_vllm_align.invariance.attention import (
    ENGINE_BLOCK_SIZE,
    ENGINE_KV_CACHE_DTYPE,
    GROUP_CANDIDATES,
    attend_on_fresh_cache,
    probe_query_group,
    query_group,
    query_group_layout,
)
from megatron_vllm_align.megatron.cpu_report import cpu_isa
from megatron_vllm_align.ops.attention.kernel import vllm_prefill_attention

# Request 0: 2 cached tokens + 3 queries; request 1: a decode (1 query after 6 cached tokens); a padded row.
BATCH = (torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([5, 7, 99], dtype=torch.int32),
         torch.tensor([[4, 5], [8, 0], [9, 9]], dtype=torch.int32))


def test_one_query_per_request_layout_numbers():
    starts, lens, table = query_group_layout(*BATCH, group=1)
    assert starts.tolist() == [0, 1, 2, 3, 4] and starts.dtype == torch.int32
    assert lens.tolist() == [3, 4, 5, 7] and lens.dtype == torch.int32
    assert table.tolist() == [[4, 5], [4, 5], [4, 5], [8, 0]]


def test_query_group_layout_numbers():
    starts, lens, table = query_group_layout(*BATCH, group=2)
    assert starts.tolist() == [0, 2, 3, 4] and lens.tolist() == [4, 5, 7]
    assert table.tolist() == [[4, 5], [4, 5], [8, 0]]
    starts, lens, table = query_group_layout(*BATCH, group=8)     # a group larger than every request
    assert starts.tolist() == [0, 3, 4] and lens.tolist() == [5, 7] and table.tolist() == [[4, 5], [8, 0]]


def _isa(head_dim):
    return _get_attn_isa(torch.bfloat16, ENGINE_BLOCK_SIZE, head_dim, ENGINE_KV_CACHE_DTYPE)


def test_the_probe_finds_a_query_group_and_every_larger_one_differs():
    """The probe keeps the largest candidate group that matched and records how every larger one differed
    (printed with the ISA; measured on an AVX-512 BF16 EPYC's ``vec`` kernel: 8 tokens at 1, 2 and 7 query
    heads per KV head, head_dim 64 and 128, docs/invariance.md#query-groups-attention). The group's bits at
    real lengths, and the control, are the next test's."""
    for heads_per_kv, head_dim in ((1, 128), (2, 128), (2, 64), (7, 64)):
        isa = _isa(head_dim)
        group, failures = probe_query_group(isa, heads_per_kv, head_dim, torch.bfloat16)
        print(f"{cpu_isa().describe()}, attention ISA {isa}: {heads_per_kv} query heads per KV head x {head_dim}: "
              f"query group {group}; larger groups: {failures}")
        assert set(failures) == {g for g in GROUP_CANDIDATES if g > group}
        assert group in (1, *GROUP_CANDIDATES)


def _qkv(total, seed, heads=16, kv_heads=8, head_dim=128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, head_dim, generator=gen).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads)]


def test_a_token_gets_the_same_bits_alone_in_a_prefix_and_in_a_packed_batch(invariant):
    """Qwen3-0.6B attention shape (16 heads, 8 KV heads, head_dim 128), contexts up to 300 tokens,
    where the engine's default KV split makes a decode alone differ (docs/invariance.md)."""
    q, k, v = _qkv(300, seed=0)
    full = vllm_prefill_attention(q, k, v, [300], 128 ** -0.5)
    other_q, other_k, other_v = _qkv(57, seed=1)
    packed = vllm_prefill_attention(torch.cat([other_q, q]), torch.cat([other_k, k]), torch.cat([other_v, v]),
                                    [57, 300], 128 ** -0.5)
    assert torch.equal(packed[57:], full)
    for position in (0, 31, 99, 150, 299):
        prefix = vllm_prefill_attention(q[:position + 1], k[:position + 1], v[:position + 1], [position + 1],
                                        128 ** -0.5)
        assert torch.equal(prefix[-1], full[position]), f"position {position}"


@pytest.mark.parametrize("heads, kv_heads, head_dim, lengths", [(16, 8, 128, (2048,)), (4, 2, 64, (37, 3000))])
def test_long_prefills_get_the_bits_of_one_request_per_query_and_a_larger_group_differs(invariant, heads, kv_heads,
                                                                                           head_dim, lengths):
    """At lengths where the kernel's KV tiles matter (Qwen3-0.6B attention, 2048 tokens; 4/2 heads x 64, 3000):
    the probed group's prefill equals one request per query token bitwise, and twice the group (the control)
    does not."""
    q, k, v = _qkv(sum(lengths), seed=3, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    isa, group = _isa(head_dim), query_group(_isa(head_dim), heads, kv_heads, head_dim, torch.bfloat16)
    per_query = attend_on_fresh_cache(q, k, v, lengths, lengths, head_dim ** -0.5, isa, group=1)
    assert torch.equal(vllm_prefill_attention(q, k, v, lengths, head_dim ** -0.5), per_query)
    chunk = 501    # the last sequence's last 501 queries over its cached rest (a chunked prefill): the prefill's bits
    queries = torch.cat([q[:sum(lengths[:-1])], q[-chunk:]])
    chunked = attend_on_fresh_cache(queries, k, v, lengths, lengths[:-1] + (chunk,), head_dim ** -0.5, isa, group=group)
    assert torch.equal(chunked[-chunk:], per_query[-chunk:])
    with pytest.raises(ValueError, match="do not match query_lens"):
        attend_on_fresh_cache(queries[1:], k, v, lengths, lengths[:-1] + (chunk,), head_dim ** -0.5, isa, group=group)
    assert not torch.equal(attend_on_fresh_cache(q, k, v, lengths, lengths, head_dim ** -0.5, isa, group=2 * group),
                           per_query), f"a group of {2 * group} tokens gave the bits of one query per request"

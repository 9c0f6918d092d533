"""Per-query attention: every query token is its own request, and its bits do not depend on the batch."""
import torch

from megatron_vllm_align.invariance.attention import per_query_layout
from megatron_vllm_align.ops.attention.kernel import vllm_prefill_attention


def test_per_query_layout_numbers():
    # Request 0: 2 cached tokens + 3 queries; request 1: a decode (1 query after 6 cached tokens).
    starts, lens, table = per_query_layout(torch.tensor([0, 3, 4], dtype=torch.int32),
                                           torch.tensor([5, 7, 99], dtype=torch.int32),   # a padded row
                                           torch.tensor([[4, 5], [8, 0], [9, 9]], dtype=torch.int32))
    assert starts.tolist() == [0, 1, 2, 3, 4] and starts.dtype == torch.int32
    assert lens.tolist() == [3, 4, 5, 7] and lens.dtype == torch.int32
    assert table.tolist() == [[4, 5], [4, 5], [4, 5], [8, 0]]


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

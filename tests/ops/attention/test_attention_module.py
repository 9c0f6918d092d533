"""VllmCausalAttentionFunction and the Megatron adapter: visible forward, layer-1 backward
against an independent fp32 autograd reference, layouts, and refused configurations."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_vllm_align.ops.attention.kernel import vllm_prefill_attention
from megatron_vllm_align.ops.attention.module import VllmCausalAttentionFunction, VllmDotProductAttention
from megatron_vllm_align.ops.attention.reference import ReferenceAttention
from megatron_vllm_align.ops.attention.vjp import training_attention_vjp
from megatron_vllm_align.validation import compare_vjp, derive_tolerance

SHORT_LENS = [1, 7, 16, 17, 33]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
SCALE = HEAD_DIM ** -0.5


def _qkv(lens, dtype=torch.bfloat16, seed=0, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(lens), heads, HEAD_DIM, generator=gen).to(dtype).requires_grad_()
            for heads in (num_heads, num_kv_heads, num_kv_heads)]


class Candidate(nn.Module):
    def __init__(self, lens, scale=SCALE):
        super().__init__()
        self.lens, self.scale = lens, scale

    def forward(self, q, k, v):
        return VllmCausalAttentionFunction.apply(q, k, v, self.lens, self.scale)


def _tolerance(lens, dtype):
    """Derived in advance: gradients stored in ``dtype``, fp32 accumulation on both sides; the
    longest sum is over a sequence's tokens times the query heads sharing a KV head (dK, dV),
    or over head_dim (the rowsum(dO * O) term)."""
    return derive_tolerance(dtype, max(max(lens) * NUM_HEADS // NUM_KV_HEADS, HEAD_DIM))[0]


def test_forward_is_the_vllm_kernel_output():
    q, k, v = _qkv(SHORT_LENS)
    out = VllmCausalAttentionFunction.apply(q, k, v, SHORT_LENS, SCALE)
    assert out.requires_grad and out.dtype == torch.bfloat16
    assert torch.equal(out.detach(), vllm_prefill_attention(q, k, v, SHORT_LENS, SCALE))
    assert VllmCausalAttentionFunction.contract_name == "attention"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [SHORT_LENS, [300, 45]], ids=["short", "long"])
def test_backward_matches_independent_fp32_reference(lens, dtype):
    report = compare_vjp(Candidate(lens), ReferenceAttention(lens, SCALE), _qkv(lens, dtype),
                         tolerances=_tolerance(lens, dtype), name=f"attention {dtype}")
    assert report.passed, "\n".join(report.failures())
    kinds = {c.dy_kind for c in report.checks}
    assert kinds == {"random", "zero", "sparse", "along_output"} and len(report.checks) == 12


def test_backward_comparison_catches_a_wrong_scale():
    """Planted bug: a backward whose softmax scale is 1% off fails the fp32 tolerance."""
    report = compare_vjp(Candidate(SHORT_LENS, scale=SCALE * 1.01), ReferenceAttention(SHORT_LENS, SCALE),
                         _qkv(SHORT_LENS, torch.float32), dy_kinds=["random"],
                         tolerances=_tolerance(SHORT_LENS, torch.float32))
    assert not report.passed
    assert {c.item for c in report.checks if not c.passed} == {"input[0]", "input[1]", "input[2]"}


def test_batched_backward_equals_one_sequence_at_a_time():
    q, k, v = (t.detach() for t in _qkv(SHORT_LENS, torch.float32))
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    batched = training_attention_vjp(q, k, v, dy, tuple(SHORT_LENS), SCALE)
    starts = [0] + torch.tensor(SHORT_LENS).cumsum(0).tolist()
    pieces = [training_attention_vjp(q[a:b], k[a:b], v[a:b], dy[a:b], (b - a,), SCALE)
              for a, b in zip(starts[:-1], starts[1:])]
    for i in range(3):
        assert torch.equal(batched[i], torch.cat([p[i] for p in pieces]))


def _autograd_sdpa_grads(q, k, v, dy, lens, scale, is_causal=True):
    """(dq, dk, dv) of autograd through fp32 F.scaled_dot_product_attention, one call per sequence."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    outs, start = [], 0
    for n in lens:
        qi, ki, vi = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in leaves)
        outs.append(nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=is_causal, scale=scale,
                                                               enable_gqa=True).squeeze(0).transpose(0, 1))
        start += n
    grads = torch.autograd.grad(torch.cat(outs), leaves, dy.float())
    return [g.to(t.dtype) for g, t in zip(grads, (q, k, v))]


@pytest.mark.parametrize("omp_threads", [1, 2])
@pytest.mark.parametrize("lens", [[128, 128, 128, 128], [5, 17, 17, 64, 64, 64, 3]], ids=["equal", "runs"])
def test_backward_is_autograd_through_sdpa_bitwise(lens, omp_threads):
    """The direct flash-kernel calls (runs of equal lengths stacked) give autograd's bits through
    fp32 SDPA per sequence; control: the same autograd without the causal mask differs."""
    q, k, v = (t.detach() for t in _qkv(lens))
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(omp_threads)
    try:
        ours = training_attention_vjp(q, k, v, dy, tuple(lens), SCALE)
        expected = _autograd_sdpa_grads(q, k, v, dy, lens, SCALE)
        control = _autograd_sdpa_grads(q, k, v, dy, lens, SCALE, is_causal=False)
    finally:
        torch.set_num_threads(threads)
    for mine, theirs, wrong in zip(ours, expected, control):
        assert mine.dtype == theirs.dtype == torch.bfloat16
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))
        assert not torch.equal(mine, wrong)


def _megatron_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=NUM_HEADS * HEAD_DIM, num_attention_heads=NUM_HEADS,
                  num_query_groups=NUM_KV_HEADS, attention_dropout=0.0, hidden_dropout=0.0,
                  bf16=True, params_dtype=torch.bfloat16) | overrides
    return TransformerConfig(**fields)


def _adapter(**config_overrides):
    from megatron.core.transformer.enums import AttnMaskType

    return VllmDotProductAttention(_megatron_config(**config_overrides), layer_number=1,
                                   attn_mask_type=AttnMaskType.causal, attention_type="self")


def test_adapter_sbhd_layout_equals_the_function_per_batch_row():
    seq_len, batch = 19, 3
    q, k, v = _qkv([seq_len * batch])
    # [b*s, h, d] -> Megatron's [s, b, h, d]
    query, key, value = (t.detach().view(batch, seq_len, t.shape[1], HEAD_DIM).transpose(0, 1)
                         .requires_grad_() for t in (q, k, v))
    out = _adapter()(query, key, value, attention_mask=None)
    assert out.shape == (seq_len, batch, NUM_HEADS * HEAD_DIM)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    out.backward(dy)
    for b in range(batch):
        qb, kb, vb = (t.detach()[:, b].clone().requires_grad_() for t in (query, key, value))
        ref = VllmCausalAttentionFunction.apply(qb, kb, vb, [seq_len], SCALE)
        assert torch.equal(out[:, b].detach(), ref.detach().flatten(1))
        ref.backward(dy[:, b].view_as(ref))
        for mine, theirs in ((query, qb), (key, kb), (value, vb)):
            assert torch.equal(mine.grad[:, b], theirs.grad)


def test_adapter_accepts_the_causal_mask_and_refuses_others():
    seq_len = 8
    query, key, value = (t.detach().view(seq_len, 1, t.shape[1], HEAD_DIM) for t in _qkv([seq_len]))
    causal = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool).triu(1)
    adapter = _adapter()
    assert torch.equal(adapter(query, key, value, attention_mask=causal),
                       adapter(query, key, value, attention_mask=None))
    with pytest.raises(ValueError, match="causal mask"):
        adapter(query, key, value, attention_mask=torch.zeros_like(causal))


def test_adapter_packed_thd_equals_the_function():
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = _qkv(SHORT_LENS)
    cu = torch.tensor([0] + torch.tensor(SHORT_LENS).cumsum(0).tolist(), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(SHORT_LENS), max_seqlen_kv=max(SHORT_LENS))
    expected = vllm_prefill_attention(q, k, v, SHORT_LENS, SCALE).flatten(1)
    out = _adapter()(q, k, v, attention_mask=None, packed_seq_params=params)
    assert out.shape == (sum(SHORT_LENS), NUM_HEADS * HEAD_DIM)
    assert torch.equal(out.detach(), expected)
    out4 = _adapter()(*(t.unsqueeze(1) for t in (q, k, v)), None, packed_seq_params=params)
    assert torch.equal(out4.detach(), expected.unsqueeze(1))

    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu + torch.arange(len(cu), dtype=torch.int32))
    with pytest.raises(ValueError, match="padded"):
        _adapter()(q, k, v, None, packed_seq_params=padded)


@pytest.mark.parametrize("overrides,match", [
    (dict(attention_dropout=0.1), "dropout must be 0"),
    (dict(window_size=(16, 0)), "window_size"),
])
def test_adapter_refuses_what_the_vllm_forward_does_not_compute(overrides, match):
    with pytest.raises(ValueError, match=match):
        _adapter(**overrides)


def test_adapter_refuses_non_causal_mask_type():
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="attn_mask_type must be causal"):
        VllmDotProductAttention(_megatron_config(), 1, AttnMaskType.no_mask, "self")
    query = torch.zeros(4, 1, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    key = torch.zeros(4, 1, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="attn_mask_type must be causal"):
        _adapter()(query, key, key, None, attn_mask_type=AttnMaskType.padding)

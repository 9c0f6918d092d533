"""The engine's tensor-parallel shards computed by a TP = 1 trainer (megatron/engine_layout.py), kernel by
kernel against vLLM's own TP = 1 layers of the shards' shapes (what each engine rank runs), at Qwen3-0.6B
widths; why only T = 2 is emulated; refusals. End to end against a real TP = 2 engine:
tests/distributed/test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.megatron.engine_layout import (
    EngineShardedLinearKernel,
    EngineShardedLMHeadKernel,
    engine_shards,
)
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

HIDDEN, FFN, Q_WIDTH, KV_WIDTH = 1024, 3072, 2048, 1024  # Qwen3-0.6B: 16 heads, 8 KV heads of 128


def _loaded(context, weight, bias=None) -> VllmLinearKernel:
    kernel = VllmLinearKernel(context, weight.shape[1], weight.shape[0], bias is not None, False)
    kernel.load(weight, bias)
    return kernel


@pytest.fixture(scope="module")
def weights():
    generator = torch.Generator().manual_seed(0)
    return {name: (torch.randn(*shape, generator=generator) * 0.03).bfloat16()
            for name, shape in {"down": (HIDDEN, FFN), "gate_up": (2 * FFN, HIDDEN),
                                "qkv": (Q_WIDTH + 2 * KV_WIDTH, HIDDEN), "x_ffn": (37, FFN),
                                "x_hidden": (37, HIDDEN)}.items()}


def test_row_parallel_sum_is_the_engine_ranks_partials_added(bf16_context, weights):
    """Row mode: rank r's K slice through its own vLLM layer, the bf16 partials added; bitwise. One GEMM over
    the whole K (the trainer's own layout) differs: the emulation is what makes the bits the engine's."""
    w, x = weights["down"], weights["x_ffn"]
    sharded = EngineShardedLinearKernel(bf16_context, FFN, HIDDEN, False, False, mode="row", shards=2)
    sharded.load(w, None)
    half = FFN // 2
    ranks = [_loaded(bf16_context, w[:, r * half:(r + 1) * half].contiguous()) for r in range(2)]
    engine = ranks[0](x[:, :half].contiguous()) + ranks[1](x[:, half:].contiguous())
    assert torch.equal(sharded(x), engine)
    assert not torch.equal(_loaded(bf16_context, w)(x), engine)
    # planted: the engine's size misread as 4 shards
    four = EngineShardedLinearKernel(bf16_context, FFN, HIDDEN, False, False, mode="row", shards=4)
    four.load(w, None)
    assert not torch.equal(four(x), engine)
    # planted: the partial products kept in fp32 and rounded once after the sum (the wrong dtype)
    fp32_partials = sum(x[:, r * half:(r + 1) * half].float() @ w[:, r * half:(r + 1) * half].float().T
                        for r in range(2))
    assert not torch.equal(fp32_partials.bfloat16(), engine)


def test_two_partials_sum_the_same_in_any_order_and_accumulation_dtype(bf16_context, weights):
    """Why T = 2 is emulated exactly: the all-reduce of two bf16 partials is one rounding of a + b whatever the
    order or the accumulation dtype (fp32 holds a + b of two bf16 values exactly, or rounds below half a bf16
    ulp), so the engine's all-reduce implementation cannot matter; three partials already depend on the order."""
    w, x = weights["down"], weights["x_ffn"]
    half = FFN // 2
    a, b = (_loaded(bf16_context, w[:, r * half:(r + 1) * half].contiguous())(x[:, r * half:(r + 1) * half]
                                                                              .contiguous()) for r in range(2))
    assert torch.equal(a + b, b + a)
    assert torch.equal(a + b, (a.float() + b.float()).bfloat16())
    third = _loaded(bf16_context, w[:, :half].contiguous())(x[:, half:].contiguous())
    assert not torch.equal((a + b) + third, a + (b + third))


def test_column_parallel_blocks_come_back_in_the_master_order(bf16_context, weights):
    """Column mode with [q | k | v] and [gate | up] blocks: each rank's rows (its slice of every block) through
    its own vLLM layer, reassembled in the master's column order, equal the engine rank outputs placed there."""
    x = weights["x_hidden"]
    for name, segments in (("qkv", (Q_WIDTH, KV_WIDTH, KV_WIDTH)), ("gate_up", (FFN, FFN))):
        w = weights[name]
        bias = torch.linspace(-1, 1, w.shape[0]).bfloat16() if name == "qkv" else None
        sharded = EngineShardedLinearKernel(bf16_context, HIDDEN, w.shape[0], bias is not None, False,
                                            mode="column", shards=2, segments=segments)
        sharded.load(w, bias)
        expected = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        start_of = [sum(segments[:i]) for i in range(len(segments))]
        for rank in range(2):
            rows = torch.cat([torch.arange(s + rank * n // 2, s + (rank + 1) * n // 2)
                              for s, n in zip(start_of, segments)])
            expected[:, rows] = _loaded(bf16_context, w[rows], None if bias is None else bias[rows])(x)
        assert torch.equal(sharded(x), expected)


def test_lm_head_shards_are_the_engine_ranks_vocabulary_rows(bf16_context):
    vocab, hidden = 512, 256
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.05).bfloat16()
    x = torch.randn(9, hidden, generator=generator).bfloat16()
    sharded = EngineShardedLMHeadKernel(bf16_context, vocab, hidden, shards=2)
    sharded.load(weight)
    ranks = [VllmLMHeadKernel(bf16_context, vocab // 2, hidden) for _ in range(2)]
    for rank, kernel in enumerate(ranks):
        kernel.load(weight[rank * vocab // 2:(rank + 1) * vocab // 2])
    assert torch.equal(sharded(x), torch.cat([kernel(x) for kernel in ranks], dim=-1))
    fresh = sharded.fresh()
    assert fresh.kernels[0].lm_head is None and fresh.shards == 2


def test_layouts_not_emulated_are_refused_by_name(engine_model_dir, bf16_context):
    assert engine_shards(bf16_context, 1) == 1 and engine_shards(bf16_context, 2) == 1  # the trainer's own
    tp2 = vllm_context(EngineSpec(engine_model_dir, tensor_parallel_size=2))
    assert engine_shards(tp2, 1) == 2 and engine_shards(tp2, 2) == 1
    with pytest.raises(ValueError, match="TP=4 cannot compute the engine's TP=2 layout"):
        engine_shards(tp2, 4)
    with pytest.raises(ValueError, match="trainer at TP=1 cannot compute the engine's TP=4 layout"):
        engine_shards(vllm_context(EngineSpec(engine_model_dir, tensor_parallel_size=4)), 1)
    with pytest.raises(ValueError, match="quantized linear of a TP=2 engine is not emulated"):
        EngineShardedLinearKernel(bf16_context, 8, 8, False, True, mode="row", shards=2)
    with pytest.raises(ValueError, match="row-parallel bias"):
        EngineShardedLinearKernel(bf16_context, 8, 8, True, False, mode="row", shards=2)
    with pytest.raises(ValueError, match="not divisible by the engine's 2 shards"):
        EngineShardedLinearKernel(bf16_context, 8, 9, False, False, mode="column", shards=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        EngineSpec(engine_model_dir, tensor_parallel_size=0)

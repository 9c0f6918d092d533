"""Row tiles: vLLM's linear methods see one row count only, and a row's bits never depend on M.
(On this AVX2 machine torch's GEMM is row-invariant by itself, so the tile shapes are asserted
directly on the calls vLLM's layer makes, not only through the bits.)"""
import pytest
import torch

from megatron_vllm_align.invariance import ROW_TILE
from megatron_vllm_align.invariance.row_tiles import run_in_row_tiles
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel

# (K, N): Qwen3-0.6B's qkv (1024 -> 4096) and down (3072 -> 1024) projections, a small sgl-routed
# shape (256 -> 96) and a router gate (256 -> 8 experts).
SHAPES = [(1024, 4096), (3072, 1024), (256, 96), (256, 8)]
ROW_COUNTS = (1, 2, 3, 15, 16, 17, 33, 40)


def _weights(k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    return weight, torch.randn(n, generator=gen).to(torch.bfloat16)


def _record_gemm_rows(kernel):
    """Wrap the shadow layer's GEMM callable (vLLM's ``cpu_linear``, or the FP8 kernel's apply) and
    return the list its calls' row counts are appended to."""
    rows = []
    layer = kernel.layer
    if hasattr(layer, "cpu_linear"):
        inner = layer.cpu_linear
        layer.cpu_linear = lambda x, w, b: (rows.append(x.shape[0]), inner(x, w, b))[1]
    else:
        inner = layer.quant_method.fp8_linear.apply_weights
        layer.quant_method.fp8_linear.apply_weights = lambda lyr, x, *a, **kw: (rows.append(x.shape[0]),
                                                                                 inner(lyr, x, *a, **kw))[1]
    return rows


def test_run_in_row_tiles_is_the_function_on_fixed_blocks():
    x = torch.randn(2, 19, 5)
    seen = []
    out = run_in_row_tiles(lambda r: (seen.append(tuple(r.shape)), r.flip(-1) * 3)[1], x)
    assert torch.equal(out, x.flip(-1) * 3) and out.shape == (2, 19, 5)
    assert seen == [(ROW_TILE, 5)] * -(-38 // ROW_TILE)     # 38 rows in tiles, the last one padded
    assert run_in_row_tiles(lambda r: r[:, :2], torch.zeros(0, 4)).shape == (0, 2)


@pytest.mark.parametrize("k,n", SHAPES)
def test_every_gemm_call_is_one_tile_when_invariant(bf16_context, invariant, k, n):
    w, b = _weights(k, n, seed=k + n)
    kernel = VllmLinearKernel(bf16_context, k, n, True, quantized=False)
    kernel.load(w, b)
    rows = _record_gemm_rows(kernel)
    for m in ROW_COUNTS:
        kernel(torch.randn(m, k).to(torch.bfloat16))
    assert set(rows) == {ROW_TILE}
    assert len(rows) == sum(-(-m // ROW_TILE) for m in ROW_COUNTS)


def test_gemm_calls_are_untouched_when_off(bf16_context, invariant, not_invariant):
    w, b = _weights(256, 96, seed=1)
    kernel = VllmLinearKernel(bf16_context, 256, 96, True, quantized=False)
    kernel.load(w, b)
    rows = _record_gemm_rows(kernel)
    for m in ROW_COUNTS:
        kernel(torch.randn(m, 256).to(torch.bfloat16))
    assert rows == list(ROW_COUNTS)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("k,n", SHAPES[:3])
def test_a_row_gets_the_same_bits_in_any_batch(bf16_context, fp8_context, invariant, quantized, k, n):
    context = fp8_context if quantized else bf16_context
    w, b = _weights(k, n, seed=7 * k + n)
    kernel = VllmLinearKernel(context, k, n, True, quantized=quantized)
    kernel.load(w, b)
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(max(ROW_COUNTS), k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([kernel(rows[i:i + 1]) for i in range(rows.shape[0])])
    for m in ROW_COUNTS:
        neighbours = torch.randn(m, k, generator=gen).to(torch.bfloat16) * 4
        position = m // 2
        neighbours[position] = rows[m - 1]
        assert torch.equal(kernel(neighbours)[position], alone[m - 1]), f"row bits changed at M = {m}"


def test_fp8_gemm_calls_are_tiles(fp8_context, invariant):
    w, b = _weights(256, 96, seed=3)
    kernel = VllmLinearKernel(fp8_context, 256, 96, True, quantized=True)
    kernel.load(w, b)
    rows = _record_gemm_rows(kernel)
    kernel(torch.randn(21, 256).to(torch.bfloat16))
    assert rows == [ROW_TILE] * -(-21 // ROW_TILE)

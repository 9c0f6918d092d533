"""NVFP4 emulation: bitwise against vLLM's reference quantizer, grid membership, zeros, saturation, SQNR."""
import math

import pytest
import torch

from megatron_vllm_align.quant.nvfp4 import (
    E2M1_GRID,
    NVFP4Tensor,
    default_global_scale,
    dequantize_nvfp4,
    quantize_nvfp4,
)


def make_input(shape, dtype, seed=0):
    """Gaussian rows with magnitudes 1e-4 .. 1e2: small rows get zero block scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-4, 2, shape[0]).unsqueeze(1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (257, 320), (8, 4096)])
@pytest.mark.parametrize("given_scale", [False, True])
def test_matches_vllm_ref_nvfp4_bitwise(shape, dtype, given_scale):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
        ref_nvfp4_quant,
        ref_nvfp4_quant_dequant,
    )

    x = make_input(shape, dtype)
    gs = torch.tensor([37.5]) if given_scale else None
    t = quantize_nvfp4(x, gs)
    codes_ref, scales_ref = ref_nvfp4_quant(x, t.global_scale, 16)
    assert torch.equal(t.codes(), codes_ref)
    assert torch.equal(t.block_scales.float().view(torch.int32), scales_ref.view(torch.int32))
    assert torch.equal(break_fp4_bytes(t.packed, torch.float32), codes_ref)  # vLLM's nibble order
    assert torch.equal(dequantize_nvfp4(t, dtype), ref_nvfp4_quant_dequant(x, t.global_scale, 16))
    assert (t.block_scales.float() == 0).any() or shape[0] == 1 or given_scale


def test_layout_and_default_global_scale():
    x = make_input((6, 64), torch.bfloat16)
    t = quantize_nvfp4(x)
    assert t.packed.dtype == torch.uint8 and t.packed.shape == (6, 32)
    assert t.block_scales.dtype == torch.float8_e4m3fn and t.block_scales.shape == (6, 4)
    assert t.global_scale.dtype == torch.float32 and t.global_scale.shape == (1,)
    assert t.shape == x.shape
    assert torch.equal(default_global_scale(x), x.abs().amax().float().reshape(1).reciprocal() * 2688.0)
    assert t.block_scales.float().max() <= 448


@pytest.mark.parametrize("seed", [0, 1])
def test_every_value_lies_on_its_blocks_scaled_grid(seed):
    x = make_input((33, 256), torch.float32, seed)
    t = quantize_nvfp4(x)
    deq = dequantize_nvfp4(t).reshape(33, 16, 16)
    unit = (t.block_scales.float() / t.global_scale).unsqueeze(-1)  # [33, 16, 1]
    grid = torch.tensor(E2M1_GRID)
    candidates = torch.cat([grid, -grid]) * unit  # [33, 16, 16] per block, same fp32 product
    on_grid = (deq.unsqueeze(-1) == candidates.unsqueeze(-2)).any(-1)
    assert on_grid.all()


def test_round_to_nearest_even_on_the_e2m1_grid():
    """Global scale 1 and a block whose amax is 6 give block scale 1: codes are x rounded directly."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    inside = [0.26, 0.74, 1.3, 2.9]
    x = torch.tensor([ties + [-v for v in ties[:4]] + inside])
    t = quantize_nvfp4(x, torch.tensor([1.0]))
    assert t.block_scales.float().tolist() == [[1.0]]
    assert t.codes().tolist() == [expected + [-v for v in expected[:4]] + [0.5, 0.5, 1.5, 3.0]]


def test_zero_blocks_and_all_zero_tensor():
    x = torch.randn(2, 48)
    x[0, 16:32] = 0.0
    t = quantize_nvfp4(x)
    assert t.block_scales[0, 1].float() == 0 and (t.packed[0, 8:16] == 0).all()
    assert (dequantize_nvfp4(t)[0, 16:32] == 0).all()
    zero = quantize_nvfp4(torch.zeros(3, 32))
    deq = dequantize_nvfp4(zero)
    assert torch.isfinite(zero.global_scale).all() and torch.equal(deq, torch.zeros(3, 32))
    assert (zero.packed == 0).all()  # +0, never the -0 code


def test_saturation_when_block_scale_clamps_at_448():
    """A global scale far below 2688/amax pushes the block scale past 448: it clamps, and the scaled
    values (up to 1000 * 10 / 448 = 22.3) saturate at the largest code 6."""
    x = torch.linspace(-1000, 1000, 32).reshape(1, 32)
    gs = torch.tensor([10.0])
    t = quantize_nvfp4(x, gs)
    assert (t.block_scales.float() == 448).all()
    codes = t.codes()
    assert codes.abs().max() == 6 and codes[0, 0] == -6 and codes[0, -1] == 6
    assert dequantize_nvfp4(t).abs().max() == 6 * (torch.tensor(448.0) / gs)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(64, 1024), (257, 4096), (4096, 64)])
def test_sqnr_on_gaussian_data_within_derived_bound(shape, seed):
    """Expected SQNR, from the format. A block of 16 N(0,1) values has E[amax] ~= 2.08, mapped to 6,
    so v = 6x/amax ~= 2.885x. E2M1 spacing is 0.5 for |v| < 2, 1 for 2..4, 2 for 4..6, i.e.
    |x| < 0.693 (P = 0.512), 0.693..1.387 (P = 0.323), above (P = 0.165). Uniform rounding noise
    D^2/12 gives E[noise] = 0.512*0.25/12 + 0.323*1/12 + 0.165*4/12 = 0.0926 in v units against
    E[v^2] = 2.885^2 = 8.32: SQNR ~= 10*log10(8.32/0.0926) = 19.5 dB. The e4m3 block scale moves
    the step by at most 6.25% (+-0.5 dB) and the block max itself lands near 6 with little error,
    so the true value sits a little above the model. Bound: model - 2 dB <= SQNR <= model + 3 dB;
    a missing rounding would give far more, a coarser grid (integers) far less."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    deq = dequantize_nvfp4(quantize_nvfp4(x))
    sqnr_db = 10 * math.log10(float(x.pow(2).sum() / (x - deq).pow(2).sum()))
    print(f"NVFP4 SQNR {shape} seed {seed}: {sqnr_db:.2f} dB")
    assert 17.5 <= sqnr_db <= 22.5


def test_bad_input_is_refused_with_named_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="x must be one of"):
        quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="global_scale must be a float32"):
        quantize_nvfp4(torch.randn(4, 16), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="global_scale must have one element"):
        quantize_nvfp4(torch.randn(4, 16), torch.ones(2))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_nvfp4([1.0] * 16)
    assert isinstance(quantize_nvfp4(torch.randn(2, 3, 32)), NVFP4Tensor)

"""FP8 quantize/dequantize: bitwise against vLLM's own CPU-runnable quantizers, rounding, errors."""
import pytest
import torch

from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8, expand_scale, quantize_fp8

SHAPES = [(1, 64), (257, 300), (33, 1000), (130, 257)]
DTYPES = [torch.bfloat16, torch.float32]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (fp32 compared as int32, 1-byte dtypes as uint8)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def make_input(shape, dtype, seed=0):
    """Gaussian rows with magnitudes from 1e-6 to 1e3 (tiny rows hit the minimum-scale clamp), and a
    first tile scaled to ~1e-7 (hits the block quantizer's amax clamp)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    x = torch.randn(shape, generator=gen) * torch.logspace(-6, 3, rows).unsqueeze(1)
    x[:128, :128] *= 1e-7
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_matches_vllm_quantfp8_bitwise(vllm_config, shape, dtype):
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = make_input(shape, dtype)
    cases = [("per_token", GroupShape.PER_TOKEN), ("per_tensor", GroupShape.PER_TENSOR),
             ("per_token_group", GroupShape(1, 128))]
    for granularity, group_shape in cases:
        q_ref, s_ref = QuantFP8(static=False, group_shape=group_shape).forward_native(x)
        q, s = quantize_fp8(x, FP8Scheme(granularity))
        assert same_bits(q, q_ref), granularity
        assert same_bits(s, s_ref), granularity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_weight_quantizers_match_vllm_bitwise(shape, dtype):
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_channel_scale, _fp8_quant_per_channel
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = make_input(shape, dtype, seed=1)
    s_ref = _fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
    q_ref = _fp8_quant_per_channel(w, s_ref)
    q, s = quantize_fp8(w, FP8Scheme("per_channel"))
    assert same_bits(q, q_ref) and same_bits(s, s_ref)

    q_ref, s_ref = per_block_cast_to_fp8.__wrapped__(w, [128, 128])  # eager body of vLLM's compiled fn
    q, s = quantize_fp8(w, FP8Scheme("block"))
    assert same_bits(q, q_ref) and same_bits(s, s_ref)


def test_block_matches_vllm_compiled_per_block_cast(vllm_config):
    """vLLM runs per_block_cast_to_fp8 under torch.compile (inductor on CPU, ~10 s to compile)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = make_input((130, 257), torch.bfloat16, seed=2)
    q_ref, s_ref = per_block_cast_to_fp8(w, [128, 128])
    q, s = quantize_fp8(w, FP8Scheme("block"))
    assert same_bits(q, q_ref) and same_bits(s, s_ref)


@pytest.mark.parametrize("granularity, group_shape_name",
                         [("per_tensor", "PER_TENSOR"), ("per_channel", "PER_CHANNEL")])
def test_static_matches_vllm_quantfp8_bitwise(vllm_config, granularity, group_shape_name):
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = make_input((257, 300), torch.bfloat16)
    scheme = FP8Scheme(granularity, static=True)
    scale = torch.rand(scheme.scale_shape(tuple(x.shape)), generator=torch.Generator().manual_seed(3)) + 0.01
    q_ref, _ = QuantFP8(static=True, group_shape=getattr(GroupShape, group_shape_name)).forward_native(x, scale)
    q, s = quantize_fp8(x, scheme, scale)
    assert same_bits(q, q_ref)
    assert s is scale
    assert (q.float().abs() == 448).any(), "a static scale this small must saturate somewhere"


def test_min_scale_and_block_amax_clamps_are_exercised():
    x = make_input((257, 300), torch.float32)
    _, s_tok = quantize_fp8(x, FP8Scheme("per_token"))
    assert (s_tok == torch.tensor(1.0 / (448 * 512))).any()
    _, s_blk = quantize_fp8(x, FP8Scheme("block"))
    assert s_blk[0, 0] == torch.tensor(1e-4) / torch.tensor(448.0)


def test_division_and_reciprocal_rules_differ_and_each_matches_vllm(vllm_config):
    """per_token multiplies by 1/scale, per_channel divides: on fp8 midpoints the bytes differ.
    Rows [amax, m*s, -m*s] with s = amax/448 and m = 1.0625, the midpoint of 1.0 and 1.125."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_channel_scale, _fp8_quant_per_channel
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax

    amax = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 3 + 0.5
    step = amax / torch.tensor(448.0)
    x = torch.stack([amax, 1.0625 * step, -1.0625 * step], dim=1)
    q_tok, _ = quantize_fp8(x, FP8Scheme("per_token"))
    q_chan, _ = quantize_fp8(x, FP8Scheme("per_channel"))
    differs = (q_tok.view(torch.uint8) != q_chan.view(torch.uint8)).any(dim=1)
    print(f"rows where reciprocal-multiply and division round differently: {int(differs.sum())} / 4096")
    assert differs.sum() > 0
    assert same_bits(q_tok, QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x)[0])
    s_ref = _fp8_channel_scale(weight_amax(x, dim=-1, keepdim=True))
    assert same_bits(q_chan, _fp8_quant_per_channel(x, s_ref))


@pytest.mark.parametrize("dtype, values, expected", [
    # e4m3fn: step 1/8 in [1, 2): 1.0625 ties to 1.0 (even), 1.1875 ties to 1.25 (even); clamp at 448.
    (torch.float8_e4m3fn, [1.0625, 1.1875, -1.0625, 0.0, 448.0, 500.0, -1e6],
     [1.0, 1.25, -1.0, 0.0, 448.0, 448.0, -448.0]),
    # e5m2: step 1/4 in [1, 2): 1.125 ties to 1.0, 1.375 ties to 1.5; clamp at 57344.
    (torch.float8_e5m2, [1.125, 1.375, -1.375, 0.0, 57344.0, 60000.0, -1e9],
     [1.0, 1.5, -1.5, 0.0, 57344.0, 57344.0, -57344.0]),
])
def test_round_to_nearest_even_and_saturation(dtype, values, expected):
    scheme = FP8Scheme("per_tensor", dtype=dtype, static=True)
    q, _ = quantize_fp8(torch.tensor([values]), scheme, torch.tensor([1.0]))
    assert q.dtype == dtype
    assert q.float().tolist() == [expected]


@pytest.mark.parametrize("fp8_dtype, rel, sub",
                         [(torch.float8_e4m3fn, 2.0**-4, 2.0**-10), (torch.float8_e5m2, 2.0**-3, 2.0**-17)])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_token", "per_channel", "per_token_group", "block"])
def test_roundtrip_error_within_half_step(granularity, fp8_dtype, rel, sub):
    """|x - deq| <= half a grid step: rel*|x| in the normal range, sub*scale (half the smallest
    subnormal) near zero."""
    x = make_input((130, 257), torch.float32, seed=4)
    scheme = FP8Scheme(granularity, dtype=fp8_dtype)
    q, s = quantize_fp8(x, scheme)
    deq = dequantize_fp8(q, s, scheme)
    full = expand_scale(s, scheme, tuple(x.shape))
    assert torch.equal(deq, q.float() * full)
    bound = rel * x.abs() + sub * full
    assert ((x - deq).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("granularity, expected", [
    ("per_tensor", (1,)), ("per_token", (130, 1)), ("per_channel", (130, 1)),
    ("per_token_group", (130, 3)), ("block", (2, 3)),
])
def test_scale_shapes(granularity, expected):
    x = torch.randn(130, 257)
    q, s = quantize_fp8(x, FP8Scheme(granularity))
    assert q.shape == x.shape and s.dtype == torch.float32 and tuple(s.shape) == expected
    assert FP8Scheme(granularity).scale_shape((130, 257)) == expected


def test_bad_input_is_refused_with_named_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="granularity"):
        FP8Scheme("per_row")
    with pytest.raises(ValueError, match="dtype"):
        FP8Scheme("per_token", dtype=torch.int8)
    with pytest.raises(ValueError, match="block_shape"):
        FP8Scheme("per_token", block_shape=(1, 128))
    with pytest.raises(ValueError, match="block_shape"):
        FP8Scheme("per_token_group", block_shape=(2, 128))
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_fp8(torch.randn(2, 3, 4), FP8Scheme("per_token"))
    with pytest.raises(ValueError, match="x must be one of"):
        quantize_fp8(torch.ones(4, 8, dtype=torch.int32), FP8Scheme("per_token"))
    with pytest.raises(ValueError, match="scale is required"):
        quantize_fp8(x, FP8Scheme("per_tensor", static=True))
    with pytest.raises(ValueError, match="scale must be None"):
        quantize_fp8(x, FP8Scheme("per_tensor"), torch.ones(1))
    with pytest.raises(ValueError, match="scale must have shape"):
        quantize_fp8(x, FP8Scheme("per_channel", static=True), torch.ones(1))
    with pytest.raises(ValueError, match="scale must be float32"):
        quantize_fp8(x, FP8Scheme("per_tensor", static=True), torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="q must be"):
        dequantize_fp8(x, torch.ones(1), FP8Scheme("per_tensor"))

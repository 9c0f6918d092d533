"""FP8 linear: forward = vLLM's CPU W8A8 path bitwise; backward = an independent autograd reference
under both dX conventions; saved state, parameters and refused input."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_vllm_align.contracts import STE
from megatron_vllm_align.ops.fp8_linear.emulated import (
    FP8Linear,
    FP8LinearConfig,
    default_fp8_linear_config,
    fp8_linear,
)
from megatron_vllm_align.quant import DequantFP8Gemm, FP8Scheme, dequantize_fp8, quantize_fp8, vllm_fp8_scaled_mm

K, N = 300, 96  # K not a multiple of 128 on purpose
U32 = 2.0**-24


class _StraightBridge(torch.autograd.Function):
    """Reference STE, written independently of ``ste.py``: the value of ``value``, gradient
    (times an optional 0/1 mask) straight to ``source``."""

    @staticmethod
    def forward(ctx, source, value, mask):
        ctx.mask = mask
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.mask is None else grad * ctx.mask), None, None


def reference_grads(x2d, weight, bias, grad_out, config, act_mask=None, w_mask=None):
    """dX, dW, db from plain torch autograd on fp32 copies (never calls FP8LinearFunction). The
    dequantized references are materialised in the model dtype (one rounding each, as the FP8
    contracts' ``backward.cast`` states: the backward is the ordinary BF16 GEMM one on them), then
    lifted to fp32 exactly, so the derived bound below is unchanged."""
    x32 = x2d.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    b32 = None if bias is None else bias.detach().float().requires_grad_()
    x_q, x_s = quantize_fp8(x2d.detach(), config.activation_scheme, config.activation_scale)
    w_q, w_s = quantize_fp8(weight.detach(), config.weight_scheme, config.weight_scale)
    x_dq = dequantize_fp8(x_q, x_s, config.activation_scheme).to(x2d.dtype).float()
    w_dq = dequantize_fp8(w_q, w_s, config.weight_scheme).to(x2d.dtype).float()
    g32 = grad_out.float()

    w_for_dx = w_dq if config.dx_weight == "dequantized" else w32.detach()
    (dx,) = torch.autograd.grad(F.linear(_StraightBridge.apply(x32, x_dq, act_mask), w_for_dx), x32, g32)
    x_for_dw = x_dq if config.dw_activation == "dequantized" else x32.detach()
    (dw,) = torch.autograd.grad(F.linear(x_for_dw, _StraightBridge.apply(w32, w_dq, w_mask)), w32, g32)
    db = None if b32 is None else torch.autograd.grad(F.linear(x_dq, w_dq, b32), b32, g32)[0]
    return (dx.to(x2d.dtype), dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
            dict(w_ref=w_for_dx, x_ref=x_for_dw))


def assert_within_derived_bound(name, got, ref, lhs, rhs, reduction_length, dtype):
    """Tolerance fixed in advance: two fp32 summation orders of L products each differ from the exact
    sum by <= L*u32*sum|terms| (so <= 2*L*u32*(|lhs|@|rhs|) apart); a final cast to bf16 can then
    move each side by half an ulp (<= 2^-8 |value|, so 2^-7 |ref| together). Prints the measured error."""
    exact_slack = 2 * reduction_length * U32 * (lhs.abs() @ rhs.abs())
    cast_slack = 2.0**-7 * ref.float().abs() if dtype == torch.bfloat16 else torch.zeros_like(exact_slack)
    err = (got.float() - ref.float()).abs()
    print(f"{name}: max|err| = {err.max().item():.3e}, max err/bound = "
          f"{(err / (exact_slack + cast_slack + 1e-30)).max().item():.3e}")
    assert (err <= exact_slack + cast_slack).all(), name


def make_case(m, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = FP8Linear(K, N, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(N, K, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(N, generator=gen))
    x = (torch.randn(m, K, generator=gen) * 2).to(dtype).requires_grad_()
    grad_out = torch.randn(m, N, generator=gen).to(dtype)
    return layer, x, grad_out


def test_vllm_selects_the_channelwise_kernel_on_this_cpu(vllm_config):
    """The default visible GEMM is the kernel vLLM itself picks here for per-token activations."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
        kFp8StaticTensorSym,
    )

    if ops.cpu_has_amx_fp8():
        pytest.skip("AMX-FP8 CPU: vLLM selects CPUFP8W8A8ScaledMMLinearKernel, not the default here")
    for weight_key in (kFp8StaticChannelSym, kFp8StaticTensorSym):
        kernel = init_fp8_linear_kernel(activation_quant_key=kFp8DynamicTokenSym, weight_quant_key=weight_key,
                                        input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(N, K))
        assert type(kernel).__name__ == "ChannelWiseTorchFP8ScaledMMLinearKernel"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 257])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_vllm_w8a8_path_bitwise(vllm_config, m, dtype, bias):
    """vLLM end to end: its PTPC weight quantizer, its kernel's apply_weights (QuantFP8 per-token
    activation quantization + torch._scaled_mm + fp32 dequant epilogue)."""
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_channel_scale, _fp8_quant_per_channel
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
        weight_amax,
    )

    layer, x, _ = make_case(m, dtype, bias)
    shadow = torch.nn.Module()
    w_scale = _fp8_channel_scale(weight_amax(layer.weight.detach(), dim=-1, keepdim=True))
    shadow.weight = _fp8_quant_per_channel(layer.weight.detach(), w_scale).t()
    shadow.weight_scale = w_scale
    kernel = init_fp8_linear_kernel(activation_quant_key=kFp8DynamicTokenSym, weight_quant_key=kFp8StaticChannelSym,
                                    input_dtype=dtype, out_dtype=dtype, weight_shape=(N, K))
    x3 = x.detach().reshape(1, m, K)
    expected = kernel.apply_weights(shadow, x3, None if layer.bias is None else layer.bias.detach())
    got = layer(x3)
    assert got.dtype == dtype and got.shape == (1, m, N)
    assert torch.equal(got, expected)


def test_native_reference_gemm_is_close_to_vllm_but_not_bitwise():
    layer, x, _ = make_case(257, torch.float32, True)
    native = FP8Linear(K, N, config=dataclasses.replace(
        layer.config, visible_gemm=DequantFP8Gemm(layer.activation_scheme, layer.weight_scheme)))
    native.load_state_dict(layer.state_dict())
    got, ref = layer(x), native(x)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"vLLM channelwise vs native dequant GEMM, fp32: max |diff| / max |ref| = {rel:.3e}")
    assert 0 < rel < 1e-5


@pytest.mark.parametrize("dx_weight", ["dequantized", "master"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 257])
@pytest.mark.parametrize("bias", [True, False])
def test_backward_matches_independent_reference(dx_weight, dtype, m, bias):
    layer, x, grad_out = make_case(m, dtype, bias, seed=1)
    layer.config = default_fp8_linear_config(dx_weight=dx_weight)
    layer(x).backward(grad_out)
    dx, dw, db, refs = reference_grads(x, layer.weight, layer.bias, grad_out, layer.config)
    g32 = grad_out.float()
    assert_within_derived_bound("dX", x.grad, dx, g32, refs["w_ref"], N, dtype)
    assert_within_derived_bound("dW", layer.weight.grad, dw, g32.t(), refs["x_ref"], m, dtype)
    if bias:
        assert_within_derived_bound("db", layer.bias.grad, db, g32.t(), torch.ones(m), m, dtype)
    else:
        assert layer.bias is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conventions_give_different_dx_and_the_same_dw(dtype):
    grads = {}
    for dx_weight in ("dequantized", "master"):
        layer, x, grad_out = make_case(257, dtype, True, seed=2)
        layer.config = default_fp8_linear_config(dx_weight=dx_weight)
        assert layer.dx_weight == dx_weight
        layer(x).backward(grad_out)
        grads[dx_weight] = (x.grad.float(), layer.weight.grad, layer.bias.grad)
    dx_deq, dx_master = grads["dequantized"][0], grads["master"][0]
    rel_l2 = ((dx_deq - dx_master).norm() / dx_master.norm()).item()
    cosine = F.cosine_similarity(dx_deq.flatten(), dx_master.flatten(), dim=0).item()
    print(f"{dtype}: dX dequantized vs master: relative L2 = {rel_l2:.4f}, cosine = {cosine:.5f}")
    assert rel_l2 > 1e-2, "e4m3 weight rounding (~3% RMS) must show in dX, above bf16 noise (~4e-3)"
    assert cosine > 0.99
    assert torch.equal(grads["dequantized"][1], grads["master"][1])
    assert torch.equal(grads["dequantized"][2], grads["master"][2])


def clipped_config(base, act_scale, w_scale, act_ste, w_ste):
    """``base`` with static per-tensor scales for both roles, the given STEs and the native GEMM
    (vLLM's kernel needs per-token activation scales)."""
    act, wts = FP8Scheme("per_tensor", static=True), FP8Scheme("per_tensor", static=True)
    return dataclasses.replace(base, activation_scheme=act, weight_scheme=wts, activation_scale=act_scale,
                               weight_scale=w_scale, activation_ste=act_ste, weight_ste=w_ste,
                               visible_gemm=DequantFP8Gemm(act, wts))


def test_clipped_stes_zero_the_gradient_outside_the_threshold():
    """Thresholds relative to the static scales: the activation clips where it saturates
    (448 s_a = 1.5), the weight inside its range (300 s_w ~= 0.05)."""
    layer, x, grad_out = make_case(257, torch.float32, True, seed=3)
    act_scale, w_scale = torch.tensor([1.5 / 448]), torch.tensor([0.05 / 300])
    layer.config = clipped_config(layer.config, act_scale, w_scale,
                                  STE("clipped", threshold=448.0, value_at_threshold=1.0),
                                  STE("clipped", threshold=300.0, value_at_threshold=0.0))
    layer(x).backward(grad_out)
    act_mask = (x.detach().double().abs() <= 448 * act_scale.double()).float()
    w_mask = (layer.weight.detach().double().abs() < 300 * w_scale.double()).float()
    assert 0 < act_mask.mean() < 1 and 0 < w_mask.mean() < 1
    dx, dw, _, refs = reference_grads(x, layer.weight, layer.bias, grad_out, layer.config, act_mask, w_mask)
    assert_within_derived_bound("dX clipped", x.grad, dx, grad_out, refs["w_ref"], N, torch.float32)
    assert_within_derived_bound("dW clipped", layer.weight.grad, dw, grad_out.t(), refs["x_ref"], 257, torch.float32)
    assert (x.grad[act_mask == 0] == 0).all() and (layer.weight.grad[w_mask == 0] == 0).all()


def test_planted_bugs_fail_the_reference_comparison():
    """A silently swapped dX convention and a dropped clipped-STE mask both exceed the bound."""
    layer, x, grad_out = make_case(257, torch.bfloat16, True, seed=5)
    layer.config = default_fp8_linear_config(dx_weight="master")
    layer(x).backward(grad_out)
    declared = default_fp8_linear_config(dx_weight="dequantized")
    dx, _, _, refs = reference_grads(x, layer.weight, layer.bias, grad_out, declared)
    with pytest.raises(AssertionError, match="dX"):
        assert_within_derived_bound("dX", x.grad, dx, grad_out.float(), refs["w_ref"], N, torch.bfloat16)

    layer, x, grad_out = make_case(257, torch.bfloat16, True, seed=5)
    scales = torch.tensor([2.0 / 448]), torch.tensor([0.05 / 300])
    layer.config = clipped_config(layer.config, *scales, STE("identity"), STE("identity"))  # mask dropped
    layer(x).backward(grad_out)
    clipped = clipped_config(layer.config, *scales, STE("identity"),
                             STE("clipped", threshold=300.0, value_at_threshold=0.0))
    w_mask = (layer.weight.detach().double().abs() < 300 * scales[1].double()).to(torch.float32)
    _, dw, _, refs = reference_grads(x, layer.weight, layer.bias, grad_out, clipped, w_mask=w_mask)
    with pytest.raises(AssertionError, match="dW"):
        assert_within_derived_bound("dW", layer.weight.grad, dw, grad_out.float().t(), refs["x_ref"], 257,
                                    torch.bfloat16)


@pytest.mark.parametrize("dw_activation", ["dequantized", "original"])
def test_block_weights_with_native_gemm(dw_activation):
    act, wts = FP8Scheme("per_token_group"), FP8Scheme("block")
    config = FP8LinearConfig(activation_scheme=act, weight_scheme=wts, dx_weight="dequantized",
                             dw_activation=dw_activation, activation_ste=STE("identity"),
                             weight_ste=STE("identity"), visible_gemm=DequantFP8Gemm(act, wts))
    layer, x, grad_out = make_case(257, torch.bfloat16, True, seed=4)
    layer.config = config
    y = layer(x)
    x_q, x_s = quantize_fp8(x.detach(), act)
    w_q, w_s = quantize_fp8(layer.weight.detach(), wts)
    assert torch.equal(y, DequantFP8Gemm(act, wts)(x_q, x_s, w_q, w_s, layer.bias.detach(), torch.bfloat16))
    y.backward(grad_out)
    dx, dw, _, refs = reference_grads(x, layer.weight, layer.bias, grad_out, config)
    assert_within_derived_bound("dX block", x.grad, dx, grad_out.float(), refs["w_ref"], N, torch.bfloat16)
    assert_within_derived_bound("dW block", layer.weight.grad, dw, grad_out.float().t(), refs["x_ref"], 257,
                                torch.bfloat16)


@pytest.mark.parametrize("dx_weight, expected", [
    ("dequantized", [(torch.float8_e4m3fn, (N, K)), (torch.float32, (N, 1)),
                     (torch.float8_e4m3fn, (6, K)), (torch.float32, (6, 1))]),
    ("master", [(torch.bfloat16, (N, K)), (torch.float8_e4m3fn, (6, K)), (torch.float32, (6, 1))]),
])
def test_saves_exactly_what_backward_needs(dx_weight, expected):
    layer, x, grad_out = make_case(6, torch.bfloat16, True)
    layer.config = default_fp8_linear_config(dx_weight=dx_weight)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        y = layer(x.reshape(2, 3, K))
    assert saved == expected
    y.backward(grad_out.reshape(2, 3, N))
    assert x.grad.shape == (6, K)


def test_leading_dims_are_flattened_to_tokens():
    layer, x, _ = make_case(12, torch.float32, True)
    y3 = layer(x.detach().reshape(3, 4, K))
    assert y3.shape == (3, 4, N) and torch.equal(y3.reshape(12, N), layer(x.detach()))


def test_module_holds_only_master_parameters_and_exposes_the_contract():
    layer = FP8Linear(K, N)
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert list(FP8Linear(K, N, bias=False).named_parameters())[0][0] == "weight"
    assert len(list(FP8Linear(K, N, bias=False).parameters())) == 1
    layer(torch.randn(4, K))
    assert list(layer.buffers()) == [] and sorted(layer.state_dict()) == ["bias", "weight"]
    assert layer.dx_weight == "dequantized" and layer.dw_activation == "dequantized"
    assert layer.weight_scheme == FP8Scheme("per_channel") and layer.activation_scheme == FP8Scheme("per_token")
    assert layer.weight_ste == STE("identity") and layer.activation_ste == STE("identity")
    assert layer.visible_gemm is vllm_fp8_scaled_mm
    assert "dx_weight=dequantized" in repr(layer)


def test_bad_input_is_refused_with_named_errors():
    layer = FP8Linear(K, N)
    w, b = layer.weight, layer.bias
    config = layer.config
    with pytest.raises(ValueError, match=r"x must be \[..., K\]"):
        layer(torch.randn(4, K + 1))
    with pytest.raises(ValueError, match="x is torch.bfloat16 but weight is torch.float32"):
        layer(torch.randn(4, K, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be one of"):
        layer(torch.ones(4, K, dtype=torch.int64))
    with pytest.raises(ValueError, match="x is on meta"):
        layer(torch.empty(4, K, device="meta"))
    with pytest.raises(ValueError, match="at least one token"):
        layer(torch.randn(0, K))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        fp8_linear(torch.randn(4, K), w.detach().reshape(1, N, K), None, config)
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8_linear(torch.randn(4, K), w.detach(), b.detach()[:-1], config)
    with pytest.raises(ValueError, match="bias is torch.bfloat16"):
        fp8_linear(torch.randn(4, K), w.detach(), b.detach().bfloat16(), config)
    with pytest.raises(TypeError, match="config must be an FP8LinearConfig"):
        fp8_linear(torch.randn(4, K), w, b, {"dx_weight": "master"})
    with pytest.raises(ValueError, match="dx_weight must be one of"):
        dataclasses.replace(config, dx_weight="bf16")
    with pytest.raises(ValueError, match="dw_activation must be one of"):
        dataclasses.replace(config, dw_activation=None)
    with pytest.raises(ValueError, match="activation_scheme must be dynamic"):
        dataclasses.replace(config, activation_scheme=FP8Scheme("per_channel"))
    with pytest.raises(ValueError, match="weight_scale is required for the static weight_scheme"):
        dataclasses.replace(config, weight_scheme=FP8Scheme("per_tensor", static=True))
    with pytest.raises(ValueError, match="a static scheme must be 'per_tensor'"):
        dataclasses.replace(config, weight_scheme=FP8Scheme("per_channel", static=True), weight_scale=torch.ones(1))
    with pytest.raises(ValueError, match="weight_scale must be None for the dynamic weight_scheme"):
        dataclasses.replace(config, weight_scale=torch.ones(1))
    static = FP8Scheme("per_tensor", static=True)
    with pytest.raises(ValueError, match=r"activation_scale must be a float32 tensor of shape \(1,\)"):
        dataclasses.replace(config, activation_scheme=static, activation_scale=torch.ones(4, 1))
    with pytest.raises(ValueError, match="weight_scale must be finite and > 0"):
        dataclasses.replace(config, weight_scheme=static, weight_scale=torch.zeros(1))
    with pytest.raises(TypeError, match="weight_ste must be a contracts.STE"):
        dataclasses.replace(config, weight_ste="identity")
    with pytest.raises(ValueError, match="activation_ste is 'none'"):
        dataclasses.replace(config, activation_ste=STE("none"))
    clipped = STE("clipped", threshold=448.0, value_at_threshold=1.0)
    with pytest.raises(ValueError, match="activation_ste is clipped .* amax scaling never saturates"):
        dataclasses.replace(config, activation_ste=clipped)
    with pytest.raises(ValueError, match="weight_ste is clipped .* dynamic per_channel"):
        dataclasses.replace(config, weight_ste=clipped)
    with pytest.raises(TypeError):
        FP8LinearConfig(activation_scheme=FP8Scheme("per_token"), weight_scheme=FP8Scheme("per_channel"))
    with pytest.raises(ValueError, match="use DequantFP8Gemm for block scales"):
        FP8Linear(K, N, config=dataclasses.replace(config, weight_scheme=FP8Scheme("block")))(torch.randn(4, K))
    bad_gemm = dataclasses.replace(config, visible_gemm=lambda *args: torch.zeros(1))
    with pytest.raises(ValueError, match="visible_gemm must return"):
        FP8Linear(K, N, config=bad_gemm)(torch.randn(4, K))

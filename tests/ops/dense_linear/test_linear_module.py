"""VllmDenseLinear / VllmFP8Linear: backward vs independent fp32 autograd references (layer 1),
the gradient conventions, parameter identity and the deployed-value refresh."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear, gather_columns
from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear
from megatron_vllm_align.ops.refresh import refresh_deployed_weights, register_deployed_refresh
from megatron_vllm_align.quant.fp8 import FP8Scheme, quantize_fp8
from megatron_vllm_align.validation import compare_vjp, visible_with_surrogate

SHAPES = [(1, 256, 96), (300, 256, 96), (37, 1000, 250)]  # (M, K, N): sgl and oneDNN shadows
PREFIX = "model.layers.0.mlp.down_proj"


def _reference_fp8(t: torch.Tensor, divide: bool) -> torch.Tensor:
    """Independent fp32 quantize-dequantize per row: scale = max(amax / 448, 1 / (448 * 512));
    weights (per channel) divide by it, activations (per token) multiply by its reciprocal."""
    t32 = t.detach().float()
    scale = (t32.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    scaled = t32 / scale if divide else t32 * scale.reciprocal()
    return scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


class ReferenceLinear(nn.Module):
    """fp32 autograd of the contract: dX = dY W_ref, dW = dY^T X_ref, db = sum dY (identity STEs).

    ``quantized=False``: plain F.linear. Otherwise W_ref / X_ref follow ``dx_weight`` /
    ``dw_activation`` and the output value is the dequantized product, bridged
    (docs/method.md#layer-1-module-vjp)."""

    def __init__(self, layer: nn.Module, quantized: bool, dx_weight: str = "dequantized",
                 dw_activation: str = "dequantized") -> None:
        super().__init__()
        self.weight = nn.Parameter(layer.weight.detach().clone())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone())
        self.quantized, self.dx_weight, self.dw_activation = quantized, dx_weight, dw_activation

    def forward(self, x):
        bias = None if self.bias is None else self.bias.float()
        if not self.quantized:
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        w_dq, x_dq = _reference_fp8(self.weight, divide=True), _reference_fp8(x, divide=False)
        w_for_dx = w_dq if self.dx_weight == "dequantized" else self.weight.detach().float()
        x_for_dw = x_dq if self.dw_activation == "dequantized" else x.detach().float()
        surrogate = F.linear(x.float(), w_for_dx) + F.linear(x_for_dw, self.weight.float(), bias)
        with torch.no_grad():
            visible = F.linear(x_dq, w_dq, bias).to(x.dtype)
        return visible_with_surrogate(visible, surrogate.to(x.dtype))


def _tolerances(tolerance, m, n, with_bias):
    # dX reduces over N, dW and db over the M tokens.
    items = {"input[0]": tolerance(n), "weight": tolerance(m)}
    if with_bias:
        items["bias"] = tolerance(m)
    return items


def _input(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).requires_grad_()


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_backward_matches_reference(bf16_context, one_rounding_tolerance, m, k, n, with_bias):
    torch.manual_seed(m + k + n)
    layer = VllmDenseLinear(k, n, bias=with_bias, vllm_context=bf16_context)
    report = compare_vjp(layer, ReferenceLinear(layer, quantized=False), [_input(m, k, m)],
                         tolerances=_tolerances(one_rounding_tolerance, m, n, with_bias))
    assert report.passed, report.failures


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dx_weight,dw_activation", [("dequantized", "dequantized"), ("master", "original")])
def test_fp8_backward_matches_reference(fp8_context, one_rounding_tolerance, m, k, n, dx_weight, dw_activation):
    torch.manual_seed(m + k + n)
    layer = VllmFP8Linear(k, n, bias=True, vllm_context=fp8_context, prefix=PREFIX, dx_weight=dx_weight,
                          dw_activation=dw_activation)
    reference = ReferenceLinear(layer, quantized=True, dx_weight=dx_weight, dw_activation=dw_activation)
    report = compare_vjp(layer, reference, [_input(m, k, m)],
                         tolerances=_tolerances(one_rounding_tolerance, m, n, True))
    assert report.passed, report.failures


@pytest.mark.parametrize("item,candidate_kwargs", [("input[0]", {"dx_weight": "master"}),
                                                   ("weight", {"dw_activation": "original"})])
def test_fp8_conventions_are_distinguishable(fp8_context, one_rounding_tolerance, item, candidate_kwargs):
    """Planted swap: a candidate on the other convention fails against the default reference."""
    torch.manual_seed(0)
    layer = VllmFP8Linear(256, 96, bias=True, vllm_context=fp8_context, prefix=PREFIX, **candidate_kwargs)
    report = compare_vjp(layer, ReferenceLinear(layer, quantized=True), [_input(300, 256, 1)],
                         tolerances=_tolerances(one_rounding_tolerance, 300, 96, True), dy_kinds=["random"])
    assert [line for line in report.failures if f"{item}:" in line], report.failures


def test_linear_vjp_matches_float64_autograd_to_fp32_precision():
    """The formula (transposes, bias reduction) free of bf16 noise: linear_vjp's GEMMs run in dY's dtype, float64
    here."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 7, generator=gen, dtype=torch.float64), torch.randn(3, 7, generator=gen, dtype=torch.float64)
    b, g = torch.randn(3, generator=gen, dtype=torch.float64), torch.randn(5, 3, generator=gen, dtype=torch.float64)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    refs = torch.autograd.grad(F.linear(xs, ws, bs), (xs, ws, bs), g)
    ours = linear_vjp(g, x, w, torch.float64, torch.float64, torch.float64, (True, True, True))
    for mine, ref in zip(ours, refs):
        assert torch.allclose(mine, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "fp8"])
def test_parameters_are_exactly_the_master(bf16_context, fp8_context, kind):
    layer = (VllmDenseLinear(64, 32, bias=True, vllm_context=bf16_context) if kind == "dense" else
             VllmFP8Linear(64, 32, bias=True, vllm_context=fp8_context, prefix=PREFIX))
    assert [id(p) for p in layer.parameters()] == [id(layer.weight), id(layer.bias)]
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert list(layer.children()) == []  # the vLLM shadow is not a submodule
    assert not any(t.requires_grad for t in layer.kernel.layer.parameters())


def _independent_vllm_output(context, layer, x, quantized):
    """Output of a separately built vLLM layer loaded with ``layer``'s current master."""
    from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel

    kernel = VllmLinearKernel(context, layer.weight.shape[1], layer.weight.shape[0], True, quantized, PREFIX)
    kernel.load(layer.weight.detach().clone(), layer.bias.detach().clone())
    return kernel(x)


@pytest.mark.parametrize("kind", ["dense", "fp8"])
def test_deployed_value_follows_optimizer_steps(bf16_context, fp8_context, kind):
    context = bf16_context if kind == "dense" else fp8_context
    cls = VllmDenseLinear if kind == "dense" else VllmFP8Linear
    torch.manual_seed(1)
    model = nn.Sequential(cls(256, 96, bias=True, vllm_context=context, prefix=PREFIX))
    layer = model[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert len(optimizer.param_groups[0]["params"]) == 2
    x = torch.randn(8, 256).to(torch.bfloat16)

    def step():
        optimizer.zero_grad()
        layer(x).float().square().sum().backward()
        optimizer.step()

    before = layer(x).detach()
    step()
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        layer(x)  # stale deployed value refused
    assert refresh_deployed_weights(model) == 1
    after = layer(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _independent_vllm_output(context, layer, x, kind == "fp8"))

    handle = register_deployed_refresh(optimizer, model)
    step()
    assert torch.equal(layer(x), _independent_vllm_output(context, layer, x, kind == "fp8"))
    if kind == "fp8":  # the shadow's FP8 weight is vLLM's quantization of the new master, bitwise
        w_q, w_scale = layer.kernel.fp8_weight()
        q_expected, scale_expected = quantize_fp8(layer.weight.detach(), FP8Scheme("per_channel"))
        assert torch.equal(w_q.view(torch.uint8), q_expected.view(torch.uint8))
        assert torch.equal(w_scale, scale_expected)
    handle.remove()
    with pytest.raises(TypeError, match="register_step_post_hook"):
        register_deployed_refresh(object(), model)


def test_bad_configuration_and_input_are_refused(bf16_context, fp8_context):
    with pytest.raises(ValueError, match="quantized=True needs an engine with quantization"):
        VllmFP8Linear(64, 32, vllm_context=bf16_context)
    with pytest.raises(ValueError, match="dx_weight must be one of"):
        VllmFP8Linear(64, 32, vllm_context=fp8_context, dx_weight="bf16")
    with pytest.raises(ValueError, match="dw_activation must be one of"):
        VllmFP8Linear(64, 32, vllm_context=fp8_context, dw_activation="quantized")
    layer = VllmDenseLinear(64, 32, vllm_context=bf16_context)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., in_features=64\]"):
        layer(torch.randn(2, 63).to(torch.bfloat16))
    with pytest.raises(TypeError, match="x must be a torch.bfloat16"):
        layer(torch.randn(2, 64))
    assert layer(torch.randn(2, 3, 64).to(torch.bfloat16)).shape == (2, 3, 32)


def test_gather_columns_is_the_column_gather():
    """Block gather == ``matrix[:, order]`` for a linear_qkv permutation (blocks of head_dim), a random
    one (blocks of 1), the identity and a non-contiguous matrix; control: a shifted order differs."""
    from megatron_vllm_align.megatron.vllm_linear import megatron_to_vllm_qkv_rows

    gen = torch.Generator().manual_seed(0)
    qkv = torch.argsort(megatron_to_vllm_qkv_rows(16, 8, 128))
    for order in (qkv, torch.argsort(megatron_to_vllm_qkv_rows(4, 2, 6)), torch.randperm(37, generator=gen),
                  torch.arange(10)):
        for matrix in (torch.randn(5, order.numel(), generator=gen).bfloat16(),
                       torch.randn(order.numel(), 3, generator=gen).t()):
            gathered = gather_columns(matrix, order)
            assert gathered.is_contiguous() and torch.equal(gathered, matrix[:, order])
    matrix = torch.randn(3, qkv.numel(), generator=gen)
    assert not torch.equal(gather_columns(matrix, qkv), matrix[:, qkv.roll(128)])

"""VllmRMSNorm: closed-form backward vs an independent fp32 autograd reference (layer 1)."""
import copy

import pytest
import torch

from megatron_vllm_align.ops.rms_norm.module import VllmRMSNorm
from megatron_vllm_align.ops.rms_norm.reference import ReferenceRMSNorm
from megatron_vllm_align.ops.rms_norm.vjp import rms_norm_input_grad, rms_norm_vjp
from megatron_vllm_align.validation import compare_vjp

EPS = 1e-6


def _inputs(tokens, hidden, seed, extreme_rows=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    if extreme_rows:  # separate case: these rows dominate global metrics and would mask the rest
        x[1::3] *= 1e-4  # small RMS: eps matters
        x[2::3] *= 1e3  # large RMS
    residual = torch.randn(tokens, hidden, generator=gen)
    weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    return x.to(torch.bfloat16), residual.to(torch.bfloat16), weight.to(torch.bfloat16)


@pytest.mark.parametrize("tokens,hidden,extreme", [(1, 256, False), (300, 256, False), (37, 1000, False),
                                                   (37, 1000, True)])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused_residual"])
def test_backward_matches_independent_reference(bf16_context, one_rounding_tolerance, tokens, hidden, extreme,
                                                fused):
    x, residual, weight = _inputs(tokens, hidden, seed=tokens + hidden, extreme_rows=extreme)
    module = VllmRMSNorm(hidden, EPS, vllm_context=bf16_context)
    with torch.no_grad():
        module.weight.copy_(weight)
    reference = ReferenceRMSNorm(weight, EPS)
    inputs = [x.requires_grad_(), residual.requires_grad_()] if fused else [x.requires_grad_()]
    # dX reduces over the hidden size; dweight sums over tokens.
    tolerances = {"input[0]": one_rounding_tolerance(hidden), "input[1]": one_rounding_tolerance(hidden),
                  "weight": one_rounding_tolerance(max(tokens, hidden))}
    report = compare_vjp(module, reference, inputs, tolerances=tolerances)
    assert report.passed, report.failures


def test_forward_is_the_visible_kernel_and_parameters_are_the_weight(bf16_context):
    x, residual, weight = _inputs(5, 256, seed=1)
    module = VllmRMSNorm(256, EPS, vllm_context=bf16_context)
    with torch.no_grad():
        module.weight.copy_(weight)
    assert [p is module.weight for p in module.parameters()] == [True]
    assert list(module.state_dict()) == ["weight"]
    assert torch.equal(module(x), module.kernel(x, weight))
    y, new_residual = module(x, residual)
    assert torch.equal(new_residual, (x.float() + residual.float()).to(torch.bfloat16))


def test_closed_form_is_exact_in_float64():
    """The VJP formula itself, free of bf16 noise: agrees with float64 autograd to ~1e-12."""
    gen = torch.Generator().manual_seed(0)
    total = torch.randn(6, 33, generator=gen, dtype=torch.float64, requires_grad=True)
    gamma = torch.randn(33, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(6, 33, generator=gen, dtype=torch.float64)
    y = total * torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + EPS) * gamma
    d_total_ref, d_gamma_ref = torch.autograd.grad(y, (total, gamma), grad_out)
    d_total, per_token = rms_norm_input_grad(total.detach(), gamma.detach(), grad_out, EPS)
    assert torch.allclose(d_total, d_total_ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(per_token.sum(dim=0), d_gamma_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocked_vjp_is_the_closed_form_on_upcast_operands_bitwise(dtype):
    """rms_norm_vjp (mixed-dtype adds and products) == rms_norm_input_grad on explicit fp32 copies, bit
    for bit, on one block; its inputs are untouched (an fp32 x is not summed into in place). Control:
    the residual gradient left out differs."""
    gen = torch.Generator().manual_seed(7)
    x, residual, grad, grad_residual = (torch.randn(300, 256, generator=gen).to(dtype) for _ in range(4))
    gamma = (1 + 0.3 * torch.randn(256, generator=gen)).to(dtype).float()
    before = [t.clone() for t in (x, residual, grad, grad_residual)]
    d_total, d_gamma = rms_norm_vjp(x, residual, gamma, grad, grad_residual, EPS, need_weight=True)
    expected, per_token = rms_norm_input_grad(x.float() + residual.float(), gamma, grad.float(), EPS)
    assert torch.equal(d_total, expected.add_(grad_residual.float()).to(dtype))
    assert torch.equal(d_gamma, per_token.sum(dim=0))
    assert all(torch.equal(t, b) for t, b in zip((x, residual, grad, grad_residual), before))
    assert not torch.equal(d_total, rms_norm_vjp(x, residual, gamma, grad, None, EPS, need_weight=False)[0])


def test_planted_bug_dropped_mean_term_fails(bf16_context, one_rounding_tolerance, monkeypatch):
    """The comparison can fail: a backward without the mean(h xh) projection is caught."""
    import megatron_vllm_align.ops.rms_norm.vjp as rmsnorm

    def wrong(total, gamma, grad_out, eps):
        rstd = torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps)
        return rstd * grad_out * gamma, grad_out * total * rstd

    monkeypatch.setattr(rmsnorm, "rms_norm_input_grad", wrong)
    x, _, weight = _inputs(300, 256, seed=5)
    module = VllmRMSNorm(256, EPS, vllm_context=bf16_context)
    with torch.no_grad():
        module.weight.copy_(weight)
    report = compare_vjp(module, ReferenceRMSNorm(module.weight, EPS), [x.requires_grad_()],
                         tolerances=one_rounding_tolerance(256), dy_kinds=["random"])
    assert not report.passed and any("input[0]" in line for line in report.failures)


def test_bad_input_is_refused(bf16_context):
    module = VllmRMSNorm(64, EPS, vllm_context=bf16_context)
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        module(torch.randn(2, 64))
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        VllmRMSNorm(0, EPS, vllm_context=bf16_context)
    with pytest.raises(ValueError, match="eps must be a number > 0"):
        VllmRMSNorm(64, 0.0, vllm_context=bf16_context)
    assert copy.deepcopy(module).weight is not module.weight

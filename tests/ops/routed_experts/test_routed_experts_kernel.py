"""vLLM's routed-experts kernel as the engine runs it (tiny Qwen3-MoE config): within the documented
bound of the native reference, its backend and refresh, and bad input refused."""
import pytest
import torch

from megatron_vllm_align.ops.routed_experts.kernel import (
    VllmRoutedExpertsKernel,
    routed_experts_bound,
    routed_experts_native,
)

HIDDEN, FFN, EXPERTS, TOP_K = 256, 128, 8, 2


@pytest.fixture(scope="module")
def moe_context(tiny_moe_context):
    return tiny_moe_context("tiny_qwen3_moe_config")


def _bf16(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


@pytest.fixture(scope="module")
def experts_kernel(moe_context):
    gen = torch.Generator().manual_seed(0)
    kernel = VllmRoutedExpertsKernel(moe_context, HIDDEN, FFN, EXPERTS, TOP_K)
    fc1 = _bf16(gen, EXPERTS, 2 * FFN, HIDDEN, scale=HIDDEN ** -0.5)
    fc2 = _bf16(gen, EXPERTS, HIDDEN, FFN, scale=FFN ** -0.5)
    kernel.load(fc1, fc2)
    return kernel, fc1, fc2


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_experts_kernel_within_documented_bound_of_native(experts_kernel, tokens):
    kernel, fc1, fc2 = experts_kernel
    gen = torch.Generator().manual_seed(tokens)
    x = _bf16(gen, tokens, HIDDEN)
    ids = torch.rand(tokens, EXPERTS, generator=gen).topk(TOP_K, dim=1).indices.int()
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), -1)
    out = kernel(x, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, HIDDEN)
    native = routed_experts_native(x, fc1, fc2, weights, ids)
    bound = routed_experts_bound(x, fc1, fc2, weights, ids)
    diff = (out.double() - native.double()).abs()
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max():.3g}"
    if tokens == 1:
        assert torch.equal(out, native), "a single token is bitwise the native formula"


def test_experts_kernel_backend_and_refresh(moe_context):
    gen = torch.Generator().manual_seed(2)
    kernel = VllmRoutedExpertsKernel(moe_context, HIDDEN, 48, EXPERTS, TOP_K, prefix="tests.moe.refresh")
    x, ids = _bf16(gen, 5, HIDDEN), torch.tensor([[0, 3]] * 5, dtype=torch.int32)
    weights = torch.full((5, TOP_K), 0.5)
    outs = []
    for _ in range(2):  # the second load reuses the prefix (the first shadow is released)
        fc1, fc2 = _bf16(gen, EXPERTS, 96, HIDDEN, scale=0.1), _bf16(gen, EXPERTS, HIDDEN, 48, scale=0.1)
        kernel.load(fc1, fc2)
        outs.append(kernel(x, weights, ids))
        assert torch.equal(outs[-1], routed_experts_native(x, fc1, fc2, weights, ids))
    assert not torch.equal(outs[0], outs[1])
    assert type(kernel.fused_experts).__name__ in {"X86CPUUnquantizedExperts", "CPUUnquantizedExperts"}
    if torch.cpu._is_amx_tile_supported():
        assert kernel.fused_experts.isa == "amx"
    with pytest.raises(ValueError, match="already names another vLLM layer"):
        VllmRoutedExpertsKernel(moe_context, HIDDEN, 48, EXPERTS, TOP_K, prefix="tests.moe.refresh").load(fc1, fc2)


def test_bad_input_is_refused_with_clear_errors(moe_context, experts_kernel):
    kernel = experts_kernel[0]
    x, weights = torch.zeros(3, HIDDEN, dtype=torch.bfloat16), torch.full((3, TOP_K), 0.5)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\)"):
        kernel(x, weights, torch.tensor([[0, 8]] * 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_ids must have shape"):
        kernel(x, weights, torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor"):
        kernel(x, weights, weights)
    with pytest.raises(TypeError, match="x must be a torch.bfloat16 tensor"):
        kernel(x.float(), weights, torch.tensor([[0, 1]] * 3))
    with pytest.raises(RuntimeError, match="call load"):
        VllmRoutedExpertsKernel(moe_context, HIDDEN, FFN, EXPERTS, TOP_K)(x, weights, torch.tensor([[0, 1]] * 3))
    with pytest.raises(ValueError, match="hidden_size divisible by 32"):
        VllmRoutedExpertsKernel(moe_context, 200, FFN, EXPERTS, TOP_K).load(torch.zeros(8, 256, 200),
                                                                           torch.zeros(8, 200, 128))

"""vLLM's MoE router and routed-experts kernels as the engine runs them (tiny Qwen3-MoE config):
the weight formula, the native references and their documented bounds, refresh and bad input."""
import pytest
import torch

from megatron_vllm_align.ops.moe_router.kernel import VllmRouterKernel, router_native
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


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_weights_are_vllms_bf16_formula_and_replay_reproduces_them(moe_context, renormalize):
    gen = torch.Generator().manual_seed(1)
    kernel = VllmRouterKernel(moe_context, HIDDEN, EXPERTS, TOP_K, renormalize)
    weight = _bf16(gen, EXPERTS, HIDDEN, scale=HIDDEN ** -0.5)
    kernel.load(weight)
    x = _bf16(gen, 37, HIDDEN)
    logits = kernel.logits(x)
    assert logits.dtype == torch.bfloat16 and logits.shape == (37, EXPERTS)
    assert torch.equal(logits, (x.float() @ weight.float().t()).bfloat16())  # sgl GEMM at this shape
    weights, ids = kernel.select(x, logits)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    selected = logits.gather(1, ids.long())
    expected = torch.softmax(selected, -1) if renormalize else (selected - logits.logsumexp(-1, keepdim=True)).exp()
    assert torch.equal(weights, expected.float()), "weights carry vLLM's bf16 arithmetic"
    assert torch.equal(kernel.weights_at(logits, ids), weights), "replay at vLLM's own IDs is bitwise vLLM's"
    native_weights, native_ids = router_native(logits, TOP_K, renormalize)
    assert torch.equal(ids.sort(1).values, native_ids.sort(1).values)
    slot_in_native = (ids.long().unsqueeze(2) == native_ids.long().unsqueeze(1)).int().argmax(2)
    reordered = native_weights.gather(1, slot_in_native)  # native weights in vLLM's slot order
    u = 2.0 ** -8
    if renormalize:
        roundings = torch.ones_like(selected, dtype=torch.float32)
    else:  # the documented first-order bound, with 1% for second-order terms
        lse = logits.float().logsumexp(-1, keepdim=True)
        roundings = 1.01 * (1 + lse.abs() + (selected.float() - lse).abs())
    assert bool(((weights - reordered).abs() <= roundings * u * reordered.abs()).all())
    assert not torch.equal(weights, reordered), "the bf16 rounding is visible (fp32 softmax differs)"


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
    with pytest.raises(ValueError, match="top_k=9 must not exceed num_experts=8"):
        VllmRouterKernel(moe_context, HIDDEN, EXPERTS, 9)
    with pytest.raises(ValueError, match="router weight must be a tensor of shape"):
        VllmRouterKernel(moe_context, HIDDEN, EXPERTS, TOP_K).load(torch.zeros(EXPERTS, 100))

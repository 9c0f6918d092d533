"""vLLM's MoE router kernel as the engine runs it (tiny Qwen3-MoE config): vLLM's bf16 routing-weight
formula, replay at its own IDs, the native reference within the documented bound, and bad input refused."""
import pytest
import torch

from megatron_vllm_align.ops.moe_router.kernel import VllmRouterKernel, router_native

HIDDEN, EXPERTS, TOP_K = 256, 8, 2


@pytest.fixture(scope="module")
def moe_context(tiny_moe_context):
    return tiny_moe_context("tiny_qwen3_moe_config")


def _bf16(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


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


def test_bad_input_is_refused_with_clear_errors(moe_context):
    with pytest.raises(ValueError, match="top_k=9 must not exceed num_experts=8"):
        VllmRouterKernel(moe_context, HIDDEN, EXPERTS, 9)
    with pytest.raises(ValueError, match="router weight must be a tensor of shape"):
        VllmRouterKernel(moe_context, HIDDEN, EXPERTS, TOP_K).load(torch.zeros(EXPERTS, 100))

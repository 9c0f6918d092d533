"""VllmRoutedExperts (and the router before it): the MoE forward equals vLLM's own Qwen3-MoE block
bitwise; the glue backward handles empty experts and feeds the router; the deployed experts
follow the master after optimizer steps."""
import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.moe_router.module import VllmMoERouter
from megatron_vllm_align.ops.refresh import register_deployed_refresh
from megatron_vllm_align.ops.routed_experts.kernel import routed_experts_bound, routed_experts_native
from megatron_vllm_align.ops.routed_experts.module import VllmRoutedExperts

HIDDEN, FFN, EXPERTS, TOP_K = 256, 128, 8, 2


@pytest.fixture(scope="module")
def contexts(tiny_moe_context):
    """norm_topk_prob -> the vLLM context of a tiny Qwen3-MoE with that setting."""
    return {renormalize: tiny_moe_context(f"tiny_qwen3_moe_norm_{renormalize}", norm_topk_prob=renormalize)
            for renormalize in (True, False)}


def _moe(context, renormalize=True, seed=0, ffn=FFN):
    torch.manual_seed(seed)
    router = VllmMoERouter(HIDDEN, EXPERTS, TOP_K, renormalize, vllm_context=context)
    experts = VllmRoutedExperts(EXPERTS, HIDDEN, ffn, TOP_K, renormalize, vllm_context=context)
    return router, experts


def _x(tokens, seed=0):
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_contract_name_is_a_default_contract():
    assert get_default_contract(VllmRoutedExperts.contract_name).case == "C"


def _vllm_block(context, router, experts, layer):
    """vLLM's own Qwen3MoeSparseMoeBlock with our masters loaded, processed as vLLM's loader does."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    config = context.vllm_config
    with torch.no_grad(), context.active(parallel_state=True, building=True):
        block = Qwen3MoeSparseMoeBlock(config, prefix=f"model.layers.{layer}.mlp")
        params = dict(block.named_parameters())
        params["gate.weight"].copy_(router.weight)
        params["experts.routed_experts.w13_weight"].copy_(experts.fc1_weight)
        params["experts.routed_experts.w2_weight"].copy_(experts.fc2_weight)
        process_weights_after_loading(block, config.model_config, torch.device("cpu"))
    return block


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_forward_equals_vllms_qwen3_moe_block_bitwise(contexts, renormalize):
    from vllm.forward_context import set_forward_context

    context = contexts[renormalize]
    router, experts = _moe(context, renormalize)
    block = _vllm_block(context, router, experts, layer=int(renormalize))
    for tokens in (1, 7, 17, 37, 64, 300):
        x = _x(tokens, seed=tokens)
        weights, ids, _ = router(x)
        out = experts(x, weights, ids)
        with torch.no_grad(), context.active(parallel_state=True), set_forward_context(None, context.vllm_config):
            expected = block(x.clone())
        assert torch.equal(out, expected), f"M={tokens}: max diff {(out.float() - expected.float()).abs().max():.3g}"


def test_empty_experts_get_exactly_zero_weight_gradients(contexts):
    router, experts = _moe(contexts[True], seed=1)
    x = _x(1, seed=5).requires_grad_()
    weights, ids, _ = router(x)
    experts(x, weights, ids).backward(torch.randn(1, HIDDEN))
    used = set(ids.flatten().tolist())
    assert len(used) == TOP_K
    for expert in range(EXPERTS):
        for grad in (experts.fc1_weight.grad[expert], experts.fc2_weight.grad[expert]):
            assert bool((grad != 0).any()) == (expert in used), f"expert {expert}"


def test_combine_weight_gradient_reaches_the_router(contexts):
    router, experts = _moe(contexts[True], seed=2)
    x = _x(9, seed=6)
    weights, ids, _ = router(x)
    experts(x, weights, ids).backward(torch.randn(9, HIDDEN))
    assert router.weight.grad is not None and bool((router.weight.grad != 0).any())


def test_unaligned_intermediate_and_refresh_after_optimizer_steps(contexts):
    router, experts = _moe(contexts[True], seed=3, ffn=40)  # vLLM pads 40 to 64 internally
    x = _x(11, seed=7)
    weights, ids, _ = router(x)
    weights = weights.detach()
    optimizer = torch.optim.SGD(experts.parameters(), lr=0.5)
    register_deployed_refresh(optimizer, experts)
    outs = []
    for step in range(2):
        out = experts(x, weights, ids)
        masters = (x, experts.fc1_weight, experts.fc2_weight, weights, ids)
        if step == 0:
            assert torch.equal(out, routed_experts_native(*masters))
        else:  # the grown weights flip single activation roundings (measured with the AVX2 vec kernel:
            # 2 of 2816 elements); a stale deployed value would be far outside the documented bound
            diff = (out.float() - routed_experts_native(*masters).float()).abs()
            assert bool((diff <= routed_experts_bound(*masters)).all())
        outs.append(out)
        optimizer.zero_grad()
        out.float().square().sum().backward()
        optimizer.step()
    assert not torch.equal(outs[0], outs[1])
    with torch.no_grad():
        experts.fc2_weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        experts(x, weights, ids)


def test_bad_routing_input_is_refused(contexts):
    _, experts = _moe(contexts[True], seed=4)
    x, weights = _x(3), torch.full((3, TOP_K), 0.5)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\)"):
        experts(x, weights, torch.tensor([[1, 9]] * 3))
    with pytest.raises(ValueError, match=r"topk_weights must have shape \(3, 2\)"):
        experts(x, weights[:2], torch.tensor([[1, 2]] * 3))

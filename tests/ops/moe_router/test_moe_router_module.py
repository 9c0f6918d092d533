"""VllmMoERouter: vLLM's routing in forward, gradients only through the continuous scores at the
saved IDs, router replay and its input checks, the deployed gate kept in step with the master."""
import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.moe_router.kernel import VllmRouterKernel
from megatron_vllm_align.ops.moe_router.module import VllmMoERouter
from megatron_vllm_align.ops.refresh import register_deployed_refresh

HIDDEN, EXPERTS, TOP_K = 256, 8, 2


@pytest.fixture(scope="module")
def moe_context(tiny_moe_context):
    return tiny_moe_context("tiny_qwen3_moe_router")


def _router(context, renormalize=True, seed=0):
    torch.manual_seed(seed)
    return VllmMoERouter(HIDDEN, EXPERTS, TOP_K, renormalize, vllm_context=context)


def _x(tokens, seed=0):
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_contract_name_is_a_default_contract():
    assert get_default_contract(VllmMoERouter.contract_name).case == "A"


@pytest.mark.parametrize("renormalize", [True, False])
def test_forward_is_vllms_choice_and_replaying_it_is_bitwise(moe_context, renormalize):
    router = _router(moe_context, renormalize)
    x = _x(37).reshape(1, 37, HIDDEN)
    weights, ids, logits = router(x)
    flat = x.reshape(37, HIDDEN)
    assert torch.equal(logits, router.kernel.logits(flat))
    vllm_weights, vllm_ids = router.kernel.select(flat, logits)
    assert torch.equal(weights, vllm_weights) and torch.equal(ids, vllm_ids)
    assert not ids.requires_grad and weights.requires_grad and logits.requires_grad
    replayed = router(x, replay_ids=ids.long())
    assert all(torch.equal(a, b) for a, b in zip(replayed, (weights, ids, logits)))


def test_replayed_ids_replace_the_routers_choice(moe_context):
    router = _router(moe_context)
    x = _x(5, seed=1)
    own = router(x)[1]
    replay = (own + 1) % EXPERTS
    weights, ids, logits = router(x, replay_ids=replay)
    assert torch.equal(ids, replay.int())
    assert torch.equal(weights, torch.softmax(logits.gather(1, replay.long()), -1).float())


@pytest.mark.parametrize("replay, error, match", [
    (torch.tensor([[0, 1]] * 4), ValueError, r"shape \(5, 2\)"),
    (torch.tensor([[0, 1, 2]] * 5), ValueError, r"shape \(5, 2\)"),
    (torch.tensor([[0, 8]] * 5), ValueError, r"\[0, 8\); got values in \[0, 8\]"),
    (torch.tensor([[-1, 2]] * 5), ValueError, r"\[0, 8\)"),
    (torch.tensor([[0, 1], [2, 3], [4, 4], [5, 6], [7, 0]]), ValueError, r"repeat an expert.*token 2 has \[4, 4\]"),
    (torch.zeros(5, 2), TypeError, "replay_ids must be an integer tensor"),
    ([[0, 1]] * 5, TypeError, "replay_ids must be an integer tensor"),
])
def test_bad_replay_ids_are_refused(moe_context, replay, error, match):
    with pytest.raises(error, match=match):
        _router(moe_context)(_x(5), replay_ids=replay)


def test_only_selected_experts_receive_gradient_through_the_weights(moe_context):
    router = _router(moe_context)
    x = _x(3, seed=2).requires_grad_()
    weights, ids, _ = router(x)
    weights.backward(torch.randn(weights.shape))
    selected = set(ids.flatten().tolist())
    for expert in range(EXPERTS):
        row = router.weight.grad[expert]
        assert bool((row != 0).any()) == (expert in selected), f"expert {expert}"
    assert x.grad is not None and bool((x.grad != 0).any())


def test_logits_gradient_reaches_the_gate(moe_context):
    router = _router(moe_context)
    _, _, logits = router(_x(4, seed=3))
    logits.backward(torch.ones_like(logits))
    assert bool((router.weight.grad != 0).all()), "an auxiliary loss on the logits trains every row"


def test_stale_master_is_refused_and_the_step_hook_refreshes(moe_context):
    router = _router(moe_context)
    x = _x(6, seed=4)
    optimizer = torch.optim.SGD(router.parameters(), lr=1.0)
    router(x)[0].sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        router(x)
    handle = register_deployed_refresh(optimizer, router)
    optimizer.step()
    fresh = VllmRouterKernel(moe_context, HIDDEN, EXPERTS, TOP_K)
    fresh.load(router.weight)
    assert torch.equal(router(x)[2], fresh.logits(x))
    handle.remove()

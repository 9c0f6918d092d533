"""Layer 1 for the MoE router: exact top-k ties where the saved IDs decide, and a planted router that
re-selects its experts in backward is caught (the correct router passes in
tests/ops/test_layer1_registry.py)."""
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.ops.moe_router.case import ITEMS, TIED, router_builder
from megatron_vllm_align.ops.moe_router.module import MoERouterFunction, VllmMoERouter
from megatron_vllm_align.ops.moe_router.vjp import routing_weights_vjp
from megatron_vllm_align.ops.registry import Layer1Case, Widths

W = Widths()


def test_ties_are_exact_and_the_saved_ids_decide(case_contexts):
    router, _, inputs = router_builder(case_contexts.moe, W.hidden, W.experts, W.top_k, True)(0, 37)
    logits = router.kernel.logits(inputs[0].detach())
    assert torch.equal(logits[:, TIED[0]], logits[:, TIED[1]]) and torch.equal(logits[:, TIED[0]], logits[:, TIED[2]])
    ids = router(inputs[0])[1]
    ties_at_boundary = sum(len(set(TIED) & set(row)) in (1, 2) for row in ids.tolist())
    assert ties_at_boundary > 0, "some tokens select part of the tied group: the choice among ties matters"


class _RecomputingRouterFunction(MoERouterFunction):
    """Planted: re-selects the top-k in backward on slightly perturbed scores (ties break the other way)."""

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids, grad_logits):
        x, weight, logits, _saved_ids = ctx.saved_tensors
        perturbed = logits.float() + 1e-3 * torch.arange(logits.shape[1], dtype=torch.float32)
        ids = perturbed.topk(_saved_ids.shape[1], dim=1).indices
        d_logits = routing_weights_vjp(grad_weights, logits, ids, ctx.renormalize) + grad_logits.float()
        grad_x, grad_w, _ = linear_vjp(d_logits.to(logits.dtype), x, weight.detach().to(ctx.model_dtype), None,
                                       x.dtype, weight.dtype, (True, True, False))
        return grad_x, grad_w, None, None


class _RecomputingRouter(VllmMoERouter):
    def forward(self, x, replay_ids=None):
        return _RecomputingRouterFunction.apply(x, self.weight, self.kernel, None)


def test_planted_router_that_recomputes_ids_in_backward_is_caught(case_contexts, failing_checks):
    contract = get_default_contract("moe_router")
    correct = Layer1Case("router", contract, ITEMS,
                         router_builder(case_contexts.moe, W.hidden, W.experts, W.top_k, True), MoERouterFunction)
    planted = Layer1Case("planted", contract, ITEMS,
                         router_builder(case_contexts.moe, W.hidden, W.experts, W.top_k, True,
                                        candidate_cls=_RecomputingRouter), _RecomputingRouterFunction)
    # The re-selected experts are tied ones, whose gate rows are equal: dX = dlogits W cannot tell them
    # apart, dW (rows of other experts) can.
    assert ("weight", "tolerance") in failing_checks(planted)
    assert not failing_checks(correct), "the correct router passes the same comparison"

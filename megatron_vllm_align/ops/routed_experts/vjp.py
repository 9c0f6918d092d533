"""The routed experts' backward (contract ``routed_experts``, case C; the glue is in the module
docstring of :mod:`megatron_vllm_align.ops.routed_experts.module`): per expert over its sorted
tokens, the reused linear and SwiGLU VJPs, then the inverse dispatch permutation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.ops.silu_and_mul.kernel import silu_and_mul_native
from megatron_vllm_align.ops.silu_and_mul.vjp import silu_and_mul_vjp


@dataclass(frozen=True)
class DispatchPlan:
    """Token slots grouped by expert. ``order`` [M k]: flat (token, slot) indices sorted by expert
    (stable); ``tokens`` [M k]: the token of each sorted slot; ``counts``: slots per expert."""

    order: torch.Tensor
    tokens: torch.Tensor
    counts: tuple[int, ...]


def dispatch_plan(topk_ids: torch.Tensor, num_experts: int) -> DispatchPlan:
    """The dispatch of ``topk_ids`` [M, k] to ``num_experts`` experts."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return DispatchPlan(order, order // topk_ids.shape[1], tuple(counts))


def _unsort(sorted_values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse dispatch permutation: rows given in expert order back to (token, slot) order."""
    values = torch.empty_like(sorted_values)
    values[order] = sorted_values
    return values


def _sum_token_copies(slot_rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """[M k, H] rows in (token, slot) order -> [M, H]: each token's k copies summed (in their dtype)."""
    return slot_rows.view(-1, top_k, slot_rows.shape[-1]).sum(dim=1)


def routed_experts_vjp(grad_out: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, fc1_ref: torch.Tensor, fc2_ref: torch.Tensor,
                       needs: tuple[bool, bool, bool, bool], grad_dtypes: tuple[torch.dtype, ...]
                       ) -> tuple[torch.Tensor | None, ...]:
    """(dX, d topk_weights, dFC1, dFC2) of the routed experts (module docstring).

    grad_out, x [M, H]; topk_weights, topk_ids [M, k]; fc1_ref [E, 2F, H] and fc2_ref [E, H, F] in
    the model dtype. ``needs`` says which of the four are wanted; ``grad_dtypes`` gives their dtypes.
    """
    need_dx, need_dw, need_dfc1, need_dfc2 = needs
    x_dtype, w_dtype, fc1_dtype, fc2_dtype = grad_dtypes
    plan = dispatch_plan(topk_ids, fc1_ref.shape[0])
    x_sorted = x[plan.tokens]
    dy_sorted = grad_out[plan.tokens].float()
    w_sorted = topk_weights.reshape(-1)[plan.order].float()
    dx_sorted = torch.zeros(x_sorted.shape, dtype=torch.float32, device=x.device) if need_dx else None
    dw_sorted = torch.zeros(w_sorted.shape, dtype=torch.float32, device=x.device) if need_dw else None
    d_fc1 = torch.zeros(fc1_ref.shape, dtype=fc1_dtype, device=x.device) if need_dfc1 else None
    d_fc2 = torch.zeros(fc2_ref.shape, dtype=fc2_dtype, device=x.device) if need_dfc2 else None
    start = 0
    for expert, count in enumerate(plan.counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        # fp32 copies of bf16 values (exact): each is converted once and shared by the GEMMs below.
        x_e, w1, w2 = x_sorted[rows].float(), fc1_ref[expert].float(), fc2_ref[expert].float()
        gate_up = x_e @ w1.t()
        act = silu_and_mul_native(gate_up).to(x.dtype).float()
        if need_dw:
            dw_sorted[rows] = ((act @ w2.t()) * dy_sorted[rows]).sum(dim=-1)
        if not (need_dx or need_dfc1 or need_dfc2):
            continue
        dy_e = (w_sorted[rows, None] * dy_sorted[rows]).to(x.dtype)
        d_act, d_w2, _ = linear_vjp(dy_e, act, w2, None, x.dtype, fc2_dtype, (need_dx or need_dfc1, need_dfc2, False))
        if need_dfc2:
            d_fc2[expert] = d_w2
        if need_dx or need_dfc1:
            d_gate_up = silu_and_mul_vjp(gate_up, d_act).to(x.dtype)
            dx_e, d_w1, _ = linear_vjp(d_gate_up, x_e, w1, None, torch.float32, fc1_dtype, (need_dx, need_dfc1, False))
            if need_dx:
                dx_sorted[rows] = dx_e
            if need_dfc1:
                d_fc1[expert] = d_w1
    top_k = topk_ids.shape[1]
    grad_x = _sum_token_copies(_unsort(dx_sorted, plan.order), top_k).to(x_dtype) if need_dx else None
    grad_w = _unsort(dw_sorted, plan.order).view(topk_weights.shape).to(w_dtype) if need_dw else None
    return grad_x, grad_w, d_fc1, d_fc2

"""The shared expert's backward (contract ``shared_expert``; the chain is in the module docstring of
:mod:`megatron_vllm_align.ops.shared_expert.module`): the reused linear and SwiGLU VJPs chained
through the sigmoid gate."""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.ops.silu_and_mul.vjp import silu_and_mul_vjp


def shared_expert_vjp(grad_out: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor,
                      down: torch.Tensor, gate_logit: torch.Tensor, weights: tuple[torch.Tensor, ...],
                      needs: tuple[bool, bool, bool, bool], grad_dtypes: tuple[torch.dtype, ...]
                      ) -> tuple[torch.Tensor | None, ...]:
    """(dX, dFC1, dFC2, dGate) of the shared expert (module docstring). ``weights`` = (fc1, fc2, gate)
    in the model dtype; ``needs`` / ``grad_dtypes`` follow the four outputs' order."""
    need_dx, need_dfc1, need_dfc2, need_dgate = needs
    x_dtype, fc1_dtype, fc2_dtype, gate_dtype = grad_dtypes
    fc1, fc2, gate = weights
    model_dtype = x.dtype
    grad = grad_out.float()
    sig = torch.sigmoid(gate_logit.float())
    grad_x = grad_fc1 = grad_fc2 = grad_gate = None
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
    if need_dx or need_dgate:
        d_logit = ((grad * down.float()).sum(dim=-1, keepdim=True) * sig * (1 - sig)).to(model_dtype)
        dx_gate, grad_gate, _ = linear_vjp(d_logit, x, gate, None, torch.float32, gate_dtype,
                                           (need_dx, need_dgate, False))
        if need_dx:
            dx += dx_gate
    if need_dx or need_dfc1 or need_dfc2:
        d_down = (sig * grad).to(model_dtype)
        d_act, grad_fc2, _ = linear_vjp(d_down, act, fc2, None, model_dtype, fc2_dtype,
                                        (need_dx or need_dfc1, need_dfc2, False))
        if need_dx or need_dfc1:
            d_gate_up = silu_and_mul_vjp(gate_up, d_act)
            dx_mlp, grad_fc1, _ = linear_vjp(d_gate_up, x, fc1, None, torch.float32, fc1_dtype,
                                             (need_dx, need_dfc1, False))
            if need_dx:
                dx += dx_mlp
    if need_dx:
        grad_x = dx.to(x_dtype)
    return grad_x, grad_fc1, grad_fc2, grad_gate

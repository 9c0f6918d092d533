"""The MoE router backward (contract ``moe_router``; the formula is in the module docstring of
:mod:`megatron_vllm_align.ops.moe_router.module`): d logits of the routing weights at the expert IDs
fixed in forward, in fp32."""
from __future__ import annotations

import torch


def routing_weights_vjp(grad_weights: torch.Tensor, logits: torch.Tensor, topk_ids: torch.Tensor,
                        renormalize: bool) -> torch.Tensor:
    """d logits [M, E] fp32 of the routing weights at fixed ``topk_ids`` (module docstring formula)."""
    ids = topk_ids.long()
    grad = grad_weights.float()
    logits32 = logits.float()
    d_logits = torch.zeros_like(logits32)
    if renormalize:
        probs = torch.softmax(logits32.gather(1, ids), dim=-1)
        d_logits.scatter_(1, ids, probs * (grad - (probs * grad).sum(dim=-1, keepdim=True)))
    else:
        probs = torch.softmax(logits32, dim=-1)
        selected = probs.gather(1, ids)
        d_logits.scatter_(1, ids, selected * grad)
        d_logits -= probs * (selected * grad).sum(dim=-1, keepdim=True)
    return d_logits

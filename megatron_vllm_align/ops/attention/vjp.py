"""The attention backward (contract ``attention``, case A; the module docstring of
:mod:`megatron_vllm_align.ops.attention.module` states the contract): the training library's SDPA
recomputed in fp32 from the saved q, k, v and differentiated by autograd."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def training_attention_vjp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           grad_output: torch.Tensor, seq_lens: tuple[int, ...], scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of packed causal GQA attention at (q, k, v) for upstream ``grad_output``.

    Each sequence is recomputed with fp32 ``F.scaled_dot_product_attention(is_causal=True,
    scale=scale, enable_gqa=True)`` and differentiated by autograd; results are cast to the
    dtypes of q, k, v. Shapes as in ``vllm_prefill_attention``.
    """
    with torch.enable_grad():
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        outputs = []
        start = 0
        for n in seq_lens:
            qi, ki, vi = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q32, k32, v32))
            out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                 enable_gqa=True)
            outputs.append(out.squeeze(0).transpose(0, 1))
            start += n
        dq, dk, dv = torch.autograd.grad(torch.cat(outputs), (q32, k32, v32), grad_output.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

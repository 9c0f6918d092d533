"""The rotary embedding backward (contract ``rotary_embedding``, case A; the formula is in the module
docstring of :mod:`megatron_vllm_align.ops.rotary_embedding.module`): the transposed rotation."""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.rotary_embedding.kernel import cos_sin_at, neox_rotate


def rotary_embedding_vjp(grad_out: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         head_size: int, rotary_dim: int) -> torch.Tensor:
    """dX of the neox rotation at ``positions`` [T] for dY [T, H*D] or [T, H, D]: the inverse rotation
    with the cos/sin gathered from the forward's ``cos_sin_cache``, in fp32, cast once to dY's dtype."""
    cos, sin = cos_sin_at(cos_sin_cache, positions)
    heads = grad_out.float().reshape(positions.shape[0], -1, head_size)
    grad_in = neox_rotate(heads, cos, sin, rotary_dim, inverse=True)
    return grad_in.reshape(grad_out.shape).to(grad_out.dtype)

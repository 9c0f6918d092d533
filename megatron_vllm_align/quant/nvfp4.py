"""NVFP4 emulation in plain PyTorch: E2M1 values, e4m3 scales per 16 elements, one fp32 global scale.

Bitwise vLLM's reference quantizer ``ref_nvfp4_quant`` / ``ref_nvfp4_quant_dequant`` and its online
NVFP4 global-scale rule. With ``gs`` the global scale and ``amax_b`` the fp32 ``|x|.amax`` of a
16-element block: ``gs = (6 * 448) / max(amax(x), 1e-8)`` when not given; block scale
``s = e4m3(min(gs * (amax_b * fp32(1/6)), 448))`` (round to nearest even); ``v = clamp(x * gs / s, -6, 6)``
in vLLM's fp32 operation order (0 for a block with ``s = 0``), rounded to the E2M1 grid
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (with sign) to nearest, ties to the even code, zero stored as +0;
dequantize ``(code * (s_fp32 / gs)).to(out_dtype)``. Storage as vLLM's: two codes per ``uint8``
(element ``2i`` in the low nibble), a code = sign bit ``0x8`` plus the grid index ``0..7``; block
scales ``float8_e4m3fn`` [..., K/16], not swizzled. vLLM source and operation-order details:
docs/nvfp4_facts.md#the-projects-nvfp4-quantizer-quantnvfp4py-and-vllms-source.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vllm_align.quant.fp8 import INPUT_DTYPES

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # midpoints whose lower neighbour has the even code
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour has the even code
_MIN_AMAX = 1e-8


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor in NVFP4.

    packed: ``uint8 [..., K/2]``, two E2M1 codes per byte, element ``2i`` in the low nibble.
    block_scales: ``float8_e4m3fn [..., K/16]``, one per 16 consecutive elements of the last dim.
    global_scale: fp32 ``[1]``; values are ``code * block_scale / global_scale``.
    shape: shape of the original tensor ``[..., K]``.
    """

    packed: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size

    def codes(self) -> torch.Tensor:
        """The signed E2M1 values as fp32, shape ``self.shape``."""
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=self.packed.device)
        nibbles = torch.stack((self.packed & 0x0F, self.packed >> 4), dim=-1).flatten(-2)
        magnitude = grid[(nibbles & 0x07).long()]
        return torch.where((nibbles & 0x08).bool(), -magnitude, magnitude).reshape(self.shape)


def default_global_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[1]``: ``(6 * 448) / max(|x|.amax, 1e-8)``, so the largest block scale is about 448."""
    amax = x.abs().amax().to(torch.float32).clamp_min(_MIN_AMAX).reshape(1)
    return (E2M1_MAX * E4M3_MAX) / amax


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Grid index ``0..7`` (int64) of ``|v|`` rounded to nearest-even on the E2M1 grid; ``|v| <= 6``."""
    magnitude = v.abs()
    ties_down = torch.tensor(_TIES_DOWN, dtype=magnitude.dtype, device=v.device)
    ties_up = torch.tensor(_TIES_UP, dtype=magnitude.dtype, device=v.device)
    # bucketize(right=False) counts boundaries < |v| (a tie stays below); right=True counts <= |v|.
    return torch.bucketize(magnitude, ties_down) + torch.bucketize(magnitude, ties_up, right=True)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize ``x`` ``[..., K]`` (fp32/bf16/fp16, ``K % 16 == 0``) to NVFP4.

    ``global_scale``: fp32 tensor with one element, the ``gs`` of the module docstring; ``None``
    derives it from ``|x|.amax``. Raises ``ValueError`` when ``K`` is not a multiple of 16
    (vLLM asserts the same; no padding is done).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x must be one of {INPUT_DTYPES}, got {x.dtype}")
    if x.ndim < 1 or x.numel() == 0:
        raise ValueError(f"x must be non-empty with a last dim, got shape {tuple(x.shape)}")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(f"x.shape[-1] must be a multiple of {BLOCK_SIZE} for NVFP4, got {x.shape[-1]}")
    if global_scale is None:
        global_scale = default_global_scale(x)
    elif not isinstance(global_scale, torch.Tensor) or global_scale.dtype != torch.float32:
        raise ValueError("global_scale must be a float32 torch.Tensor")
    elif global_scale.numel() != 1 or global_scale.device != x.device:
        raise ValueError(f"global_scale must have one element on {x.device}, "
                         f"got shape {tuple(global_scale.shape)} on {global_scale.device}")
    gs = global_scale.reshape(1)

    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    block_scales = (gs * (block_amax * (1.0 / E2M1_MAX))).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    effective = block_scales.to(torch.float32) * gs.reciprocal()
    inverse = torch.where(effective == 0, torch.zeros_like(effective), effective.reciprocal())
    scaled = (blocks.to(torch.float32) * inverse).clamp(-E2M1_MAX, E2M1_MAX)

    index = round_to_e2m1(scaled)
    sign = ((scaled < 0) & (index > 0)).to(torch.uint8) << 3
    nibbles = (sign | index.to(torch.uint8)).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return NVFP4Tensor(packed=packed, block_scales=block_scales.squeeze(-1), global_scale=gs, shape=x.shape)


def dequantize_nvfp4(t: NVFP4Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(code * (block_scale_fp32 / global_scale)).to(out_dtype)``, shape ``t.shape``."""
    codes = t.codes().reshape(*t.shape[:-1], t.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    unit = t.block_scales.to(torch.float32).unsqueeze(-1) / t.global_scale
    return (codes * unit).reshape(t.shape).to(out_dtype)

"""FP8 quantize / dequantize with vLLM's scale and rounding rules, in plain PyTorch.

Input: a non-empty 2-D ``x`` [R, C] (activations [M, K], weights [N, K]) in fp32 / bf16 / fp16. Each
tile shares one fp32 scale: ``per_tensor`` [1], ``per_token`` [M, 1], ``per_channel`` [N, 1],
``per_token_group`` (1 x g) [M, ceil(K/g)], ``block`` (bn x bk) [ceil(N/bn), ceil(K/bk)]; a partial
last tile's scale is the amax of its real elements. Dynamic scale ``amax / fp8_max`` in fp32, clamped
below as vLLM does; static scales are the caller's. Values are clamped to +-fp8_max and cast
round-to-nearest-even. Refuses (ValueError / TypeError) other shapes, dtypes, a missing or misshaped
scale and a scale on another device. The vLLM function each rule mirrors, and the CUDA-only vLLM paths
it does not: docs/fp8_facts.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_token", "per_channel", "per_token_group", "block")
#: Dtypes a tensor to quantize may have (FP8 and NVFP4 quantizers, the FP8 linear's x / weight / bias).
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_DEFAULT_TILE = {"per_token_group": (1, 128), "block": (128, 128)}
_DIVIDES_BY_SCALE = ("per_channel", "per_token_group")
_BLOCK_MIN_AMAX = 1e-4
_MIN_SCALE_DIVISOR = 512.0


@dataclass(frozen=True)
class FP8Scheme:
    """How one tensor is quantized to FP8.

    granularity: one of ``GRANULARITIES`` (see the module docstring for tiles and rules).
    dtype: ``torch.float8_e4m3fn`` (vLLM's FP8 for weights and activations) or
        ``torch.float8_e5m2``.
    block_shape: ``(rows, cols)`` of a tile; only for ``per_token_group`` (rows must be 1,
        default ``(1, 128)``) and ``block`` (default ``(128, 128)``).
    static: ``True`` when the caller supplies the scale, ``False`` for a dynamic scale from amax.
    """

    granularity: str
    dtype: torch.dtype = torch.float8_e4m3fn
    block_shape: tuple[int, int] | None = None
    static: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"FP8Scheme.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.dtype not in FP8_DTYPES:
            raise ValueError(f"FP8Scheme.dtype must be one of {FP8_DTYPES}, got {self.dtype}")
        if self.granularity in _DEFAULT_TILE:
            shape = self.block_shape if self.block_shape is not None else _DEFAULT_TILE[self.granularity]
            if len(shape) != 2 or not all(isinstance(s, int) and s > 0 for s in shape):
                raise ValueError(f"FP8Scheme.block_shape must be two positive ints, got {self.block_shape!r}")
            if self.granularity == "per_token_group" and shape[0] != 1:
                raise ValueError(f"FP8Scheme.block_shape for per_token_group must be (1, g), got {shape!r}")
            object.__setattr__(self, "block_shape", tuple(shape))
        elif self.block_shape is not None:
            raise ValueError(f"FP8Scheme.block_shape is only for per_token_group/block, not {self.granularity!r}")

    @property
    def fp8_max(self) -> float:
        """Largest finite value of ``dtype``."""
        return float(torch.finfo(self.dtype).max)

    def tile(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Rows and columns of one scale tile for a 2-D tensor of ``shape``."""
        rows, cols = shape
        if self.granularity == "per_tensor":
            return rows, cols
        if self.granularity in ("per_token", "per_channel"):
            return 1, cols
        return self.block_shape  # type: ignore[return-value]

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """Shape of the fp32 scale for a 2-D tensor of ``shape``."""
        if self.granularity == "per_tensor":
            return (1,)
        tile_rows, tile_cols = self.tile(shape)
        return (math.ceil(shape[0] / tile_rows), math.ceil(shape[1] / tile_cols))


def _check_2d(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, K] (flatten leading dims first), got shape {tuple(x.shape)}")


def _check_scale(scale: torch.Tensor, scheme: FP8Scheme, shape: tuple[int, int], name: str) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    expected = scheme.scale_shape(shape)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for {scheme.granularity} on {tuple(shape)}, "
                         f"got {tuple(scale.shape)}")


def _tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """fp32 ``|x|.amax`` of each tile, shape ``[ceil(R/tr), ceil(C/tc)]``; partial tiles zero-padded."""
    rows, cols = x.shape
    tile_rows, tile_cols = tile
    grid_rows, grid_cols = math.ceil(rows / tile_rows), math.ceil(cols / tile_cols)
    padded = F.pad(x.abs(), (0, grid_cols * tile_cols - cols, 0, grid_rows * tile_rows - rows))
    tiles = padded.view(grid_rows, tile_rows, grid_cols, tile_cols)
    return tiles.amax(dim=(1, 3)).to(torch.float32)


def expand_scale(scale: torch.Tensor, scheme: FP8Scheme, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 scale broadcast to every element of a 2-D tensor of ``shape``."""
    if scheme.granularity == "per_tensor":
        return scale.reshape(1, 1).expand(shape)
    tile_rows, tile_cols = scheme.tile(shape)
    full = scale.repeat_interleave(tile_rows, dim=0).repeat_interleave(tile_cols, dim=1)
    return full[: shape[0], : shape[1]]


def _dynamic_scale(x: torch.Tensor, scheme: FP8Scheme) -> torch.Tensor:
    """fp32 scale from ``amax`` per tile (rules in the module docstring), shape ``scheme.scale_shape``."""
    amax = _tile_amax(x, scheme.tile(tuple(x.shape)))
    fp8_max = torch.tensor(scheme.fp8_max, dtype=torch.float32, device=x.device)
    if scheme.granularity == "block":
        scale = amax.clamp(min=_BLOCK_MIN_AMAX) / fp8_max
    else:
        scale = (amax / fp8_max).clamp(min=1.0 / (scheme.fp8_max * _MIN_SCALE_DIVISOR))
    return scale.reshape(scheme.scale_shape(tuple(x.shape)))


def quantize_fp8(
    x: torch.Tensor, scheme: FP8Scheme, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``x`` (fp32/bf16/fp16) to ``scheme.dtype``.

    ``scale`` is required for a static scheme and forbidden for a dynamic one; it must be fp32
    in ``scheme.scale_shape(x.shape)``. Returns ``(q, scale)``: ``q`` has ``x``'s shape and
    ``scheme.dtype``; ``scale`` is fp32 and ``x ~= q.float() * expand_scale(scale)``.
    """
    _check_2d(x, "x")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x must be one of {INPUT_DTYPES}, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    shape = tuple(x.shape)
    if scheme.static:
        if scale is None:
            raise ValueError(f"scale is required for a static {scheme.granularity} scheme")
        _check_scale(scale, scheme, shape, "scale")
        if scale.device != x.device:
            raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
        scaled = x.to(torch.float32) * expand_scale(scale, scheme, shape).reciprocal()
    else:
        if scale is not None:
            raise ValueError(f"scale must be None for a dynamic {scheme.granularity} scheme (set static=True)")
        scale = _dynamic_scale(x, scheme)
        full_scale = expand_scale(scale, scheme, shape)
        if scheme.granularity in _DIVIDES_BY_SCALE:
            scaled = x.to(torch.float32) / full_scale
        else:
            scaled = x.to(torch.float32) * full_scale.reciprocal()
    q = scaled.clamp(-scheme.fp8_max, scheme.fp8_max).to(scheme.dtype)
    return q, scale


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, scheme: FP8Scheme, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(q.float() * expand_scale(scale)).to(out_dtype)``: the fp32 product, then one cast."""
    _check_2d(q, "q")
    if q.dtype != scheme.dtype:
        raise ValueError(f"q must be {scheme.dtype} for this scheme, got {q.dtype}")
    _check_scale(scale, scheme, tuple(q.shape), "scale")
    if scale.device != q.device:
        raise ValueError(f"scale is on {scale.device} but q is on {q.device}")
    return (q.to(torch.float32) * expand_scale(scale, scheme, tuple(q.shape))).to(out_dtype)

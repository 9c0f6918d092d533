"""A gradient contract's FP8 quantize positions read as ``FP8Scheme``s.

This is the forward's quantizer definition (checked bitwise against vLLM in ``tests/quant``),
shared by ``FP8LinearConfig.from_contract`` and the layer-1 reference; no backward reads it.

* ``format``: ``fp8_e4m3`` -> ``torch.float8_e4m3fn``, ``fp8_e5m2`` -> ``torch.float8_e5m2``.
* ``scale_granularity``: ``per_tensor``, ``per_token``, ``per_channel``; ``per_token_group_<g>``
  -> ``per_token_group`` with tile ``(1, g)``; ``block_<r>x<c>`` -> ``block`` with tile ``(r, c)``.
* ``trainable.scales[<tensor>]``: ``stop_gradient`` -> a dynamic scale from amax, ``fixed`` -> a
  static scale the caller supplies.
* ``rounding`` must be ``rne``, ``scale_dtype`` ``fp32`` and ``global_scale`` ``none``.

Anything else (1-D ``block_<n>`` tiles, trainable or two-level scales, stochastic rounding)
raises ``ContractError`` naming the contract and the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_vllm_align.contracts.schema import ContractError, GradientContract, TensorRole
from megatron_vllm_align.quant.fp8 import FP8Scheme

_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_PLAIN = ("per_tensor", "per_token", "per_channel")
_GROUP = re.compile(r"per_token_group_([0-9]+)")
_BLOCK = re.compile(r"block_([0-9]+)x([0-9]+)")
_STATIC = {"stop_gradient": False, "fixed": True}


@dataclass(frozen=True)
class FP8Position:
    """The contract's quantized tensor of one role: its name there and its FP8 scheme."""

    tensor: str
    scheme: FP8Scheme


def _scheme_args(granularity: str) -> tuple[str, tuple[int, int] | None] | None:
    if granularity in _PLAIN:
        return granularity, None
    if match := _GROUP.fullmatch(granularity):
        return "per_token_group", (1, int(match.group(1)))
    if match := _BLOCK.fullmatch(granularity):
        return "block", (int(match.group(1)), int(match.group(2)))
    return None


def fp8_position(contract: GradientContract, role: TensorRole) -> FP8Position:
    """The single FP8 quantize position of ``role`` ("weight" or "activation") in ``contract``."""
    name = contract.module_class
    found = [(i, p) for i, p in enumerate(contract.visible_forward.quantize_positions) if p.role == role]
    if len(found) != 1:
        raise ContractError(f"needs exactly one quantized {role}, found {len(found)}", contract=name,
                            field="visible_forward.quantize_positions")
    (index, position), = found
    field = f"visible_forward.quantize_positions[{index}]"
    rules = (("format", position.format in _FORMATS, f"one of {', '.join(_FORMATS)}"),
             ("rounding", position.rounding == "rne", "'rne'"),
             ("scale_dtype", position.scale_dtype == "fp32", "'fp32'"),
             ("global_scale", position.global_scale == "none", "'none'"))
    for attr, holds, wanted in rules:
        if not holds:
            raise ContractError(f"an FP8 {role} needs {attr} {wanted}, got {getattr(position, attr)!r}",
                                contract=name, field=f"{field}.{attr}")
    args = _scheme_args(position.scale_granularity)
    if args is None:
        raise ContractError(f"FP8 scales are per_tensor, per_token, per_channel, per_token_group_<g> or "
                            f"block_<rows>x<cols>, got {position.scale_granularity!r}", contract=name,
                            field=f"{field}.scale_granularity")
    handling = contract.trainable.scales.get(position.tensor)
    if handling not in _STATIC:
        raise ContractError(f"the scale of FP8 tensor {position.tensor!r} must be 'stop_gradient' (dynamic) "
                            f"or 'fixed' (static) under the key {position.tensor!r}; got {handling!r} "
                            f"(keys: {sorted(contract.trainable.scales)})",
                            contract=name, field=f"trainable.scales.{position.tensor}")
    granularity, block_shape = args
    try:
        scheme = FP8Scheme(granularity, dtype=_FORMATS[position.format], block_shape=block_shape,
                           static=_STATIC[handling])
    except ValueError as error:
        raise ContractError(str(error), contract=name, field=f"{field}.scale_granularity") from None
    return FP8Position(position.tensor, scheme)

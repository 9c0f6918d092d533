"""The engine ``quantization`` names, as one enum: recipes (``align.quantization``), ``check
--quantization`` and the code take the same strings, which are vLLM's own ``quantization`` values."""
from __future__ import annotations

import enum
from typing import Literal


class Quantization(str, enum.Enum):
    """An engine ``quantization`` value; a member equals (and formats as) its string."""

    #: vLLM's online W8A8 FP8, per output channel (``Fp8PtpcOnlineLinearMethod``); the one quant method
    #: the aligned FP8 linears run (ops/fp8_linear).
    FP8_PER_CHANNEL = "fp8_per_channel"
    #: a compressed-tensors checkpoint's method, read by the engine from the checkpoint's config.
    COMPRESSED_TENSORS = "compressed-tensors"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


#: the quantizations the aligned model builds and trains with: recipes' ``align.quantization`` and
#: ``check --quantization`` accept exactly these
ALIGNED_QUANTIZATIONS: tuple[Quantization, ...] = (Quantization.FP8_PER_CHANNEL,)
#: :data:`ALIGNED_QUANTIZATIONS` as a Literal of their strings, the recipe loader's type
AlignedQuantization = Literal[tuple(q.value for q in ALIGNED_QUANTIZATIONS)]  # type: ignore[misc]

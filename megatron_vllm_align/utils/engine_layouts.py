"""Which engine tensor-parallel layouts a trainer of another size computes (``megatron.engine_layout``).
Light: read by recipe validation and ``check`` before any engine or model library is imported."""
from __future__ import annotations

# Engine tensor-parallel sizes a TP = 1 trainer emulates: at 2, the all-reduce of two partial products is one
# rounding of a + b whatever its order or accumulation dtype; larger sizes would depend on both.
EMULATED_ENGINE_TP = (2,)


def engine_shards_for(engine_tp: int | None, trainer_tp: int) -> int:
    """How many engine shards each vLLM kernel of a trainer at ``trainer_tp`` runs against an engine at
    ``engine_tp`` (None: the trainer's own layout): 1 for the same layout, else the engine's size; ValueError
    naming both sizes where the layout is not emulated."""
    if engine_tp is None or engine_tp == trainer_tp:
        return 1
    if trainer_tp == 1 and engine_tp in EMULATED_ENGINE_TP:
        return engine_tp
    raise ValueError(f"a trainer at TP={trainer_tp} cannot compute the engine's TP={engine_tp} layout: only a TP 1 "
                     f"trainer against an engine at TP {' or '.join(map(str, EMULATED_ENGINE_TP))} is emulated "
                     "(or run the trainer at the engine's size)")

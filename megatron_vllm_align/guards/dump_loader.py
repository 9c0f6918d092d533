"""Read a gradient dump back: every rank's pieces reassembled into full gradients by name."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from megatron_vllm_align.guards.dump_format import (
    GradientDumpError,
    ParamRecord,
    RankIndex,
    read_rank_dump,
    step_dir,
)
from megatron_vllm_align.guards.scaling import GradientScaling

_INDEX_NAME = re.compile(r"rank_(\d{5})\.json")
_STEP_NAME = re.compile(r"step_(\d{8})")
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class GradientDump:
    """Full gradients of one step, by parameter name.

    grads: reassembled gradients (dtype as dumped). records: rank 0's record of each name (the
    first rank holding it), for module class, expert marker, factor and optimizer slot.
    scaling: the factors recorded by rank 0; scaling_by_rank: every rank's, in rank order.
    """

    step: int
    world_size: int
    grads: dict[str, torch.Tensor]
    records: dict[str, ParamRecord]
    scaling: GradientScaling
    scaling_by_rank: list[GradientScaling] = field(default_factory=list)


def available_steps(directory: str | os.PathLike) -> list[int]:
    """Steps that have a step folder under ``directory`` (complete or not)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(directory) if (m := _STEP_NAME.fullmatch(name)))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bitwise equality (NaN payloads and signed zeros included)."""
    as_int = _SAME_SIZE_INT[a.element_size()]
    return a.contiguous().view(as_int) == b.contiguous().view(as_int)


def _target_view(full: torch.Tensor, record: ParamRecord) -> torch.Tensor:
    """The region of ``full`` that a record's piece covers, shaped like the piece."""
    placement = record.placement
    if placement["kind"] == "full":
        return full
    if placement["kind"] == "flat_range":
        return full.view(-1)[placement["start"]:placement["end"]]
    offsets = placement.get("offsets")
    if not isinstance(offsets, list) or len(offsets) != len(record.global_shape):
        raise GradientDumpError(f"parameter {record.name!r}: block offsets {offsets!r} do not match "
                                f"global shape {record.global_shape}")
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, record.local_shape, strict=True))]


def _reassemble(name: str, pieces: list[tuple[int, ParamRecord, torch.Tensor]]) -> torch.Tensor:
    """Put every rank's piece in place; overlapping pieces must agree bitwise, and every
    element must be covered."""
    first = pieces[0][1]
    full = torch.zeros(first.global_shape, dtype=pieces[0][2].dtype)
    covered = torch.zeros(first.global_shape, dtype=torch.bool)
    for rank, record, piece in pieces:
        if record.global_shape != first.global_shape or record.dtype != first.dtype:
            raise GradientDumpError(f"parameter {name!r}: rank {rank} records {record.global_shape} {record.dtype}, "
                                    f"rank {pieces[0][0]} {first.global_shape} {first.dtype}")
        try:
            region, region_covered = _target_view(full, record), _target_view(covered, record)
            if region.shape != piece.shape:
                raise ValueError(f"region {tuple(region.shape)} vs piece {tuple(piece.shape)}")
        except (IndexError, ValueError, RuntimeError) as error:
            raise GradientDumpError(f"parameter {name!r}: rank {rank}'s piece {record.local_shape} at "
                                    f"{record.placement} does not fit {first.global_shape}: {error}") from error
        overlap = region_covered.clone()
        if overlap.any() and not bool(_same_bits(region[overlap], piece[overlap]).all()):
            raise GradientDumpError(f"parameter {name!r}: rank {rank}'s piece differs from another rank's copy "
                                    "of the same elements (replicas disagree: gradient not reduced?)")
        region.copy_(piece)
        region_covered.fill_(True)
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise GradientDumpError(f"parameter {name!r}: {missing} of {covered.numel()} elements are in no rank's piece")
    return full


def load_gradient_dump(directory: str | os.PathLike, step: int) -> GradientDump:
    """Full gradients of ``step`` from every rank's dump under ``directory``.

    Raises GradientDumpError (with the path and what is wrong) when the step is absent, a rank
    of the recorded world size has no index (incomplete dump), an index or tensor file is
    corrupt, or the pieces of a parameter do not tile its global shape.
    """
    folder = step_dir(directory, step)
    if not folder.is_dir():
        raise GradientDumpError(f"no gradient dump of step {step} under {directory} "
                                f"(steps present: {available_steps(directory)})")
    ranks_present = sorted(int(m.group(1)) for name in os.listdir(folder) if (m := _INDEX_NAME.fullmatch(name)))
    if not ranks_present:
        raise GradientDumpError(f"gradient dump {folder} is incomplete: no rank wrote its index")
    indexes: dict[int, RankIndex] = {}
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for rank in ranks_present:
        indexes[rank], tensors[rank] = read_rank_dump(directory, step, rank)
    world_sizes = {index.world_size for index in indexes.values()}
    if len(world_sizes) != 1:
        raise GradientDumpError(f"gradient dump {folder}: ranks disagree on the world size: {sorted(world_sizes)}")
    world_size = world_sizes.pop()
    missing = sorted(set(range(world_size)) - set(ranks_present))
    extra = sorted(set(ranks_present) - set(range(world_size)))
    if missing or extra:
        raise GradientDumpError(f"gradient dump {folder} is incomplete: world size {world_size}, "
                                f"missing ranks {missing}" + (f", unexpected ranks {extra}" if extra else ""))
    pieces: dict[str, list[tuple[int, ParamRecord, torch.Tensor]]] = {}
    for rank in ranks_present:
        for record in indexes[rank].params:
            pieces.setdefault(record.name, []).append((rank, record, tensors[rank][record.key]))
    try:
        scaling_by_rank = [GradientScaling.from_dict(indexes[rank].scaling) for rank in ranks_present]
    except (TypeError, ValueError) as error:
        raise GradientDumpError(f"gradient dump {folder}: bad scaling record: {error}") from error
    return GradientDump(step=step, world_size=world_size,
                        grads={name: _reassemble(name, items) for name, items in pieces.items()},
                        records={name: items[0][1] for name, items in pieces.items()},
                        scaling=scaling_by_rank[0], scaling_by_rank=scaling_by_rank)

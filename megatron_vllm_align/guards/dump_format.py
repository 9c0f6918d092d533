"""On-disk format of a gradient dump: one safetensors file and one JSON index per rank and step.

Layout: ``<directory>/step_<step:08d>/rank_<rank:05d>.safetensors`` holds the rank's local
gradient pieces; ``rank_<rank:05d>.json`` (the index) describes them. Both are written to a
temporary file in the same folder and moved into place with ``os.replace``; the index is
written last, after removing any older index of the same rank and step. So a rank's dump is
complete exactly when its index exists, and a failed write leaves no index and no temporary
file. The index records the tensor file's size, which the reader checks.

Placement of a local piece in its parameter's global tensor (``placement["kind"]``):
``"full"`` (the whole tensor, e.g. replicated under DDP), ``"block"`` (a block starting at
``offsets``: an FSDP2 / DTensor ``Shard(dim)``, mesh and placements recorded for people; or a block of a
Megatron tensor- / expert-parallel shard, dim, group ranks and block count recorded: a gated
``linear_fc1`` shard ``[gate shard; up shard]`` is two blocks, so two records of one rank),
``"flat_range"`` (elements ``[start, end)`` of the flattened tensor: Megatron's distributed
optimizer).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT = "megatron_vllm_align.gradient_dump/1"
PLACEMENT_KINDS = ("full", "block", "flat_range")


class GradientDumpError(RuntimeError):
    """A gradient dump cannot be written, or a dump on disk is incomplete or corrupt."""


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def tensor_path(directory: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(directory, step) / f"rank_{rank:05d}.safetensors"


def index_path(directory: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(directory, step) / f"rank_{rank:05d}.json"


@dataclass(frozen=True)
class ParamRecord:
    """One local gradient piece in a rank's dump.

    name / module_class: the model parameter's qualified name and owning module class.
    key: the tensor's key in the rank's safetensors file.
    optimizer_slot: [optimizer index, group index, position] of the stepped tensor;
    tensor_id: its ``id()`` in the writing process (identity, not a stable key).
    global_shape / local_shape / dtype: of the full gradient and of this piece.
    placement: where the piece sits in the full gradient (module docstring).
    is_expert: Megatron's expert-parallel marker (``param.allreduce is False``).
    grad_factor: the pre-collective factor applied to this gradient (None: unknown).
    """

    name: str
    module_class: str
    key: str
    optimizer_slot: list[int]
    tensor_id: int
    global_shape: list[int]
    local_shape: list[int]
    dtype: str
    placement: dict[str, Any]
    is_expert: bool = False
    grad_factor: float | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ParamRecord:
        """Validate and build; raises GradientDumpError naming ``where`` and the field."""
        if not isinstance(data, dict):
            raise GradientDumpError(f"{where}: a parameter record must be an object, got {type(data).__name__}")
        required = ("name", "module_class", "key", "optimizer_slot", "tensor_id", "global_shape",
                    "local_shape", "dtype", "placement")
        missing = [name for name in required if name not in data]
        if missing:
            raise GradientDumpError(f"{where}: parameter record {data.get('name')!r} lacks fields {missing}")
        try:
            record = cls(**data)
        except TypeError as error:
            raise GradientDumpError(f"{where}: parameter record {data.get('name')!r}: {error}") from error
        for shape_field in ("global_shape", "local_shape", "optimizer_slot"):
            value = getattr(record, shape_field)
            if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
                raise GradientDumpError(f"{where}: parameter {record.name!r} field {shape_field!r} must be a "
                                        f"list of non-negative integers, got {value!r}")
        kind = record.placement.get("kind") if isinstance(record.placement, dict) else None
        if kind not in PLACEMENT_KINDS:
            raise GradientDumpError(f"{where}: parameter {record.name!r} has placement kind {kind!r}, "
                                    f"expected one of {PLACEMENT_KINDS}")
        return record


@dataclass(frozen=True)
class RankIndex:
    """The JSON index of one rank's dump at one step."""

    step: int
    rank: int
    world_size: int
    tensor_file: str
    tensor_file_bytes: int
    scaling: dict[str, Any]
    params: list[ParamRecord] = field(default_factory=list)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_file(cls, path: Path) -> RankIndex:
        """Read and validate an index; raises GradientDumpError naming the file and the field."""
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise GradientDumpError(f"gradient dump index {path} is unreadable or corrupt: {error}") from error
        if not isinstance(data, dict):
            raise GradientDumpError(f"gradient dump index {path}: expected a JSON object")
        if data.get("format") != FORMAT:
            raise GradientDumpError(f"gradient dump index {path}: format {data.get('format')!r}, expected {FORMAT!r}")
        for name, kind in (("step", int), ("rank", int), ("world_size", int), ("tensor_file", str),
                           ("tensor_file_bytes", int), ("scaling", dict), ("params", list)):
            if not isinstance(data.get(name), kind):
                raise GradientDumpError(f"gradient dump index {path}: field {name!r} missing or not {kind.__name__}")
        params = [ParamRecord.from_dict(item, f"gradient dump index {path}") for item in data["params"]]
        return cls(step=data["step"], rank=data["rank"], world_size=data["world_size"],
                   tensor_file=data["tensor_file"], tensor_file_bytes=data["tensor_file_bytes"],
                   scaling=data["scaling"], params=params)


def _atomic_write(path: Path, write: Any) -> None:
    """``write(temporary_path)``, then move it to ``path``; the temporary file never survives."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def write_rank_dump(directory: str | os.PathLike, step: int, rank: int, world_size: int,
                    tensors: dict[str, torch.Tensor], params: list[ParamRecord],
                    scaling: dict[str, Any]) -> Path:
    """Write one rank's pieces and index atomically (index last); return the index path.

    Raises GradientDumpError (naming the path) when anything cannot be written; then no index
    of this rank and step exists.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    index = index_path(directory, step, rank)
    tensors_file = tensor_path(directory, step, rank)
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        if index.exists() or index.is_symlink():
            index.unlink()
        _atomic_write(tensors_file, lambda tmp: save_file(tensors, tmp))
        rank_index = RankIndex(step=step, rank=rank, world_size=world_size, tensor_file=tensors_file.name,
                               tensor_file_bytes=tensors_file.stat().st_size, scaling=scaling, params=params)
        _atomic_write(index, lambda tmp: Path(tmp).write_text(rank_index.to_json()))
    except (OSError, SafetensorError) as error:
        raise GradientDumpError(f"cannot write the gradient dump of rank {rank}, step {step} "
                                f"under {Path(directory)}: {error}") from error
    return index


def read_rank_dump(directory: str | os.PathLike, step: int, rank: int) -> tuple[RankIndex, dict[str, torch.Tensor]]:
    """One rank's index and pieces, checked against each other; raises GradientDumpError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = index_path(directory, step, rank)
    index = RankIndex.from_file(path)
    if (index.step, index.rank) != (step, rank):
        raise GradientDumpError(f"gradient dump index {path} says step {index.step}, rank {index.rank}")
    tensors_file = path.parent / index.tensor_file
    size = tensors_file.stat().st_size if tensors_file.exists() else None
    if size != index.tensor_file_bytes:
        raise GradientDumpError(f"gradient dump {tensors_file}: expected {index.tensor_file_bytes} bytes "
                                f"as its index says, found {'no file' if size is None else f'{size} bytes'}")
    try:
        tensors = load_file(str(tensors_file))
    except (SafetensorError, OSError) as error:
        raise GradientDumpError(f"gradient dump {tensors_file} is corrupt: {error}") from error
    for record in index.params:
        tensor = tensors.get(record.key)
        if tensor is None:
            raise GradientDumpError(f"gradient dump {tensors_file} lacks tensor {record.key!r} of {record.name!r}")
        if list(tensor.shape) != record.local_shape or str(tensor.dtype) != record.dtype:
            raise GradientDumpError(f"gradient dump {tensors_file}: {record.name!r} is {tuple(tensor.shape)} "
                                    f"{tensor.dtype}, its index says {tuple(record.local_shape)} {record.dtype}")
    return index, tensors

"""Training checkpoints: model, optimizer (inner state and the fp32 main copies, see
:mod:`.main_params`), every rank's RNG state, data-order state, run history.

Layout: ``<dir>/state.pt`` (torch.save of the tensors and states) and ``<dir>/meta.json`` (step,
the recipe fields the checkpoint must fit, parameter shapes, tensor parallel size). At tensor parallel
size T > 1 each tensor-parallel rank's shard (its parameters and optimizer state, expert-parallel ones
included) is ``<dir>/state_tp<r>.pt``, written by that rank; a run resumes at the same T. An FSDP2-sharded
model (``parallel.fsdp``) writes one file per rank, ``<dir>/state_rank<r>.pt``: the local shards of its
parameters, main copies and optimizer state, restored as DTensors of the same placement on resume (same world
size). Everything is
written into a temporary sibling directory that rank 0 renames into place once every file is complete,
so a checkpoint directory is either complete or absent (a rank that fails to write fails the save on
every rank). Data-parallel replicas hold the same weights, so one copy (data-parallel rank 0's) is saved;
the RNG states of all ranks are gathered. Loading restores the exact bytes, so a resumed run continues
bitwise identically to an uninterrupted one (tested at TP 1 and TP 2).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from megatron_vllm_align.ops.refresh import refresh_deployed_weights
from megatron_vllm_align.train.main_params import MAIN_PARAMS_KEY, MainParamsOptimizer
from megatron_vllm_align.utils.atomic_io import atomic_write, atomic_write_text
from megatron_vllm_align.utils.dtensors import is_dtensor, local_part

FORMAT_VERSION = 2  # 2: the optimizer state holds the fp32 main copies


class CheckpointError(ValueError):
    """A checkpoint that is incomplete or does not fit the run; the message says which field."""


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _gathered_rng_states() -> list[dict[str, Any]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [_rng_state()]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, _rng_state())
    return states


def _shard_of_this_rank() -> tuple[int, int, bool]:
    """(tensor parallel size T, this rank's tensor-parallel rank, whether it writes its shard: data-parallel
    rank 0 does)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, not dist.is_initialized() or dist.get_rank() == 0
    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank() == 0)


def state_file(tensor_parallel_size: int, tensor_parallel_rank: int) -> str:
    """The state file of one shard: ``state.pt`` at T = 1, ``state_tp<r>.pt`` above."""
    return "state.pt" if tensor_parallel_size == 1 else f"state_tp{tensor_parallel_rank}.pt"


def _fully_sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def _local_tensors(state: Any) -> Any:
    """``state`` (nested dicts / lists) with every DTensor replaced by its local shard (a copy)."""
    if is_dtensor(state):
        return state.to_local().clone()
    if isinstance(state, dict):
        return {key: _local_tensors(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_local_tensors(value) for value in state)
    return state


def _sharded_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor of ``like``'s mesh, placements, shape and stride (``like`` a DTensor)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def _resharded_optimizer_state(state: dict[str, Any], optimizer: MainParamsOptimizer) -> dict[str, Any]:
    """A saved optimizer state of local shards (:func:`_local_tensors`) as DTensors placed like each stepped
    tensor: its main copy and every per-parameter state tensor of the stepped tensor's shape."""
    state = dict(state)
    stepped = optimizer.stepped
    state[MAIN_PARAMS_KEY] = {i: _sharded_like(t, stepped[i]) if is_dtensor(stepped[i]) else t
                              for i, t in state.get(MAIN_PARAMS_KEY, {}).items()}
    per_param = {}
    for index, entries in state["state"].items():
        like = stepped[index]
        per_param[index] = {key: _sharded_like(value, like) if is_dtensor(like) and torch.is_tensor(value)
                            and value.shape == like.to_local().shape and value.dim() > 0 else value
                            for key, value in entries.items()}
    state["state"] = per_param
    return state


def _errors_of_every_rank(error: BaseException | None) -> list[str]:
    """The errors of every rank (all ranks call it; one process: its own)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    return [f"rank {rank}: {message}" for rank, message in enumerate(gathered) if message is not None]


def _parameter_layout(model: nn.Module) -> dict[str, list]:
    return {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in model.named_parameters()}


def save_checkpoint(directory: str | os.PathLike, *, model: nn.Module, optimizer: MainParamsOptimizer,
                    step: int, fit: dict[str, Any], history: dict[str, Any], data_state: dict[str, Any]) -> Path:
    """Write the checkpoint of the state after optimizer step `step` to `directory` (collective:
    every rank calls it; data-parallel rank 0 of each tensor-parallel rank writes its shard, rank 0 the
    meta file). CheckpointError on every rank, nothing left behind, when a rank cannot write. `fit` is the
    flat mapping of recipe keys the resuming run must match; `history` is the run's record so far (per-step
    metrics). An existing `directory` is replaced whole."""
    directory = Path(directory)
    rng_states = _gathered_rng_states()
    tensor_parallel_size, tensor_parallel_rank, writes = _shard_of_this_rank()
    sharded = _fully_sharded(model)
    name = f"state_rank{dist.get_rank()}.pt" if sharded else state_file(tensor_parallel_size, tensor_parallel_rank)
    writes = writes or sharded
    main = not dist.is_initialized() or dist.get_rank() == 0
    staging: list[Any] = [None]
    if main:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging[0] = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(staging, src=0)
    staging_dir: Path = staging[0]
    error = None
    if writes:
        try:
            state = {
                "model": {name: p.detach().clone() for name, p in model.named_parameters()},
                "optimizer": optimizer.state_dict(),
                "rng": rng_states,
                "history": history,
                "data_state": data_state,
            }
            if sharded:
                state = _local_tensors(state)
            atomic_write(staging_dir / name, lambda stream: torch.save(state, stream), binary=True,
                         what="checkpoint state")
        except Exception as failure:  # reported to every rank below
            error = failure
    errors = _errors_of_every_rank(error)
    try:
        if errors:
            raise CheckpointError(f"checkpoint {str(directory)!r} not written: {'; '.join(errors)}")
        if main:
            meta = {"format_version": FORMAT_VERSION, "step": step, "fit": fit, "parameters": _parameter_layout(model),
                    "world_size": len(rng_states), "tensor_parallel_size": tensor_parallel_size,
                    "fully_sharded": sharded}
            atomic_write_text(staging_dir / "meta.json", json.dumps(meta, indent=1), what="checkpoint meta")
            if directory.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".old", dir=directory.parent))
                os.replace(directory, trash / directory.name)
                os.replace(staging_dir, directory)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(staging_dir, directory)
    except BaseException:
        if main:
            shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    finally:
        if dist.is_initialized():
            dist.barrier()
    return directory


def _check_fit(directory: Path, meta: dict, fit: dict[str, Any], model: nn.Module, world_size: int) -> None:
    for key in sorted(set(fit) | set(meta["fit"])):
        saved, wanted = meta["fit"].get(key, "<absent>"), fit.get(key, "<absent>")
        if saved != wanted:
            raise CheckpointError(f"checkpoint {str(directory)!r} does not fit this run: {key} is {saved!r} in the "
                                  f"checkpoint and {wanted!r} in the recipe")
    if meta["world_size"] != world_size:
        raise CheckpointError(f"checkpoint {str(directory)!r} does not fit this run: it was saved by "
                              f"{meta['world_size']} rank(s), this run has {world_size} (RNG and reduction order "
                              "would differ)")
    layout = _parameter_layout(model)
    for name in sorted(set(layout) | set(meta["parameters"])):
        saved, wanted = meta["parameters"].get(name, "<absent>"), layout.get(name, "<absent>")
        if saved != wanted:
            raise CheckpointError(f"checkpoint {str(directory)!r} does not fit the model: parameter {name!r} is "
                                  f"{saved} (shape, dtype) in the checkpoint and {wanted} in the model")


def load_checkpoint(directory: str | os.PathLike, *, model: nn.Module, optimizer: MainParamsOptimizer,
                    fit: dict[str, Any], world_size: int, rank: int) -> dict[str, Any]:
    """Restore `model`, `optimizer` (inner state and main copies) and this rank's RNG from
    `directory`; refresh the deployed values. Returns ``{"step", "history", "data_state"}``. CheckpointError (nothing
    loaded) when the directory is no complete checkpoint or does not fit (`fit` keys, world size, parameters)."""
    directory = Path(directory)
    tensor_parallel_size, tensor_parallel_rank, _ = _shard_of_this_rank()
    sharded = _fully_sharded(model)
    meta_path = directory / "meta.json"
    state_path = directory / (f"state_rank{rank}.pt" if sharded else state_file(tensor_parallel_size,
                                                                               tensor_parallel_rank))
    incomplete = CheckpointError(f"{str(directory)!r} is not a complete checkpoint (needs meta.json and "
                                 f"{state_path.name})")
    if not meta_path.is_file():
        raise incomplete
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(directory)!r}: format_version {meta.get('format_version')!r}, "
                              f"expected {FORMAT_VERSION}")
    saved_tp = meta.get("tensor_parallel_size", 1)
    if saved_tp != tensor_parallel_size:
        raise CheckpointError(f"checkpoint {str(directory)!r} does not fit this run: it holds tensor parallel size "
                              f"{saved_tp} shards, this run has parallel.tensor_model_parallel_size="
                              f"{tensor_parallel_size}")
    if meta.get("fully_sharded", False) != sharded:
        raise CheckpointError(f"checkpoint {str(directory)!r} does not fit this run: it holds "
                              f"{'FSDP2 shards' if meta.get('fully_sharded') else 'unsharded tensors'}, this run has "
                              f"parallel.fsdp={str(sharded).lower()}")
    if not state_path.is_file():
        raise incomplete
    _check_fit(directory, meta, fit, model, world_size)
    state = torch.load(state_path, weights_only=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local_part(param).copy_(state["model"][name])
    optimizer.load_state_dict(_resharded_optimizer_state(state["optimizer"], optimizer) if sharded else
                              state["optimizer"])
    rng = state["rng"][rank]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if not sharded:   # a sharded model redeploys at every forward
        refresh_deployed_weights(model)
    return {"step": meta["step"], "history": state["history"], "data_state": state["data_state"]}

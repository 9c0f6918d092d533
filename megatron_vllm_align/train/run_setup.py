"""What every recipe run (SFT, layer 3) sets up: the run directory, the initial checkpoint, the
model of each arm, the logprob function, each step's batch and the progress bar."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from megatron_vllm_align.train.config import Recipe, dump_recipe, to_dict
from megatron_vllm_align.train.data import SFTExample, Splits, batch_indices, build_splits, jsonl_splits, rank_slice
from megatron_vllm_align.train.distributed import DistEnv, barrier
from megatron_vllm_align.utils.atomic_io import atomic_write_text

T = TypeVar("T")


def _flatten(data: dict, prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def checkpoint_fit(recipe: Recipe) -> dict[str, Any]:
    """The recipe keys a checkpoint must match to be resumed (model, align, data, the RL section,
    batch, seed, the main-params policy)."""
    sections = {"model": to_dict(recipe.model), "align": to_dict(recipe.align), "data": to_dict(recipe.data)}
    if recipe.rl is not None:
        sections["rl"] = to_dict(recipe.rl)
    fit = _flatten(sections, "")
    fit.update({"train.global_batch_size": recipe.train.global_batch_size, "train.seed": recipe.train.seed,
                "optimizer.main_params_dtype": recipe.optimizer.main_params_dtype})
    return fit


def initial_checkpoint(recipe: Recipe, run_dir: Path, env: DistEnv) -> Path:
    """The HF directory of the initial weights; source "tiny" builds it once (rank 0) into
    ``run_dir/initial_model`` (written atomically, reused when present)."""
    if recipe.model.source == "hf":
        return Path(recipe.model.path)
    target = run_dir / "initial_model"
    if env.is_main and not target.exists():
        from megatron_vllm_align.engine.tiny_models import build_tiny_hf_model

        build_tiny_hf_model(target, recipe.model.tiny)
    barrier()
    return target


def build_model(recipe: Recipe, checkpoint_dir: Path, align: bool) -> nn.Module:
    """The GPTModel of `checkpoint_dir`: vLLM-forward (align) or Megatron's local spec; sharded by FSDP2 over
    every rank with ``parallel.fsdp`` (collective then)."""
    from megatron_vllm_align.megatron.build import build_gpt_from_hf

    model = build_gpt_from_hf(checkpoint_dir, align=align, params_dtype=getattr(torch, recipe.model.params_dtype),
                              quantization=recipe.align.quantization if align else None,
                              engine_tensor_parallel_size=recipe.align.engine_tensor_parallel_size if align else None)
    if recipe.parallel.fsdp:
        from megatron_vllm_align.megatron.fsdp2 import shard_for_training

        shard_for_training(model)
    return model


def in_recipe_backward_precision(run: Callable[[Recipe], T]) -> Callable[[Recipe], T]:
    """``run(recipe)`` with the aligned linears' backward in ``align.backward_precision`` for its whole
    duration (``ops.dense_linear.vjp.backward_precision``), the previous precision restored after it."""
    from megatron_vllm_align.ops.dense_linear.vjp import backward_precision

    @functools.wraps(run)
    def wrapped(recipe: Recipe) -> T:
        with backward_precision(recipe.align.backward_precision):
            return run(recipe)
    return wrapped


def recipe_splits(recipe: Recipe, checkpoint_dir: Path, vocab_size: int) -> Splits:
    """The run's train and validation examples: ``data.jsonl`` tokenised with the checkpoint's
    tokenizer, else the generated arithmetic corpus (``train.data``)."""
    data = recipe.data
    if data.jsonl is not None:
        return jsonl_splits(data.jsonl, data.text_field, checkpoint_dir, data.num_train, data.num_validation,
                            data.max_length, vocab_size)
    return build_splits(data.num_train, data.num_validation, data.seed, vocab_size)


def export_trained(recipe: Recipe, model: nn.Module, checkpoint_dir: Path, run_dir: Path, env: DistEnv) -> str | None:
    """``train.export_dir`` written from ``model`` by rank 0 (``megatron.hf_export``; collective: the full
    tensors are gathered from the tensor-parallel shards); its path, or None."""
    if recipe.train.export_dir is None:
        return None
    from megatron_vllm_align.megatron.hf_export import export_hf_checkpoint

    target = run_dir / recipe.train.export_dir
    export_hf_checkpoint(model, checkpoint_dir, target, max_shard_bytes=recipe.train.export_shard_mb * 1024 ** 2,
                         write=env.is_main)
    barrier()
    return str(target)


def model_logprobs(model: nn.Module):
    """The model's per-token logprobs (the engine's definition), as a :data:`LogprobsFn`."""
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    return lambda token_rows: token_logprobs(model, token_rows)


def step_batch(splits: Splits, step: int, recipe: Recipe, env: DistEnv) -> tuple[list[SFTExample], int, int]:
    """This rank's examples of `step` (its data-parallel replica's share; tensor-parallel ranks of one
    replica get the same), and the global batch's token and masked-token counts."""
    indices = batch_indices(step, recipe.train.global_batch_size, len(splits.train), recipe.data.seed)
    everything = [splits.train[i] for i in indices]
    local = [splits.train[i] for i in rank_slice(indices, env.data_parallel_rank, env.data_parallel_size)]
    tokens = sum(example.tokens.numel() for example in everything)
    loss_tokens = sum(int(example.loss_mask.sum()) for example in everything)
    return local, tokens, loss_tokens


def progress_bar(recipe: Recipe, env: DistEnv, start: int, label: str):
    """tqdm over the run's steps, shown on rank 0 when ``train.progress_bar``, on stdout (the console
    while the engine and library logs go to a file, ``utils.console``)."""
    from tqdm import tqdm

    return tqdm(total=recipe.train.steps, initial=start, desc=label, unit="step", file=sys.stdout,
                disable=not (env.is_main and recipe.train.progress_bar))


def prepare_run_dir(recipe: Recipe, env: DistEnv, result_name: str) -> Path:
    """Create the run directory, write the resolved recipe, delete a stale result file."""
    run_dir = Path(recipe.train.run_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / result_name).unlink(missing_ok=True)
        atomic_write_text(run_dir / "recipe.yaml", dump_recipe(recipe), what="resolved recipe")
    barrier()
    return run_dir

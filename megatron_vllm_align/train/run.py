"""A plain SFT run from a recipe: model (aligned or native by ``align.enabled``), data, guards,
the loop with its progress bar, checkpoints, and the metrics file.

Run directory (``train.run_dir``): ``recipe.yaml`` (the resolved recipe), ``initial_model/``
(source "tiny"), ``checkpoints/step_<N>/``, ``gradient_dumps/`` (if enabled) and, written last,
``metrics.json``: ``{"kind": "sft", "status": "complete", "arms": {<arm>: [per-step dicts]},
"val_nll_initial", "world_size", "align_enabled", "checkpoints"}`` (per-step keys: see
:mod:`.trainer`). A stale ``metrics.json`` is deleted when a run starts, so a run that fails
leaves no file that looks complete.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from megatron_vllm_align.train.checkpoint import load_checkpoint, save_checkpoint
from megatron_vllm_align.train.config import Recipe
from megatron_vllm_align.train.data import build_splits
from megatron_vllm_align.train.distributed import barrier, init_distributed
from megatron_vllm_align.train.run_setup import (
    build_model,
    checkpoint_fit,
    initial_checkpoint,
    model_logprobs,
    prepare_run_dir,
    progress_bar,
    step_batch,
)
from megatron_vllm_align.train.trainer import Trainer
from megatron_vllm_align.utils.atomic_io import atomic_write_text


class GuardError(RuntimeError):
    """A training guard found a problem before training started."""


def install_guards(recipe: Recipe, trainer: Trainer, run_dir: Path, start_step: int) -> contextlib.ExitStack:
    """Wire ``recipe.guards`` to :mod:`megatron_vllm_align.guards`; the returned stack removes hooks."""
    from megatron_vllm_align.guards import GradientDumper, check_optimizer_identity, validate_freeze

    stack = contextlib.ExitStack()
    guards = recipe.guards
    if guards.optimizer_identity:
        findings = check_optimizer_identity(trainer.model, trainer.optimizer)
        if findings:
            raise GuardError("guards.optimizer_identity: " + "; ".join(str(f) for f in findings))
    if guards.freeze:
        trainer.step_guard = lambda: validate_freeze(trainer.model, trainer.optimizer, guards.freeze)
    if guards.gradient_dump_every:
        dumper = stack.enter_context(GradientDumper(trainer.optimizer, run_dir / "gradient_dumps",
                                                    guards.gradient_dump_every, model=trainer.model))
        dumper.next_step = start_step
    return stack


def run_sft(recipe: Recipe) -> dict[str, Any]:
    """Train per `recipe` (every rank calls it); returns the result written to metrics.json."""
    env = init_distributed(recipe.train.seed)
    run_dir = prepare_run_dir(recipe, env, "metrics.json")
    checkpoint_dir = initial_checkpoint(recipe, run_dir, env)
    align = recipe.align.enabled
    model = build_model(recipe, checkpoint_dir, align)
    splits = build_splits(recipe.data.num_train, recipe.data.num_validation, recipe.data.seed,
                          model.vocab_size)
    trainer = Trainer(model, model_logprobs(model), recipe.optimizer, total_steps=recipe.train.steps,
                      world_size=env.world_size, frozen=recipe.guards.freeze)
    fit = checkpoint_fit(recipe)
    history: dict[str, Any] = {"steps": [], "val_nll_initial": None}
    start = 0
    if recipe.train.resume_from:
        resumed = load_checkpoint(recipe.train.resume_from, model=model, optimizer=trainer.optimizer, fit=fit,
                                  world_size=env.world_size, rank=env.rank)
        start, history = resumed["step"], resumed["history"]
    else:
        history["val_nll_initial"] = trainer.evaluate(splits.validation)
    saved: list[str] = []
    with install_guards(recipe, trainer, run_dir, start), progress_bar(recipe, env, start, "sft") as bar:
        for step in range(start + 1, recipe.train.steps + 1):
            examples, tokens, loss_tokens = step_batch(splits, step, recipe, env)
            metrics = trainer.train_step(step, examples, tokens, loss_tokens)
            if step % recipe.train.eval_every == 0 or step == recipe.train.steps:
                metrics["val_nll"] = trainer.evaluate(splits.validation)
            history["steps"].append(metrics)
            bar.set_postfix(loss=f"{metrics['train_loss']:.4f}")
            bar.update(1)
            every = recipe.train.save_every
            if every and (step % every == 0 or step == recipe.train.steps):
                data_state = {"seed": recipe.data.seed, "consumed": step * recipe.train.global_batch_size}
                saved.append(str(save_checkpoint(run_dir / "checkpoints" / f"step_{step:06d}", model=model,
                                                 optimizer=trainer.optimizer, step=step, fit=fit, history=history,
                                                 data_state=data_state)))
    result = {"kind": "sft", "status": "complete", "align_enabled": align, "world_size": env.world_size,
              "val_nll_initial": history["val_nll_initial"], "resumed_from": recipe.train.resume_from,
              "checkpoints": saved, "arms": {"aligned" if align else "native": history["steps"]}}
    if env.is_main:
        atomic_write_text(run_dir / "metrics.json", json.dumps(result, indent=1), what="metrics")
    barrier()
    return result

"""A plain SFT run from a recipe: model (aligned or native by ``align.enabled``), data, guards,
the loop with its progress bar, checkpoints, and the metrics file.

Run directory (``train.run_dir``): ``recipe.yaml`` (the resolved recipe), ``initial_model/``
(source "tiny"), ``checkpoints/step_<N>/``, ``gradient_dumps/`` (if enabled), ``tensorboard/`` (rank 0:
training scalars, gradient norms per module and layer, contracts, guards; docs/panels.md),
``layer2.md`` (with a ``layer2`` section, :mod:`.layer2`), the Hugging Face export
(``train.export_dir``, if set) and, written last, ``metrics.json``: ``{"kind": "sft",
"status": "complete", "arms": {<arm>: [per-step dicts]}, "val_nll_initial", "world_size",
"tensor_parallel_size", "expert_parallel_size", "fsdp", "align_enabled", "backward_precision" (the aligned
linears' backward, ``align.backward_precision``; None for a native run), "checkpoints", "export", "layer2" (with a
layer2 section: per measured step the rows of ``validation.layer2.Layer2Result.to_dict``)}`` (per-step keys: see
:mod:`.trainer`). A stale ``metrics.json`` is deleted when a run starts, so a run that fails
leaves no file that looks complete.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from megatron_vllm_align.ops.dense_linear.vjp import current_backward_precision
from megatron_vllm_align.train.checkpoint import load_checkpoint, save_checkpoint
from megatron_vllm_align.train.config import Recipe
from megatron_vllm_align.train.distributed import barrier, init_distributed
from megatron_vllm_align.train.panels import TrainingPanels
from megatron_vllm_align.train.run_setup import (
    build_model,
    checkpoint_fit,
    export_trained,
    in_recipe_backward_precision,
    initial_checkpoint,
    model_logprobs,
    prepare_run_dir,
    progress_bar,
    recipe_splits,
    step_batch,
)
from megatron_vllm_align.train.trainer import Trainer
from megatron_vllm_align.utils.atomic_io import atomic_write_text


class GuardError(RuntimeError):
    """A training guard found a problem before training started."""


class InstalledGuards(contextlib.ExitStack):
    """The guards of a run (a context manager that removes their hooks) and what they found:
    ``identity_findings`` (None: not checked), the ``frozen`` names checked at every step (a
    violation raises), the ``dumper`` (None: no dumps)."""

    def __init__(self) -> None:
        super().__init__()
        self.identity_findings: int | None = None
        self.frozen: list[str] = []
        self.dumper: Any = None

    def summary(self) -> str:
        """Markdown: which guards run and what they found so far."""
        identity = ("not checked (guards.optimizer_identity: false)" if self.identity_findings is None else
                    f"checked before the first step: {self.identity_findings} findings")
        frozen = (f"{len(self.frozen)} parameters ({', '.join(f'`{n}`' for n in self.frozen)}) checked bitwise "
                  "unchanged around every optimizer step" if self.frozen else "none declared (guards.freeze: [])")
        dumps = ("off (guards.gradient_dump_every: 0)" if self.dumper is None else
                 f"every {self.dumper.every} optimizer steps into `gradient_dumps/`, where the optimizer sees them")
        return f"- optimizer identity: {identity}\n- freeze: {frozen}\n- gradient dumps: {dumps}\n"

    def frozen_unchanged(self, step: int) -> int | None:
        """Frozen parameters verified unchanged over 1-based ``step`` (None: no freeze declared)."""
        return len(self.frozen) if self.frozen else None

    def dumped(self, step: int) -> bool | None:
        """Whether 1-based ``step``'s gradients were dumped (the dumper counts steps from 0)."""
        return None if self.dumper is None else (step - 1) in self.dumper.dumped_steps


def install_guards(recipe: Recipe, trainer: Trainer, run_dir: Path, start_step: int) -> InstalledGuards:
    """Wire ``recipe.guards`` to :mod:`megatron_vllm_align.guards`; the returned stack removes hooks."""
    from megatron_vllm_align.guards import GradientDumper, check_optimizer_identity, validate_freeze

    stack = InstalledGuards()
    guards = recipe.guards
    if guards.optimizer_identity:
        findings = check_optimizer_identity(trainer.model, trainer.optimizer)
        if findings:
            raise GuardError("guards.optimizer_identity: " + "; ".join(str(f) for f in findings))
        stack.identity_findings = len(findings)
    if guards.freeze:
        trainer.step_guard = lambda: validate_freeze(trainer.model, trainer.optimizer, guards.freeze)
        stack.frozen = list(guards.freeze)
    if guards.gradient_dump_every:
        dumper = stack.enter_context(GradientDumper(trainer.optimizer, run_dir / "gradient_dumps",
                                                    guards.gradient_dump_every, model=trainer.model))
        dumper.next_step = start_step
        stack.dumper = dumper
    return stack


@in_recipe_backward_precision
def run_sft(recipe: Recipe) -> dict[str, Any]:
    """Train per `recipe` (every rank calls it); returns the result written to metrics.json."""
    env = init_distributed(recipe.train.seed, recipe.parallel.tensor_model_parallel_size,
                           recipe.parallel.expert_model_parallel_size)
    run_dir = prepare_run_dir(recipe, env, "metrics.json")
    checkpoint_dir = initial_checkpoint(recipe, run_dir, env)
    align = recipe.align.enabled
    model = build_model(recipe, checkpoint_dir, align)
    splits = recipe_splits(recipe, checkpoint_dir, model.vocab_size)
    trainer = Trainer(model, model_logprobs(model), recipe.optimizer, total_steps=recipe.train.steps,
                      world_size=env.data_parallel_size, data_parallel_group=env.data_parallel_group(),
                      frozen=recipe.guards.freeze)
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
    layer2 = None
    if recipe.layer2 is not None:
        from megatron_vllm_align.train.layer2 import Layer2Hook

        layer2 = Layer2Hook(model, recipe.layer2, run_dir, is_main=env.is_main,
                            data_parallel_group=env.data_parallel_group())
    panels = TrainingPanels(run_dir, env.is_main)
    with install_guards(recipe, trainer, run_dir, start) as guards, progress_bar(recipe, env, start, "sft") as bar, \
            contextlib.closing(panels):
        panels.start(model, guards)
        for step in range(start + 1, recipe.train.steps + 1):
            examples, tokens, loss_tokens = step_batch(splits, step, recipe, env)
            with layer2.capture(step) if layer2 is not None else contextlib.nullcontext():
                trainer.forward_backward(examples, loss_tokens)
            if layer2 is not None:   # between the backward and the update: the captured tensors are the
                # step's own (no copies) and are freed before the optimizer allocates
                measuring = time.perf_counter()
                layer2.after_step(step, panels.writer, f"the step's {recipe.train.global_batch_size} sequences "
                                  f"({env.data_parallel_size} data-parallel x {env.tensor_parallel_size} "
                                  "tensor-parallel ranks)")
                trainer.exclude_from_timing(time.perf_counter() - measuring)
            metrics = trainer.apply_update(step, tokens, loss_tokens)
            if step % recipe.train.eval_every == 0 or step == recipe.train.steps:
                metrics["val_nll"] = trainer.evaluate(splits.validation)
            panels.step(metrics, trainer.last_grad_squares, guards)
            history["steps"].append(metrics)
            bar.set_postfix(loss=f"{metrics['train_loss']:.4f}")
            bar.update(1)
            every = recipe.train.save_every
            if every and (step % every == 0 or step == recipe.train.steps):
                data_state = {"seed": recipe.data.seed, "consumed": step * recipe.train.global_batch_size}
                saved.append(str(save_checkpoint(run_dir / "checkpoints" / f"step_{step:06d}", model=model,
                                                 optimizer=trainer.optimizer, step=step, fit=fit, history=history,
                                                 data_state=data_state)))
    result = {"kind": "sft", "status": "complete", "align_enabled": align,
              "backward_precision": current_backward_precision() if align else None, "world_size": env.world_size,
              "tensor_parallel_size": env.tensor_parallel_size, "expert_parallel_size": env.expert_parallel_size,
              "fsdp": recipe.parallel.fsdp,
              "val_nll_initial": history["val_nll_initial"], "resumed_from": recipe.train.resume_from,
              "checkpoints": saved, "export": export_trained(recipe, model, checkpoint_dir, run_dir, env),
              "arms": {"aligned" if align else "native": history["steps"]}}
    if layer2 is not None:
        result["layer2"] = layer2.to_json()
    if env.is_main:
        atomic_write_text(run_dir / "metrics.json", json.dumps(result, indent=1), what="metrics")
    barrier()
    return result

"""An on-policy GRPO run from a recipe with an ``rl`` section (``python -m megatron_vllm_align.train``).

Every rank runs :func:`run_grpo`; rank 0 hosts the engine (``rl.engine``: ``in_process``,
:class:`.rollout.RolloutEngine`, or ``server``, :class:`.server_engine.ServerRolloutEngine`, log
``engine_server.log``). Each step: the engine samples ``rl.group_size`` completions of each of
``rl.prompts_per_step`` prompts (``rl.sampling``: one ``vllm.SamplingParams``, request seed
:func:`request_seed`; the engine returns the processed logprobs of the sampled tokens, and their raw
ones as its prompt logprobs), ``rl.reward`` scores them, rewards are normalised per group and the
rollouts broadcast (each data-parallel rank trains on its contiguous slice; ``parallel``: tensor parallel
with an engine of the same size, or FSDP2, whose TP 1 trainer may compute a TP 2 engine's shards,
``align.engine_tensor_parallel_size``); the trainer takes the GRPO step
(:mod:`.grpo`) on its processed logprobs of the sampled tokens, under the same SamplingParams (MoE,
``in_process`` only: the routers replay the engine's experts); rank 0 pushes the new weights into the
engine. With the guard on (aligned arm, ``rl.invariant``, ``rl.guard``) any logprob difference, and for
the aligned arm any probe-prompt difference after a push (every ``rl.sync_check_every`` steps), stops
the run (the guard's before the update) with :class:`OnPolicyMismatch` naming the step, the sequence and
the first divergent block. Outputs (``rollouts/``, ``tensorboard/``, ``summary.json`` last):
docs/rl.md#run-directory-rlrunpy; the loop: docs/usage.md#grpo.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_vllm_align import invariance
from megatron_vllm_align.megatron.hf_checkpoint import read_hf_config
from megatron_vllm_align.ops.dense_linear.vjp import current_backward_precision
from megatron_vllm_align.rl.grpo import RatioStats, grpo_loss_sum
from megatron_vllm_align.rl.rewards import REWARDS, Problem, group_advantages
from megatron_vllm_align.rl.rollout import (
    Rollout,
    RolloutEngine,
    broadcast_rollouts,
    engine_weights,
    replayed_logprobs,
    sampling_params,
)
from megatron_vllm_align.train.checkpoint import load_checkpoint, save_checkpoint
from megatron_vllm_align.train.config import Recipe, RecipeError, check_world_size, to_dict
from megatron_vllm_align.train.data import ByteTokenizer, arithmetic_pairs, batch_indices, rank_slice
from megatron_vllm_align.train.distributed import DistEnv, barrier, init_distributed
from megatron_vllm_align.train.run_setup import (
    build_model,
    checkpoint_fit,
    export_trained,
    in_recipe_backward_precision,
    initial_checkpoint,
    prepare_run_dir,
    progress_bar,
)
from megatron_vllm_align.train.trainer import Trainer
from megatron_vllm_align.utils.atomic_io import atomic_write_text
from megatron_vllm_align.validation.logprob_mismatch import logprob_mismatch

ENGINE_RANK = 0


class OnPolicyMismatch(RuntimeError):
    """The aligned trainer's logprob of a sampled token, or of a probe prompt after a weight sync,
    differs from the engine's; the message names the step, the sequence and the first divergent block."""


def request_seed(train_seed: int, step: int, index: int) -> int:
    """The sampling seed of request ``index`` (prompt-major, then sample) of 1-based ``step``."""
    return (train_seed * 1_000_003 + step * 10_007 + index) % (2 ** 31 - 1)


def _agreed(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=ENGINE_RANK)
    return box[0]


def _gathered(items: list, env: DistEnv) -> list:
    """Every data-parallel rank's ``items`` concatenated in rank order (collective; the ranks of one
    tensor-parallel group hold the same items, so each replica's count once)."""
    group = env.data_parallel_group()
    if group is None:
        return list(items)
    boxes: list[Any] = [None] * env.data_parallel_size
    dist.all_gather_object(boxes, items, group=group)
    return [item for box in boxes for item in box]


class GRPORun:
    """The state of one run (module docstring); :meth:`step` runs one step."""

    def __init__(self, recipe: Recipe, env: DistEnv, run_dir: Path, checkpoint_dir: Path) -> None:
        self.recipe, self.rl, self.env = recipe, recipe.rl, env
        self.run_dir, self.checkpoint_dir = run_dir, checkpoint_dir
        self.align = recipe.align.enabled
        self.guarded = self.align and self.rl.invariant and self.rl.guard
        # the engine's TP where the trainer computes another layout's shards (align.engine_tensor_parallel_size)
        self.engine_tensor_parallel_size = recipe.align.engine_tensor_parallel_size
        self.hf_config = read_hf_config(checkpoint_dir)
        try:
            self.sampling = sampling_params(self.rl.sampling)   # the engine's requests and the trainer's logprobs
        except ValueError as error:
            raise RecipeError(f"rl.sampling: {error}") from error
        self.engine = self._start_engine(checkpoint_dir)   # first: a model it cannot serve is refused here
        self.model = build_model(recipe, checkpoint_dir, self.align)
        # sharded (FSDP2 or tensor parallel): its forward and the gathering of its full tensors are collective,
        # so every rank runs the trainer's side of the checks and pushes
        self.sharded = recipe.parallel.fsdp or env.tensor_parallel_size > 1
        if recipe.parallel.fsdp and any(hasattr(layer.mlp, "router") for layer in self.model.decoder.layers):
            raise RecipeError("parallel.fsdp: not supported for an MoE model in the GRPO loop (its pushes carry the "
                              "experts' deployed values, which a sharded MoE layer rebuilds only inside its forward)")
        self.tokenizer = ByteTokenizer(self.model.vocab_size)
        pairs = arithmetic_pairs(recipe.data.num_train + recipe.data.num_validation, recipe.data.seed)
        problems = [Problem(prompt, response) for prompt, response in pairs]
        self.train_problems, probe = problems[:recipe.data.num_train], problems[recipe.data.num_train:]
        self.probe = [self.prompt_ids(p) + self.tokenizer.encode(p.response) for p in probe[:self.rl.probe_prompts]]
        self.reward = REWARDS[self.rl.reward]
        self.replay: list[torch.Tensor] | None = None   # this rank's routed experts of the step (MoE)
        self.processed: list[tuple[int, Any]] = []   # this rank's (first completion token, SamplingParams)
        self.last_metrics: dict[str, Any] = {}   # the trainer's metrics of the last step (train.trainer)
        self.trainer = Trainer(self.model,
                               lambda rows: replayed_logprobs(self.model, rows, self.replay, self.processed),
                               recipe.optimizer, total_steps=recipe.train.steps,
                               world_size=env.data_parallel_size, data_parallel_group=env.data_parallel_group(),
                               frozen=recipe.guards.freeze)

    def prompt_ids(self, problem: Problem) -> list[int]:
        return [self.tokenizer.BOS, *self.tokenizer.encode(problem.prompt)]

    def _start_engine(self, checkpoint_dir: Path) -> RolloutEngine | None:
        from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

        # vLLM's process groups span every rank: build them together (a no-op after an aligned model
        # was built), or rank 0's engine would wait for ranks that never join.
        with vllm_context(EngineSpec(str(checkpoint_dir), tensor_parallel_size=self.engine_tensor_parallel_size)
                          ).active(parallel_state=True):
            pass
        engine, error = None, None
        if self.env.rank == ENGINE_RANK:
            from megatron_vllm_align.engine import EngineStartError

            try:
                if self.rl.engine == "server":
                    from megatron_vllm_align.rl.server_engine import ServerRolloutEngine

                    engine = ServerRolloutEngine(checkpoint_dir, self.hf_config, self.rl.kv_cache_mb,
                                                 self.recipe.train.seed, invariant=self.rl.invariant,
                                                 log_path=self.run_dir / "engine_server.log")
                else:
                    engine = RolloutEngine(checkpoint_dir, self.hf_config, self.rl.kv_cache_mb, self.recipe.train.seed,
                                           self.engine_tensor_parallel_size or self.env.tensor_parallel_size)
            except EngineStartError as exc:
                error = str(exc)
        error = _agreed(error)
        if error is not None:
            raise RecipeError(f"model: the vLLM engine cannot serve this model: {error}")
        self.engine_description = _agreed(None if engine is None else engine.describe())
        return engine

    def push_weights(self) -> None:
        """Rank 0: the current parameters into the running engine (collective when the model is sharded: the
        full tensors are gathered on every rank)."""
        if self.engine is not None or self.sharded:
            weights = engine_weights(self.model, self.hf_config)
            if self.engine is not None:
                self.engine.push_weights(weights)

    def rollouts(self, step: int) -> list[Rollout]:
        """The step's rollouts, sampled on rank 0 and shared (module docstring, item 1)."""
        if self.engine is None:
            return broadcast_rollouts(None)
        rl, group = self.rl, self.rl.group_size
        problems = batch_indices(step, rl.prompts_per_step, len(self.train_problems), self.recipe.data.seed)
        prompts = [self.prompt_ids(self.train_problems[p]) for p in problems for _ in range(group)]
        seeds = [request_seed(self.recipe.train.seed, step, i) for i in range(len(prompts))]
        completions = self.engine.sample(prompts, seeds, rl.max_new_tokens, self.sampling, self.tokenizer.EOS)
        raw = self.engine.prompt_logprobs([c.sequence for c in completions])   # prompt logprobs: raw
        rewards = torch.tensor([self.reward(self.train_problems[problems[i // group]],
                                            self.tokenizer.decode(list(c.tokens))) for i, c in enumerate(completions)])
        advantages = group_advantages(rewards.view(len(problems), group)).flatten()
        rollouts = [Rollout(problems[i // group], i % group, seeds[i], tuple(prompts[i]), c.tokens,
                            tuple(c.logprobs.tolist()), float(rewards[i]), float(advantages[i]), c.routed_experts,
                            tuple(raw[i][len(c.prompt) - 1:].tolist()))
                    for i, c in enumerate(completions)]
        return broadcast_rollouts(rollouts)

    def _stop(self, message: str | None) -> None:
        """Raise :class:`OnPolicyMismatch` on every rank when rank 0's ``message`` is set."""
        message = _agreed(message)
        if message is not None:
            raise OnPolicyMismatch(message)

    def _divergence(self, sequence: list[int], routed_experts: torch.Tensor | None = None) -> str:
        """Rank 0: the first block and op where the engine's and the trainer's activations differ on
        ``sequence`` (``megatron.activation_divergence``), or ``output layer`` when none does. Call it on
        rank 0, and on every rank when the model is sharded (its forward is collective)."""
        from megatron_vllm_align.megatron.activation_divergence import (
            first_differing,
            model_tap_points,
            trainer_activations,
        )

        engine_tp = self.engine_tensor_parallel_size
        if engine_tp not in (None, self.env.tensor_parallel_size):
            return (f"not located (the engine's activations are sharded over its {engine_tp} workers, the "
                    f"trainer's over {self.env.tensor_parallel_size})")
        points = model_tap_points(self.model)
        trainer = trainer_activations(self.model, sequence, points, routed_experts)
        if self.engine is None:
            return ""
        found = first_differing(points, self.engine.activations(sequence, points), trainer)
        return "output layer" if found is None else str(found)

    def _guard(self, step: int, rollouts: list[Rollout], trainer_logprobs: list[torch.Tensor]) -> None:
        """Stop the run when a trainer logprob of a sampled token differs from the engine's (every rank holds
        both: the rollouts are broadcast and the logprobs gathered)."""
        first = next((i for i, (rollout, values) in enumerate(zip(rollouts, trainer_logprobs, strict=True))
                      if not torch.equal(values, rollout.engine_logprob_tensor)), None)
        message = None
        if first is not None and (self.engine is not None or self.sharded):
            rollout = rollouts[first]
            where = self._divergence(rollout.tokens.tolist(), rollout.routed_experts)
            delta = float((trainer_logprobs[first].double() - rollout.engine_logprob_tensor.double()).abs().max())
            message = (f"step {step}: the trainer's logprobs of the tokens the engine sampled differ from the "
                       f"engine's in sequence {first} (problem {rollout.problem}, sample {rollout.sample}, seed "
                       f"{rollout.seed}; max |delta| {delta:.3g}); first divergent block: {where}")
        self._stop(message)

    def check_sync(self, step: int) -> bool:
        """The engine's prompt logprobs of the probe prompts equal the trainer's (else stop); the engine's are
        rank 0's, the trainer's forward runs there (and on every rank when the model is sharded)."""
        message, first = None, None
        if self.engine is not None or self.sharded:
            from megatron_vllm_align.megatron.logprobs import token_logprobs

            with torch.no_grad():
                trainer = token_logprobs(self.model, self.probe)
            if self.engine is not None:
                engine = self.engine.prompt_logprobs(self.probe)
                first = next((i for i, (ours, theirs) in enumerate(zip(trainer, engine, strict=True))
                              if not torch.equal(ours.float().cpu(), theirs)), None)
            if self.sharded:
                first = _agreed(first)
            if first is not None:
                where = self._divergence(self.probe[first])
                message = (f"step {step}: after the weight sync the engine's prompt logprobs of probe prompt {first} "
                           f"differ from the trainer's; first divergent block: {where}")
        self._stop(message)
        return True

    def step(self, step: int) -> dict[str, Any]:
        """One GRPO step (module docstring); returns its figures."""
        rollouts = self.rollouts(step)
        local = [rollouts[i] for i in rank_slice(list(range(len(rollouts))), self.env.data_parallel_rank,
                                                 self.env.data_parallel_size)]
        sampled = sum(len(r.completion) for r in rollouts)
        stats, local_logprobs = RatioStats(), []
        moe = bool(local) and all(r.routed_experts is not None for r in local)
        self.replay = [r.routed_experts for r in local] if moe else None
        self.processed = [(len(r.prompt), self.sampling) for r in local]

        def loss_sum(logprobs, examples):
            local_logprobs.extend(v.detach().float().cpu() for v in logprobs)
            return grpo_loss_sum(logprobs, examples, self.rl.clip_eps, stats)

        self.trainer.forward_backward(local, sampled, loss_sum)
        trainer_logprobs = _gathered(local_logprobs, self.env)
        mismatch = logprob_mismatch(trainer_logprobs, [r.engine_logprob_tensor for r in rollouts])
        with torch.no_grad():   # the raw logprobs of the same tokens: reported, not trained on
            local_raw = [v[r.loss_mask.to(v.device)].float().cpu() for v, r in
                         zip(replayed_logprobs(self.model, [r.tokens for r in local], self.replay), local)]
        raw_mismatch = logprob_mismatch(_gathered(local_raw, self.env), [r.engine_raw_logprob_tensor for r in rollouts])
        if self.guarded:
            self._guard(step, rollouts, trainer_logprobs)
        ratios = RatioStats()
        for part in _gathered([stats], self.env):
            ratios = ratios.merge(part)
        metrics = self.trainer.apply_update(step, sum(r.tokens.numel() for r in rollouts), sampled)
        self.last_metrics = metrics
        self.push_weights()
        every = self.rl.sync_check_every
        synced = self.check_sync(step) if self.align and every and step % every == 0 else None
        figures = {"step": step, "reward_mean": sum(r.reward for r in rollouts) / len(rollouts),
                   "objective": metrics["train_loss"], "grad_norm": metrics["grad_norm"], "lr": metrics["lr"],
                   "sampled_tokens": sampled, "sync_checked": synced, **mismatch.to_dict(), **ratios.figures(),
                   "raw": raw_mismatch.to_dict()}
        if self.env.is_main:
            (self.run_dir / "rollouts").mkdir(exist_ok=True)
            record = [{"problem": r.problem, "sample": r.sample, "seed": r.seed, "prompt": list(r.prompt),
                       "completion": list(r.completion), "engine_logprobs": list(r.engine_logprobs),
                       "engine_raw_logprobs": list(r.engine_raw_logprobs), "reward": r.reward,
                       "advantage": r.advantage,
                       "routed_experts": None if r.routed_experts is None else r.routed_experts.tolist()}
                      for r in rollouts]
            atomic_write_text(self.run_dir / "rollouts" / f"step_{step:06d}.json", json.dumps(record),
                              what="rollouts")
        return figures


def _on_policy(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Max over ``steps`` of ``max_abs_delta_logprob``, mean of ``mean_abs_delta_logprob`` (None: no step)."""
    return {"max_abs_delta_logprob": max(h["max_abs_delta_logprob"] for h in steps) if steps else None,
            "mean_abs_delta_logprob": sum(h["mean_abs_delta_logprob"] for h in steps) / len(steps) if steps else None}


def _summary(run: GRPORun, history: list[dict[str, Any]], status: str, error: str | None,
             checkpoints: list[str]) -> dict[str, Any]:
    return {"kind": "grpo", "status": status, "error": error, "steps": len(history),
            "align_enabled": run.align, "backward_precision": current_backward_precision() if run.align else None,
            "world_size": run.env.world_size, "fsdp": run.recipe.parallel.fsdp,
            "tensor_parallel_size": run.env.tensor_parallel_size,
            "engine_rank": ENGINE_RANK,
            "engine": run.engine_description,
            "invariant": run.rl.invariant, "guard": run.guarded,
            "sampling": {"logprobs": "processed_logprobs", **to_dict(run.rl.sampling)},
            "on_policy": {**_on_policy(history), "raw": _on_policy([h["raw"] for h in history])},
            "reward_mean": [h["reward_mean"] for h in history], "checkpoints": checkpoints, "per_step": history}


@in_recipe_backward_precision
def run_grpo(recipe: Recipe) -> dict[str, Any]:
    """Run the GRPO loop of ``recipe`` (every rank calls it); returns what ``summary.json`` holds.
    Raises :class:`OnPolicyMismatch` when the guard or the sync check stops the run (the summary
    then says ``"stopped"`` with the error), ``RecipeError`` before any step for a model the engine
    cannot serve or a batch the ranks cannot split."""
    from megatron_vllm_align.train.panels import TrainingPanels

    if recipe.rl.invariant:
        invariance.enable()
    env = init_distributed(recipe.train.seed, recipe.parallel.tensor_model_parallel_size)
    check_world_size(recipe, env.world_size)
    run_dir = prepare_run_dir(recipe, env, "summary.json")
    run = GRPORun(recipe, env, run_dir, initial_checkpoint(recipe, run_dir, env))
    fit = checkpoint_fit(recipe)
    history: list[dict[str, Any]] = []
    start = 0
    if recipe.train.resume_from:
        resumed = load_checkpoint(recipe.train.resume_from, model=run.model, optimizer=run.trainer.optimizer,
                                  fit=fit, world_size=env.world_size, rank=env.rank)
        start, history = resumed["step"], resumed["history"]["steps"]
        run.push_weights()
    panels = TrainingPanels(run_dir, env.is_main)
    writer = panels.writer
    panels.start(run.model)
    checkpoints: list[str] = []
    try:
        with progress_bar(recipe, env, start, "grpo") as bar:
            for step in range(start + 1, recipe.train.steps + 1):
                figures = run.step(step)
                history.append(figures)
                if writer is not None:
                    writer.write_rl_step(figures, "aligned" if run.align else "native")
                panels.step(run.last_metrics, run.trainer.last_grad_squares)
                bar.set_postfix(reward=f"{figures['reward_mean']:.3f}", delta=f"{figures['max_abs_delta_logprob']:.2g}")
                bar.update(1)
                every = recipe.train.save_every
                if every and (step % every == 0 or step == recipe.train.steps):
                    data_state = {"seed": recipe.data.seed, "consumed": step * recipe.rl.prompts_per_step}
                    checkpoints.append(str(save_checkpoint(
                        run_dir / "checkpoints" / f"step_{step:06d}", model=run.model, optimizer=run.trainer.optimizer,
                        step=step, fit=fit, history={"steps": history}, data_state=data_state)))
        result = _summary(run, history, "complete", None, checkpoints)
        result["export"] = export_trained(recipe, run.model, run.checkpoint_dir, run_dir, env)
        if env.is_main:
            atomic_write_text(run_dir / "summary.json", json.dumps(result, indent=1), what="summary")
        barrier()
    except OnPolicyMismatch as error:
        if env.is_main:
            atomic_write_text(run_dir / "summary.json", json.dumps(_summary(run, history, "stopped", str(error),
                                                                             checkpoints), indent=1), what="summary")
        raise
    finally:
        panels.close()
        if run.engine is not None:  # last: vLLM's shutdown also tears down this rank's process group
            run.engine.shutdown()
    return result

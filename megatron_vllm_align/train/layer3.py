"""Layer 3 (docs/method.md#layer-3-proxy-sft): proxy SFT with three arms, stepped in lockstep on the same batches.

Arms, from the same initial HF checkpoint, each with a fresh AdamW of the same hyperparameters and
main-params policy, the same data, masks, loss normalisation, schedule, clipping, precision and seed, no
activation recompute: ``under_test`` (the aligned model, production backward); ``gradient_reference``
(value from the aligned model without a graph, gradient from autograd of Megatron's local-spec model at
the same parameters through :func:`~megatron_vllm_align.ops.reference_bridge.visible_with_surrogate`;
the optimizer steps the local-spec parameters, copied into the visible model and its deployed values
rebuilt after every step; no aligned backward runs); ``native_baseline`` (Megatron's local spec,
reported, not judged). Verdict, fixed in the recipe's ``layer3`` section, over steps 1..window_steps:
``|loss(under_test) - loss(reference)| <= loss_tolerance`` at every step and, at step 1, every
parameter's gradient relative L2 ``<= grad_rel_l2_tolerance``; a first failure is localised
(``initial_loss``, ``one_step_update``, ``later`` with both states saved in
``<run_dir>/first_divergence/``), a non-finite value makes it ``inconclusive``. Output: a
:class:`~megatron_vllm_align.validation.layer3_data.Layer3Run` written as ``layer3.json`` (last; a stale
one is deleted at start) after ``tensorboard/`` (rank 0: the ``layer3/`` curves of docs/panels.md).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.megatron.vllm_tensor_parallel import full_tensor, is_gated_fc1
from megatron_vllm_align.ops.reference_bridge import visible_with_surrogate
from megatron_vllm_align.ops.refresh import refresh_deployed_weights
from megatron_vllm_align.train.checkpoint import save_checkpoint
from megatron_vllm_align.train.config import Recipe
from megatron_vllm_align.train.data import batch_indices
from megatron_vllm_align.train.distributed import DistEnv, init_distributed
from megatron_vllm_align.train.run_setup import (
    build_model,
    checkpoint_fit,
    in_recipe_backward_precision,
    initial_checkpoint,
    model_logprobs,
    prepare_run_dir,
    progress_bar,
    recipe_splits,
    step_batch,
)
from megatron_vllm_align.train.trainer import LogprobsFn, Trainer
from megatron_vllm_align.utils.atomic_io import atomic_write_text
from megatron_vllm_align.validation.grad_metrics import grad_metrics
from megatron_vllm_align.validation.layer3_data import (
    ARMS,
    ArmStep,
    Layer3Run,
    Localisation,
    layer3_to_dict,
)

LOCALISATION_HINTS = {
    "initial_loss": "loss differs at the initial weights: check forward, data, mask",
    "one_step_update": "initial loss matches but the step-1 gradient/update differs: check backward, reduction, "
                       "scale, clipping, optimizer",
    "later": "diverges only after several steps: replay from the saved first abnormal checkpoint; check "
             "recompute, deployed-value refresh, learning rate, RNG",
}


def bridged_logprobs(visible: nn.Module, surrogate: nn.Module) -> LogprobsFn:
    """Per-token logprobs valued by `visible`'s forward, differentiated through `surrogate`."""
    visible_fn, surrogate_fn = model_logprobs(visible), model_logprobs(surrogate)

    def logprobs(token_rows: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            values = visible_fn(token_rows)
        surrogates = surrogate_fn(token_rows)
        return [visible_with_surrogate(v, s, name=f"sequence {i} logprobs")
                for i, (v, s) in enumerate(zip(values, surrogates, strict=True))]

    return logprobs


def copy_parameters(source: nn.Module, target: nn.Module) -> None:
    """Copy `source`'s parameters into `target`'s of the same names, then rebuild its deployed values."""
    targets = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            targets[name].copy_(param)
    refresh_deployed_weights(target)


def parameters_digest(model: nn.Module) -> str:
    """sha256 (first 16 hex digits) of every parameter's name, dtype and bytes (the whole parameter:
    collective at TP > 1)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{param.dtype}:".encode())
        whole = full_tensor(param.detach(), param, is_gated_fc1(model, name))
        digest.update(whole.float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def build_arms(recipe: Recipe, checkpoint_dir: Path, env: DistEnv) -> tuple[dict[str, Trainer], nn.Module]:
    """The three trainers, and the reference arm's visible (aligned) model; at tensor parallel size T
    every arm holds the same shard of every parameter (the aligned and the local spec load the checkpoint
    in Megatron's layout)."""
    common = {"total_steps": recipe.train.steps, "world_size": env.data_parallel_size,
              "data_parallel_group": env.data_parallel_group(), "keep_tensors": True}
    under_test = build_model(recipe, checkpoint_dir, align=True)
    visible = build_model(recipe, checkpoint_dir, align=True).requires_grad_(False)
    surrogate = build_model(recipe, checkpoint_dir, align=False)
    native = build_model(recipe, checkpoint_dir, align=False)
    reference = Trainer(surrogate, bridged_logprobs(visible, surrogate), recipe.optimizer,
                        eval_logprobs_fn=model_logprobs(visible), **common)
    reference.optimizer.register_step_post_hook(lambda *_: copy_parameters(surrogate, visible))
    arms = {"under_test": Trainer(under_test, model_logprobs(under_test), recipe.optimizer, **common),
            "gradient_reference": reference,
            "native_baseline": Trainer(native, model_logprobs(native), recipe.optimizer, **common)}
    return arms, visible


def arm_configs(recipe: Recipe, arms: dict[str, Trainer], first_batch: list[int],
                env: DistEnv) -> dict[str, dict[str, str]]:
    """What each arm runs, read from the built objects where they hold it."""
    opt = recipe.optimizer
    described = {
        "under_test": ("aligned spec (vLLM kernels)", "production backward of the aligned modules", "aligned"),
        "gradient_reference": ("aligned spec (vLLM kernels), same parameters",
                      ("autograd of Megatron local spec via whole-model bridge (visible_with_surrogate on "
                       "per-token logprobs)"), "local (stepped)"),
        "native_baseline": ("Megatron local spec", "Megatron local spec autograd", "local"),
    }
    configs = {}
    for arm, trainer in arms.items():
        visible, backward, model_spec = described[arm]
        group = trainer.optimizer.param_groups[0]
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in trainer.params})
        main_dtypes = ",".join(sorted({str(p.main_param.dtype).removeprefix("torch.")
                                       for p in trainer.params if hasattr(p, "main_param")}))
        configs[arm] = {
            "visible forward": visible,
            "backward": backward,
            "trained model spec": model_spec,
            "initial weights (sha256/16)": parameters_digest(trainer.model),
            "optimizer": f"AdamW betas={tuple(group['betas'])} eps={group['eps']} wd={group['weight_decay']}; "
                         f"main params {opt.main_params_dtype}",
            "initial optimizer state": f"{len(trainer.optimizer.state)} slots (fresh)",
            "data order": f"seed {recipe.data.seed}, step-1 batch {first_batch}",
            "labels / mask": "response tokens + EOS",
            "loss normalisation": "sum of masked NLL / global masked tokens",
            "global batch / accumulation": f"{recipe.train.global_batch_size} sequences / none",
            "data-parallel ranks": str(env.data_parallel_size),
            "tensor-parallel ranks": str(env.tensor_parallel_size),
            "lr schedule": f"warmup {opt.warmup_steps} then cosine {opt.lr} -> {opt.min_lr} over {recipe.train.steps}",
            "clipping": f"global L2 norm {opt.clip_grad}",
            "precision": f"params {','.join(dtypes)}; main copies {main_dtypes or 'none'}; loss fp32; "
                         "no loss scaling",
            "seed": str(recipe.train.seed),
            "recompute": "none",
        }
    return configs


def config_diff_markdown(run: Layer3Run) -> str:
    """The config-diff table of ``run`` as Markdown: differing settings first, then held equal."""
    differing, same = run.config_diff()
    rows = [(key, values, False) for key, values in differing]
    rows += [(key, {arm: run.arm_configs[arm][key] for arm in ARMS}, True) for key in same]
    lines = ["| setting | " + " | ".join(ARMS) + " | held equal |", "|---" * (len(ARMS) + 2) + "|"]
    lines += [f"| {key} | " + " | ".join(str(values[arm]) for arm in ARMS) + f" | {'yes' if equal else 'no'} |"
              for key, values, equal in rows]
    return "\n".join(lines)


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors.values()])


def full_tensors(trainer: Trainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (per parameter name of ``trainer``'s model: this rank's shard of a gradient or update)
    as the whole tensors, gathered over each parameter's tensor-parallel group; unchanged at TP 1.
    Collective at TP > 1."""
    params = dict(trainer.model.named_parameters())
    return {name: full_tensor(t, params[name], is_gated_fc1(trainer.model, name)) for name, t in tensors.items()}


def compare_step(step: int, arms: dict[str, Trainer], losses: dict[str, float]) -> dict[str, Any]:
    """Under test against reference (and native) at one step: loss, gradient and update figures, over
    the whole parameters (every tensor-parallel rank's shard). Collective at TP > 1."""
    ut, ref = arms["under_test"], arms["gradient_reference"]
    ut_grads, ref_grads = full_tensors(ut, ut.last_gradients), full_tensors(ref, ref.last_gradients)
    per_param = {name: grad_metrics(ut_grads[name], ref_grads[name]) for name in ut_grads}
    worst = max(per_param, key=lambda name: per_param[name].rel_l2)
    grads = grad_metrics(_flat(ut_grads), _flat(ref_grads))
    update = grad_metrics(_flat(full_tensors(ut, ut.last_update)), _flat(full_tensors(ref, ref.last_update)))
    return {"step": step,
            "loss_diff_vs_reference": abs(losses["under_test"] - losses["gradient_reference"]),
            "loss_diff_vs_native": abs(losses["under_test"] - losses["native_baseline"]),
            "grad_rel_l2_vs_reference": grads.rel_l2, "grad_cosine_vs_reference": grads.cosine,
            "worst_grad_param": worst, "worst_grad_rel_l2": per_param[worst].rel_l2,
            "update_rel_l2_vs_reference": update.rel_l2, "update_cosine_vs_reference": update.cosine,
            "per_param_grad_rel_l2": {name: m.rel_l2 for name, m in per_param.items()}}


def first_failure(comparison: dict[str, Any], recipe: Recipe) -> str | None:
    """The localisation class of a failing window step, or None if it passes."""
    tolerances = recipe.layer3
    if comparison["loss_diff_vs_reference"] > tolerances.loss_tolerance:
        return "initial_loss" if comparison["step"] == 1 else "later"
    if comparison["step"] == 1 and comparison["worst_grad_rel_l2"] > tolerances.grad_rel_l2_tolerance:
        return "one_step_update"
    return None


def arm_step(metrics: dict[str, Any], cumulative_tokens: int) -> ArmStep:
    """One trainer step's metrics (:mod:`.trainer`) as the report's step: ``clip_coef`` is the
    clip ratio, ``nonfinite`` the non-finite count; ``tokens`` counts all steps so far."""
    return ArmStep(step=metrics["step"], train_loss=metrics["train_loss"], val_nll=metrics["val_nll"],
                   grad_norm=metrics["grad_norm"], update_rms=metrics["update_rms"], clip_ratio=metrics["clip_coef"],
                   non_finite=metrics["nonfinite"], tokens_per_s=metrics["tokens_per_s"], tokens=cumulative_tokens)


@in_recipe_backward_precision
def run_layer3(recipe: Recipe) -> Layer3Run:
    """Run the three arms per `recipe` (its ``layer3`` section); returns what layer3.json holds.
    The validation NLL is needed at every step, so ``train.eval_every`` must be 1."""
    if recipe.layer3 is None:
        raise ValueError("run_layer3: the recipe has no layer3 section")
    if recipe.train.eval_every != 1:
        raise ValueError(f"train.eval_every: layer 3 records the validation NLL at every step, so it must be 1, "
                         f"got {recipe.train.eval_every}")
    env = init_distributed(recipe.train.seed, recipe.parallel.tensor_model_parallel_size,
                           recipe.parallel.expert_model_parallel_size)
    run_dir = prepare_run_dir(recipe, env, "layer3.json")
    checkpoint_dir = initial_checkpoint(recipe, run_dir, env)
    arms, _ = build_arms(recipe, checkpoint_dir, env)
    splits = recipe_splits(recipe, checkpoint_dir, arms["native_baseline"].model.vocab_size)
    first_batch = batch_indices(1, recipe.train.global_batch_size, len(splits.train), recipe.data.seed)
    configs = arm_configs(recipe, arms, first_batch, env)
    curves: dict[str, list[ArmStep]] = {arm: [] for arm in ARMS}
    comparisons: list[dict] = []
    window = recipe.layer3.window_steps
    failure: dict[str, Any] | None = None
    nonfinite_in_window = False
    with progress_bar(recipe, env, 0, "layer3") as bar:
        for step in range(1, recipe.train.steps + 1):
            examples, tokens, loss_tokens = step_batch(splits, step, recipe, env)
            losses = {arm: trainer.forward_backward(examples, loss_tokens) for arm, trainer in arms.items()}
            if failure is None and step <= window and step > 1:
                kind = first_failure({"step": step, "loss_diff_vs_reference":
                                      abs(losses["under_test"] - losses["gradient_reference"])}, recipe)
                if kind is not None:
                    failure = _save_divergence(recipe, arms, run_dir, step, kind)
            for arm, trainer in arms.items():
                metrics = trainer.apply_update(step, tokens, loss_tokens)
                metrics["val_nll"] = trainer.evaluate(splits.validation)
                curves[arm].append(arm_step(metrics, tokens + (curves[arm][-1].tokens if curves[arm] else 0)))
                nonfinite_in_window |= step <= window and metrics["nonfinite"] > 0
            comparisons.append(compare_step(step, arms, losses))
            if failure is None and step == 1:
                kind = first_failure(comparisons[0], recipe)
                if kind is not None:
                    failure = {"step": 1, "localisation": kind, "checkpoint": None}
            bar.set_postfix(dloss=f"{comparisons[-1]['loss_diff_vs_reference']:.2e}")
            bar.update(1)
    section = recipe.layer3
    result = Layer3Run(
        arms={arm: tuple(steps) for arm, steps in curves.items()},
        verdict="inconclusive" if nonfinite_in_window else ("fail" if failure else "pass"),
        verdict_detail=_verdict_detail(comparisons[:window], recipe),
        window={"first_step": 1, "last_step": window, "loss_tolerance": section.loss_tolerance,
                "grad_rel_l2_tolerance": section.grad_rel_l2_tolerance,
                "reasoning": " ".join(section.reasoning.split())},
        localisation=Localisation() if failure is None else Localisation(
            first_divergent_step=failure["step"], stage=failure["localisation"], checkpoint=failure["checkpoint"],
            detail=LOCALISATION_HINTS[failure["localisation"]]),
        arm_configs=configs, comparison=tuple(comparisons))
    if env.is_main:
        from megatron_vllm_align.logging.tensorboard import PanelWriter

        with PanelWriter(run_dir / "tensorboard") as writer:
            writer.write_layer3(result)
        atomic_write_text(run_dir / "layer3.json", json.dumps(layer3_to_dict(result), indent=1),
                          what="layer-3 result")
    return result


def _save_divergence(recipe: Recipe, arms: dict[str, Trainer], run_dir: Path, step: int, kind: str) -> dict:
    """Save the under-test and reference states before `step` (both arms' weights at step - 1)
    under ``<run_dir>/first_divergence/<arm>``."""
    target = run_dir / "first_divergence"
    for arm in ("under_test", "gradient_reference"):
        trainer = arms[arm]
        save_checkpoint(target / arm, model=trainer.model, optimizer=trainer.optimizer, step=step - 1,
                        fit=checkpoint_fit(recipe), history={"arm": arm},
                        data_state={"seed": recipe.data.seed, "consumed": (step - 1) * recipe.train.global_batch_size})
    return {"step": step, "localisation": kind, "checkpoint": str(target)}


def _verdict_detail(window: list[dict], recipe: Recipe) -> str:
    """The figures the verdict rests on, against their tolerances."""
    section, first = recipe.layer3, window[0]
    return (f"max |loss(under_test) - loss(gradient_reference)| over steps 1..{len(window)} = "
            f"{max(c['loss_diff_vs_reference'] for c in window):.3g} (tolerance {section.loss_tolerance:g}); "
            f"step-1 worst parameter gradient rel L2 = {first['worst_grad_rel_l2']:.3g} at "
            f"{first['worst_grad_param']} (tolerance {section.grad_rel_l2_tolerance:g}); "
            f"max |loss(under_test) - loss(native_baseline)| = "
            f"{max(c['loss_diff_vs_native'] for c in window):.3g} (reported, not judged)")

"""Layer 3: a correct run passes its verdict; planted bugs get their localisation (one-step update,
initial loss, later) or an inconclusive verdict."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_vllm_align.ops.dense_linear.module import DenseLinearFunction
from megatron_vllm_align.train.layer3 import config_diff_markdown, run_layer3
from megatron_vllm_align.validation.layer3_data import ARMS, load_layer3

HELD_EQUAL = {"initial weights (sha256/16)", "optimizer", "initial optimizer state", "data order", "labels / mask",
              "loss normalisation", "global batch / accumulation", "data-parallel ranks", "tensor-parallel ranks",
              "lr schedule", "clipping",
              "precision", "seed", "recompute"}


def _recipe(small_recipe):
    return small_recipe("tiny_llama_layer3.yaml", "train.steps=4", "layer3.window_steps=3")


def test_correct_run_passes_with_three_curves_and_a_config_diff(small_recipe, tmp_path):
    result = run_layer3(_recipe(small_recipe))
    assert result.verdict == "pass" and result.localisation.stage is None and result.localisation.checkpoint is None
    assert result.comparison[0]["loss_diff_vs_reference"] == 0.0  # same visible forward, same snapshot
    assert result.comparison[0]["worst_grad_rel_l2"] < 2e-2
    assert max(c["loss_diff_vs_reference"] for c in result.comparison[:3]) < 5e-3
    assert (result.window["first_step"], result.window["last_step"]) == (1, 3)
    for arm in ARMS:
        curve = result.arms[arm]
        assert [s.step for s in curve] == [1, 2, 3, 4] and curve[-1].train_loss < curve[0].train_loss
        assert all(s.clip_ratio <= 1.0 and s.non_finite == 0 for s in curve)
        assert all(0 < a.tokens < b.tokens for a, b in itertools.pairwise(curve))       # cumulative
    differing, same = result.config_diff()
    assert set(same) == HELD_EQUAL
    assert {"backward", "visible forward"} <= {key for key, _ in differing}
    table = config_diff_markdown(result).splitlines()
    first_equal = next(i for i, line in enumerate(table) if line.endswith("| yes |"))
    assert all(line.endswith("| no |") for line in table[2:first_equal])           # differing fields first
    assert len(table) == 2 + len(differing) + len(same)
    assert load_layer3(tmp_path / "run" / "layer3.json") == result                # the report reads what was run
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for arm in ARMS:                                                              # and TensorBoard shows it
        assert [(e.step, e.value) for e in events.Scalars(f"layer3/train_loss/{arm}")] == [
            (s.step, float(np.float32(s.train_loss))) for s in result.arms[arm]]


def test_planted_dw_bug_is_localised_to_the_one_step_update(small_recipe, tmp_path, monkeypatch):
    original = DenseLinearFunction.backward

    def scaled_dw(ctx, grad_out):  # the aligned linears' dW scaled by 0.9
        dx, dw, *rest = original(ctx, grad_out)
        return (dx, None if dw is None else dw * 0.9, *rest)

    monkeypatch.setattr(DenseLinearFunction, "backward", staticmethod(scaled_dw))
    result = run_layer3(_recipe(small_recipe))
    assert result.verdict == "fail"
    assert (result.localisation.first_divergent_step, result.localisation.stage) == (1, "one_step_update")
    assert "backward" in result.localisation.detail
    assert result.comparison[0]["loss_diff_vs_reference"] == 0.0  # the forward is innocent
    assert result.comparison[0]["worst_grad_rel_l2"] == pytest.approx(0.1, abs=0.02)
    assert "linear" in result.comparison[0]["worst_grad_param"]
    per_param = result.comparison[0]["per_param_grad_rel_l2"]
    assert all(value < 2e-2 for name, value in per_param.items() if "layernorm" in name)
    assert load_layer3(tmp_path / "run" / "layer3.json").verdict == "fail"


def _plant_in_under_test(monkeypatch, change):
    """Wrap the under-test arm's model (the first aligned model build_arms builds) with a forward hook
    ``change(call, logits)``; per step the arm runs one training forward, then one evaluation."""
    from megatron_vllm_align.train import layer3

    built, calls = [], [0]

    def hooked(output_of):
        calls[0] += 1
        return change(calls[0], output_of)

    def build_model(recipe, checkpoint_dir, align):
        model = original(recipe, checkpoint_dir, align)
        if align and not built:
            model.register_forward_hook(lambda module, args, out: hooked(out))
        built.append(align)
        return model

    original = layer3.build_model
    monkeypatch.setattr(layer3, "build_model", build_model)


def test_planted_forward_bug_is_localised_to_the_initial_loss(small_recipe, monkeypatch):
    _plant_in_under_test(monkeypatch, lambda call, logits: logits.roll(1, dims=-1))  # logits off by one token id
    result = run_layer3(_recipe(small_recipe))
    assert result.verdict == "fail"
    assert (result.localisation.first_divergent_step, result.localisation.stage) == (1, "initial_loss")
    assert "forward" in result.localisation.detail
    assert result.comparison[0]["loss_diff_vs_reference"] > 0.02  # the recipe's loss tolerance


def test_bug_appearing_at_step_two_is_localised_later_with_a_checkpoint(small_recipe, monkeypatch):
    # step 2 on
    _plant_in_under_test(monkeypatch, lambda call, logits: logits.roll(1, dims=-1) if call >= 3 else logits)
    result = run_layer3(_recipe(small_recipe))
    assert result.verdict == "fail"
    assert (result.localisation.first_divergent_step, result.localisation.stage) == (2, "later")
    assert result.comparison[0]["loss_diff_vs_reference"] == 0.0
    assert result.localisation.checkpoint is not None and Path(result.localisation.checkpoint).exists()


def test_non_finite_gradient_in_the_window_is_inconclusive(small_recipe, monkeypatch):
    _plant_in_under_test(monkeypatch, lambda call, logits: logits * float("nan") if call == 3 else logits)
    result = run_layer3(_recipe(small_recipe))
    assert result.verdict == "inconclusive"
    assert result.arms["under_test"][1].non_finite > 0
    assert all(step.non_finite == 0 for arm in ("gradient_reference", "native_baseline")
               for step in result.arms[arm])


def test_layer3_needs_the_validation_nll_every_step(small_recipe):
    with pytest.raises(ValueError, match="train.eval_every"):
        run_layer3(small_recipe("tiny_llama_layer3.yaml", "train.eval_every=2"))


def test_command_line_exit_status_follows_the_verdict(tmp_path, monkeypatch, capsys):
    """``python -m megatron_vllm_align.train --recipe <layer-3 recipe>``: 0 on pass, 1 on a planted bug."""
    from megatron_vllm_align.train.__main__ import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_llama_layer3.yaml"
    args = ["--recipe", str(recipe), "data.num_train=32", "data.num_validation=4",
            "train.global_batch_size=4", "train.progress_bar=false", "train.steps=2", "layer3.window_steps=2",
            f"train.run_dir={tmp_path / 'run'}"]
    assert main(args) == 0
    assert "layer3 verdict: pass" in capsys.readouterr().out
    original = DenseLinearFunction.backward

    def scaled_dw(ctx, grad_out):
        dx, dw, *rest = original(ctx, grad_out)
        return (dx, None if dw is None else dw * 0.9, *rest)

    monkeypatch.setattr(DenseLinearFunction, "backward", staticmethod(scaled_dw))
    assert main(args) == 1
    assert "first divergence: one_step_update" in capsys.readouterr().out

"""Layer 3: a correct run passes its verdict; a planted backward bug is localised to step 1."""
from __future__ import annotations

import json

import pytest

from megatron_vllm_align.modules.linear import DenseLinearFunction
from megatron_vllm_align.train.layer3 import ARMS, config_diff_markdown, run_layer3

HELD_EQUAL = {"initial weights (sha256/16)", "optimizer", "initial optimizer state", "data order", "labels / mask",
              "loss normalisation", "global batch / accumulation", "lr schedule", "clipping", "precision", "seed",
              "recompute"}


def _recipe(small_recipe):
    return small_recipe("tiny_llama_layer3.yaml", "train.steps=4", "layer3.window_steps=3")


def test_correct_run_passes_with_three_curves_and_a_config_diff(small_recipe, tmp_path):
    result = run_layer3(_recipe(small_recipe))
    verdict = result["verdict"]
    assert verdict["status"] == "pass" and verdict["localisation"] is None and verdict["checkpoints"] is None
    assert result["comparison"][0]["loss_diff_vs_reference"] == 0.0  # same visible forward, same snapshot
    assert verdict["step1_worst_grad_rel_l2"] < 2e-2 and verdict["max_loss_diff_vs_reference"] < 5e-3
    for arm in ARMS:
        curve = result["arms"][arm]
        assert [m["step"] for m in curve] == [1, 2, 3, 4] and curve[-1]["train_loss"] < curve[0]["train_loss"]
    rows = {row["field"]: row for row in result["config_diff"]}
    assert {field for field, row in rows.items() if row["equal"]} == HELD_EQUAL
    assert not rows["backward"]["equal"] and not rows["visible forward"]["equal"]
    table = config_diff_markdown(result["config_diff"])
    assert table.splitlines()[2].startswith("| visible forward |")  # differing fields first
    written = json.loads((tmp_path / "run" / "layer3.json").read_text())
    assert written["status"] == "complete" and written["verdict"] == verdict


def test_planted_dw_bug_is_localised_to_the_one_step_update(small_recipe, tmp_path, monkeypatch):
    original = DenseLinearFunction.backward

    def scaled_dw(ctx, grad_out):  # the aligned linears' dW scaled by 0.9
        dx, dw, *rest = original(ctx, grad_out)
        return (dx, None if dw is None else dw * 0.9, *rest)

    monkeypatch.setattr(DenseLinearFunction, "backward", staticmethod(scaled_dw))
    result = run_layer3(_recipe(small_recipe))
    verdict = result["verdict"]
    assert verdict["status"] == "fail"
    assert (verdict["first_divergent_step"], verdict["localisation"]) == (1, "one_step_update")
    assert "backward" in verdict["hint"]
    assert result["comparison"][0]["loss_diff_vs_reference"] == 0.0  # the forward is innocent
    assert verdict["step1_worst_grad_rel_l2"] == pytest.approx(0.1, abs=0.02)
    assert "linear" in verdict["step1_worst_grad_param"]
    per_param = result["comparison"][0]["per_param_grad_rel_l2"]
    assert all(value < 2e-2 for name, value in per_param.items() if "layernorm" in name)

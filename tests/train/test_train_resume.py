"""SFT runs in one process: bitwise resume, checkpoints that do not fit, no complete-looking
output after a failure, guards wired from the recipe."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from megatron_vllm_align.guards import FreezeViolation
from megatron_vllm_align.train.checkpoint import CheckpointError
from megatron_vllm_align.train.run import run_sft

METRIC_KEYS = {"step", "train_loss", "val_nll", "grad_norm", "clip_coef", "clipped", "update_rms", "nonfinite",
               "skipped", "lr", "tokens", "loss_tokens", "tokens_per_s", "grad_norm_clipped"}


def _state(checkpoint):
    return torch.load(checkpoint / "state.pt", weights_only=True)


@pytest.mark.parametrize("align", ["true", "false"])
def test_resumed_run_is_bitwise_identical(small_recipe, tmp_path, align):
    full = run_sft(small_recipe("tiny_llama_sft.yaml", f"align.enabled={align}", "train.steps=4", "train.save_every=2"))
    run_dir = tmp_path / "run"
    steps = full["arms"]["aligned" if align == "true" else "native"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and set(steps[0]) == METRIC_KEYS
    assert steps[-1]["train_loss"] < steps[0]["train_loss"] and steps[-1]["val_nll"] < full["val_nll_initial"]
    assert all(m["nonfinite"] == 0 and m["update_rms"] > 0 and m["grad_norm"] > 0 for m in steps)
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "complete"
    uninterrupted = _state(run_dir / "checkpoints" / "step_000004")
    shutil.move(run_dir / "checkpoints" / "step_000002", tmp_path / "step_2")
    shutil.rmtree(run_dir / "checkpoints")

    resumed = run_sft(small_recipe("tiny_llama_sft.yaml", f"align.enabled={align}", "train.steps=4",
                                   "train.save_every=2", f"train.resume_from={tmp_path / 'step_2'}"))
    again = _state(run_dir / "checkpoints" / "step_000004")
    for name, tensor in uninterrupted["model"].items():
        assert torch.equal(tensor, again["model"][name]), name
    for slot, state in uninterrupted["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, again["optimizer"]["state"][slot][key]), (slot, key)
    resumed_steps = next(iter(resumed["arms"].values()))
    for before, after in zip(steps, resumed_steps, strict=True):
        assert {k: v for k, v in before.items() if k != "tokens_per_s"} == \
               {k: v for k, v in after.items() if k != "tokens_per_s"}


def test_checkpoint_that_does_not_fit_is_a_clear_error_and_leaves_no_result(small_recipe, tmp_path):
    run_sft(small_recipe("tiny_llama_sft.yaml", "align.enabled=false", "train.steps=1", "train.save_every=1"))
    checkpoint = tmp_path / "ckpt"
    shutil.move(tmp_path / "run" / "checkpoints" / "step_000001", checkpoint)
    assert (tmp_path / "run" / "metrics.json").exists()
    with pytest.raises(CheckpointError, match=r"model\.tiny\.hidden_size is 128 in the checkpoint and 64"):
        run_sft(small_recipe("tiny_llama_sft.yaml", "align.enabled=false", f"train.resume_from={checkpoint}",
                             "model.tiny.hidden_size=64", f"train.run_dir={tmp_path / 'other'}"))
    with pytest.raises(CheckpointError, match=r"align\.enabled is False in the checkpoint and True"):
        run_sft(small_recipe("tiny_llama_sft.yaml", f"train.resume_from={checkpoint}"))
    assert not (tmp_path / "run" / "metrics.json").exists()  # the stale result is gone

    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["parameters"]["output_layer.weight"][0] = [1, 1]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"parameter 'output_layer.weight' is \[\[1, 1\], 'bfloat16'\]"):
        run_sft(small_recipe("tiny_llama_sft.yaml", "align.enabled=false", f"train.resume_from={checkpoint}"))
    (checkpoint / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        run_sft(small_recipe("tiny_llama_sft.yaml", "align.enabled=false", f"train.resume_from={checkpoint}"))
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_freeze_guard_keeps_the_parameter_bitwise_and_catches_a_leak(small_recipe, tmp_path, monkeypatch):
    name = "decoder.layers.0.input_layernorm.weight"
    recipe = small_recipe("tiny_llama_sft.yaml", "train.steps=2", "train.save_every=2", f"guards.freeze=[{name}]",
                          "guards.gradient_dump_every=1")
    run_sft(recipe)
    state = _state(tmp_path / "run" / "checkpoints" / "step_000002")["model"]
    from safetensors.torch import load_file

    initial_model = load_file(tmp_path / "run" / "initial_model" / "model.safetensors")
    initial = initial_model["model.layers.0.input_layernorm.weight"]
    assert torch.equal(state[name], initial)
    assert not torch.equal(state["decoder.layers.0.mlp.linear_fc2.weight"],  # an unfrozen weight moved
                           load_file(tmp_path / "run" / "initial_model" / "model.safetensors")[
                               "model.layers.0.mlp.down_proj.weight"])
    assert sorted(p.name for p in (tmp_path / "run" / "gradient_dumps").iterdir()) == ["step_00000000", "step_00000001"]

    original_step = torch.optim.AdamW.step

    def leaky_step(self, *args, **kwargs):  # a bug that writes to a frozen weight
        out = original_step(self, *args, **kwargs)
        with torch.no_grad():
            dict(self._leak_model.named_parameters())[name].add_(1e-2)
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", leaky_step)
    monkeypatch.setattr(torch.optim.AdamW, "_leak_model", None, raising=False)
    import megatron_vllm_align.train.run as run_module

    real_trainer = run_module.Trainer

    def trainer_with_leak(model, *args, **kwargs):
        trainer = real_trainer(model, *args, **kwargs)
        trainer.optimizer.optimizer._leak_model = model  # the AdamW inside the main-params wrapper
        return trainer

    monkeypatch.setattr(run_module, "Trainer", trainer_with_leak)
    with pytest.raises(FreezeViolation, match=name):
        run_sft(dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, run_dir=str(tmp_path / "leak"))))
    assert not (tmp_path / "leak" / "metrics.json").exists()

"""Layer 3 at tensor parallel size 2: ``torchrun --nproc-per-node 2 -m megatron_vllm_align.train --recipe
recipes/tiny_llama_layer3.yaml parallel.tensor_model_parallel_size=2``. Every arm holds the same shard of every
parameter; the step-1 gradient comparison runs over the whole parameters (both ranks' shards), so a backward bug
on rank 1 alone is caught (a comparison of rank 0's shards would pass it)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_vllm_align.utils.torchrun import torchrun_command

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_llama_layer3.yaml"
PLANTED = REPO / "tests" / "distributed" / "workers" / "rank1_dw_scaled.py"
TIMEOUT_S = 300
# vLLM pads the vocabulary to a multiple of 64 before sharding it: 384 keeps the TP 2 shards whole
OVERRIDES = ("parallel.tensor_model_parallel_size=2", "model.tiny.vocab_size=384", "train.steps=4",
             "layer3.window_steps=3", "train.progress_bar=false")


def _run(tmp_path: Path, *entry: str) -> tuple[subprocess.CompletedProcess, dict]:
    run_dir = tmp_path / "run"
    command = torchrun_command(2, *entry, "--recipe", str(RECIPE), f"train.run_dir={run_dir}", *OVERRIDES)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO,
                               check=False)
    result = run_dir / "layer3.json"
    assert result.exists(), f"no layer3.json:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
    return completed, json.loads(result.read_text())


def test_layer3_at_tensor_parallel_size_2_passes_over_both_ranks_shards(tmp_path):
    completed, result = _run(tmp_path, "-m", "megatron_vllm_align.train")
    assert completed.returncode == 0, completed.stdout[-3000:]
    assert result["verdict"] == "pass"
    first = result["comparison"][0]
    assert first["loss_diff_vs_reference"] == 0.0   # same visible forward, same snapshot
    assert first["worst_grad_rel_l2"] < 2e-2
    assert max(c["loss_diff_vs_reference"] for c in result["comparison"][:3]) < 5e-3
    for arm, config in result["arm_configs"].items():
        assert (config["tensor-parallel ranks"], config["data-parallel ranks"]) == ("2", "1"), arm
    digests = {config["initial weights (sha256/16)"] for config in result["arm_configs"].values()}
    assert len(digests) == 1   # the three arms start from the same whole parameters
    for arm, curve in result["arms"].items():
        assert [s["step"] for s in curve] == [1, 2, 3, 4] and curve[-1]["train_loss"] < curve[0]["train_loss"], arm


def test_a_backward_bug_on_rank_1_alone_is_localised_to_the_one_step_update(tmp_path):
    completed, result = _run(tmp_path, str(PLANTED))
    assert completed.returncode == 1, completed.stdout[-3000:]
    assert result["verdict"] == "fail"
    assert (result["localisation"]["first_divergent_step"], result["localisation"]["stage"]) == (1, "one_step_update")
    first = result["comparison"][0]
    assert first["loss_diff_vs_reference"] == 0.0   # the forward is innocent
    per_param = first["per_param_grad_rel_l2"]
    # half of a sharded linear weight's gradient scaled by 0.8: relative L2 about 0.2 / sqrt(2) = 0.14
    assert 0.08 < first["worst_grad_rel_l2"] < 0.2 and "linear" in first["worst_grad_param"]
    assert all(value < 2e-2 for name, value in per_param.items() if "layernorm" in name)

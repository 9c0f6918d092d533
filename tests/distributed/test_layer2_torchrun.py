"""``torchrun --nproc-per-node 2 -m megatron_vllm_align.train --recipe recipes/tiny_llama_fp8_layer2.yaml``
on gloo: layer-2 panels for every FP8 linear class and layer at steps 2, 4, ..., read back with
TensorBoard's reader, equal to metrics.json, with layer2.md and the training panels beside them; and the same
recipe at tensor parallel size 2, measured over both ranks' shards (a dW bug on rank 1 alone is flagged)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_vllm_align.logging.tensorboard import LAYER2_ROW_METRICS
from megatron_vllm_align.utils.torchrun import torchrun_command

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_llama_fp8_layer2.yaml"
TIMEOUT_S = 300
CLASSES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")



def test_two_ranks_write_layer2_panels_every_two_steps(tmp_path):
    run_dir = tmp_path / "run"
    command = torchrun_command(2, "-m", "megatron_vllm_align.train", "--recipe", str(RECIPE),
                               f"train.run_dir={run_dir}", "train.steps=4", "train.progress_bar=false")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO,
                               check=False)
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
    assert "layer2 WARNING" not in completed.stdout + completed.stderr   # a clean run flags nothing
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["status"] == "complete"
    measured = metrics["layer2"]
    assert [m["step"] for m in measured] == [2, 4]
    # both ranks' shares of the batch: the step's 8 sequences
    assert all("the step's 8 sequences (2 data-parallel x 1 tensor-parallel ranks)" in m["batch"] for m in measured)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for linear in CLASSES:
        for layer in (0, 1):
            for gradient in ("dX", "dW"):
                rows = [next(r for r in m["rows"] if (r["module_class"], r["layer"], r["gradient"]) ==
                             (linear, layer, gradient)) for m in measured]
                for metric, key in LAYER2_ROW_METRICS.items():
                    tag = f"layer2_train.{linear}/fp8_per_channel/{gradient}/{metric}/layer_{layer}"
                    assert tag in scalars, tag
                    assert [(e.step, e.value) for e in events.Scalars(tag)] == [
                        (m["step"], float(np.float32(float(r[key])))) for m, r in zip(measured, rows)], tag
                assert all(r["cosine"] > 0.999 and not r["flagged"] for r in rows)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("train/grad_norm")] == [
        float(np.float32(s["grad_norm"])) for s in metrics["arms"]["aligned"]]
    markdown = (run_dir / "layer2.md").read_text()
    assert "## Step 2" in markdown and "## Step 4" in markdown
    assert "Outlier layers:\n\n- none" in markdown
    assert len(list((run_dir / "tensorboard").iterdir())) == 1   # one event file: rank 0 writes, rank 1 does not


PLANTED = REPO / "tests" / "distributed" / "workers" / "rank1_dw_scaled.py"
# vLLM pads the vocabulary to a multiple of 64 before sharding it: 384 keeps the TP 2 shards whole
TENSOR_PARALLEL = ("parallel.tensor_model_parallel_size=2", "model.tiny.vocab_size=384", "train.steps=2",
                   "train.progress_bar=false")


def _run(run_dir: Path, command: list[str]) -> tuple[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO,
                               check=False)
    assert completed.returncode == 0, f"run failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
    (measured,) = json.loads((run_dir / "metrics.json").read_text())["layer2"]
    assert measured["step"] == 2
    return completed.stdout, measured


def _tokens(measured: dict) -> int:
    return int(re.search(r"\((\d+) tokens\)", measured["batch"]).group(1))


@pytest.mark.parametrize("planted", [False, True], ids=["correct", "dw_bug_on_rank_1"])
def test_tensor_parallel_size_2_measures_both_ranks_shards(tmp_path, planted):
    entry = (str(PLANTED),) if planted else ("-m", "megatron_vllm_align.train")
    stdout, measured = _run(tmp_path / "tp2", torchrun_command(2, *entry, "--recipe", str(RECIPE),
                                                               f"train.run_dir={tmp_path / 'tp2'}", *TENSOR_PARALLEL))
    assert "the step's 8 sequences (1 data-parallel x 2 tensor-parallel ranks)" in measured["batch"]
    rows = {(r["module_class"], r["layer"], r["gradient"]): r for r in measured["rows"]}
    assert set(rows) == {(c, layer, g) for c in CLASSES for layer in (0, 1) for g in ("dX", "dW")}
    flagged = {key for key, r in rows.items() if r["flagged"]}
    if not planted:
        assert not flagged and "layer2 WARNING" not in stdout
        assert all(r["cosine"] > 0.999 for r in rows.values())
        # the assembled layers measure what one process measures on the whole layers, up to the TP 2 step's
        # own rounding: the same tokens, each relative L2 within 10 %
        _, whole = _run(tmp_path / "tp1", [sys.executable, "-m", "megatron_vllm_align.train", "--recipe",
                                           str(RECIPE), f"train.run_dir={tmp_path / 'tp1'}", *TENSOR_PARALLEL[1:]])
        assert _tokens(whole) == _tokens(measured)
        for r in whole["rows"]:
            assert rows[r["module_class"], r["layer"], r["gradient"]]["rel_l2"] == pytest.approx(r["rel_l2"], rel=0.1)
        return
    # rank 1's half of every dW scaled by 0.8: the default's norm drops to sqrt((1 + 0.64) / 2) = 0.91 of the
    # alternative's, beyond norm_ratio_tol 0.05; rank 0's half alone would agree (dX is untouched)
    assert flagged == {key for key in rows if key[2] == "dW"}
    assert all(1.07 < rows[key]["norm_ratio"] < 1.14 for key in flagged)
    assert stdout.count("layer2 WARNING") == len(flagged)

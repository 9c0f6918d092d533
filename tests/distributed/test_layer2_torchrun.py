"""``torchrun --nproc-per-node 2 -m megatron_vllm_align.train --recipe recipes/tiny_llama_fp8_layer2.yaml``
on gloo: layer-2 panels for every FP8 linear class and layer at steps 2, 4, ..., read back with
TensorBoard's reader, equal to metrics.json, with layer2.md and the training panels beside them."""
from __future__ import annotations

import json
import os
import subprocess
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
    assert all("rank 0's 4 of the step's 8 sequences (world size 2)" in m["batch"] for m in measured)
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

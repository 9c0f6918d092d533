"""The GRPO recipe with the engine out of the trainer's process (``rl.engine=server``) under ``torchrun
--nproc-per-node 2`` on gloo: vLLM's OpenAI server as rank 0's subprocess (MVA_INVARIANT=1 in its
API server, engine core and worker), rollouts sampled over HTTP, each step's weights pushed through the
worker extension (``collective_rpc``) and a gloo group between rank 0 and the engine's worker.

- exact on-policy: every sampled token's trainer logprob equals the server's (max |delta| 0 every step),
  the probe check passes after every push, and the weights really moved (a step with a gradient); the
  control: Megatron's native forward recomputing the same rollouts differs from the server (> 0);
- a planted stale push (layer 1 left out of every push) is caught by the probe check right after the
  first push, which stops the run naming layer 1 (the engine's activations captured in its worker);
- both runs leave no engine process behind (every pid the run recorded has exited);
- ``rl.engine`` is checked (default ``in_process``), and an MoE model is refused in server mode before a
  server starts.

Two torchrun launches; the launcher and the stale-push worker are those of test_grpo_torchrun.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import test_grpo_torchrun as grpo_torchrun  # pytest puts tests/rl on sys.path (no __init__.py)
import torch

from megatron_vllm_align.invariance.plugin import INSTALLED_MESSAGE

pytestmark = pytest.mark.distributed

SERVER = "rl.engine=server"
TIMEOUT_S = 900   # the server's start (20 to 110 s on a loaded 2-core machine) comes on top of the in-process run


@pytest.fixture(autouse=True)
def _longer_launches(monkeypatch):
    monkeypatch.setattr(grpo_torchrun, "TIMEOUT_S", TIMEOUT_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_engine_gone(engine: dict) -> None:
    """Every vLLM process of the server (and its process group) has exited."""
    pids = [int(pid) for pid in engine["processes"]]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in pids if _alive(pid)], f"engine processes left behind: {engine['processes']}"
    with pytest.raises(ProcessLookupError):
        os.killpg(engine["api_server_pid"], 0)


def _assert_server_engine(engine: dict, run_dir) -> None:
    assert engine["kind"] == "server" and engine["invariant"] is True
    assert sorted(engine["processes"].values())[:2] == ["APIServer", "EngineCore"] and len(engine["processes"]) >= 3
    log = (run_dir / "engine_server.log").read_text(errors="replace")
    assert engine["log"] == str(run_dir / "engine_server.log")
    patched = {int(pid) for pid in re.findall(re.escape(INSTALLED_MESSAGE) + r" \(pid (\d+),", log)}
    assert {int(pid) for pid in engine["processes"]} <= patched, (engine["processes"], patched)
    assert "'worker_extension_cls': 'megatron_vllm_align.rl.weight_sync.WeightSyncExtension'" in log


def _native_recompute_differs(run_dir) -> float:
    """The control: Megatron's local spec (no vLLM forward) recomputing step 1's rollouts from the initial
    weights; the largest |delta| against the server's logprobs."""
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import completion_logprobs

    rollouts = json.loads((run_dir / "rollouts" / "step_000001.json").read_text())
    init_single_process_cpu(seed=1234)
    native = build_gpt_from_hf(run_dir / "initial_model", align=False, params_dtype=torch.bfloat16)
    with torch.no_grad():
        ours = completion_logprobs(native, [r["prompt"] for r in rollouts], [r["completion"] for r in rollouts])
    return max(float((a.double() - torch.tensor(r["engine_logprobs"], dtype=torch.float32).double()).abs().max())
               for a, r in zip(ours, rollouts, strict=True))


def test_server_engine_is_exactly_on_policy_with_weights_pushed_over_gloo(tmp_path):
    # the recipe's own batch (4 prompts x 4 samples x 16 tokens): step 1 has rewards that differ within
    # groups, so the first push carries moved weights
    run_dir = tmp_path / "server"
    completed, summary = grpo_torchrun._launch(run_dir, SERVER, "train.steps=3", sizes=())
    grpo_torchrun._ok(completed)
    assert summary["status"] == "complete" and summary["steps"] == 3 and summary["world_size"] == 2
    assert summary["guard"] is True and summary["on_policy"]["max_abs_delta_logprob"] == 0.0
    for step in summary["per_step"]:
        assert step["max_abs_delta_logprob"] == 0.0 and step["k3_kl"] == 0.0 and step["sync_checked"] is True
        assert step["sampled_tokens"] == step["num_tokens"] > 0
    assert summary["per_step"][0]["grad_norm"] > 0, "step 1 has a gradient: the pushes carry moved weights"
    _assert_server_engine(summary["engine"], run_dir)
    _assert_engine_gone(summary["engine"])
    rollouts = json.loads((run_dir / "rollouts" / "step_000003.json").read_text())
    assert len(rollouts) == 16 and len({r["seed"] for r in rollouts}) == 16
    native = _native_recompute_differs(run_dir)
    print(f"server-mode GRPO: 3 steps exact; control (native forward) max |delta| {native:.3g}")
    assert native > 0, "the native forward equals the server on these rollouts: the comparison is not exercised"


def test_planted_stale_push_into_the_server_stops_the_run_naming_the_layer(tmp_path):
    run_dir = tmp_path / "stale"
    completed, summary = grpo_torchrun._launch(run_dir, SERVER, "train.steps=2", "rl.sync_check_every=1",
                                               worker=grpo_torchrun.STALE_WORKER, sizes=())
    assert completed.returncode != 0
    assert summary["status"] == "stopped" and summary["steps"] == 0
    assert summary["error"].startswith("step 1: ") and "after the weight sync" in summary["error"], summary["error"]
    assert re.search(r"first divergent block: layer 1 attention \((input_layernorm|qkv_proj)\): \d+ of \d+ values "
                     r"differ", summary["error"]), summary["error"]
    assert "OnPolicyMismatch" in completed.stderr
    _assert_server_engine(summary["engine"], run_dir)
    _assert_engine_gone(summary["engine"])


def test_the_engine_key_is_checked_and_in_process_by_default():
    from megatron_vllm_align.train.config import RecipeError, load_recipe

    assert load_recipe(grpo_torchrun.RECIPE).rl.engine == "in_process"
    assert load_recipe(grpo_torchrun.RECIPE, [SERVER]).rl.engine == "server"
    with pytest.raises(RecipeError, match=r"rl\.engine"):
        load_recipe(grpo_torchrun.RECIPE, ["rl.engine=http"])


def test_an_moe_model_is_refused_in_server_mode_before_any_server_starts(tmp_path):
    command = [sys.executable, "-m", "megatron_vllm_align.train", "--recipe", str(grpo_torchrun.RECIPE),
               f"train.run_dir={tmp_path / 'run'}", "train.progress_bar=false", SERVER,
               "model.tiny.architecture=qwen3_moe"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=grpo_torchrun.REPO,
                               check=False)
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert ("recipe error: model: the vLLM engine cannot serve this model: rl.engine server serves dense models "
            "only") in completed.stderr
    assert not (tmp_path / "run" / "engine_server.log").exists() and not (tmp_path / "run" / "summary.json").exists()

"""The GRPO recipe under ``torchrun --nproc-per-node 2`` on gloo with the real in-process vLLM engine
on rank 0, sampling at the recipe's ``rl.sampling`` (temperature 0.7, top_p 0.95, top_k 20): the aligned
arm's processed logprobs of the sampled tokens equal the engine's ``processed_logprobs``, and their raw
logprobs the engine's raw ones, over every step (after a live
weight push each step, verified on probe prompts), the native arm differs and continues, a planted
stale sync stops the run naming the stale layer, and a resumed run is bitwise the uninterrupted one; the
same under FSDP2 (parallel.fsdp) and at tensor parallel size 2 (trainer and engine)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_vllm_align.utils.torchrun import torchrun_command

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_llama_grpo.yaml"
STALE_WORKER = Path(__file__).parent / "workers" / "stale_sync.py"
TIMEOUT_S = 300
COMMON = ("train.progress_bar=false", "train.save_every=0")
SMALL = ("rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=8")
VLLM_LOG_LINE = r"\) (DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] "   # vLLM's format



def _launch(run_dir: Path, *overrides: str, worker: Path | None = None,
            sizes: tuple[str, ...] = SMALL) -> tuple[subprocess.CompletedProcess, dict]:
    target = [str(worker)] if worker else ["-m", "megatron_vllm_align.train"]
    command = torchrun_command(2, *target, "--recipe", str(RECIPE), f"train.run_dir={run_dir}", *COMMON, *sizes,
                               *overrides)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO,
                               check=False)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return completed, summary


def _ok(completed: subprocess.CompletedProcess) -> None:
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"


STEPS = 4   # the aligned run: checkpoints at steps 2 and 4 (the resume test restarts from step 2)


@pytest.fixture(scope="module")
def aligned_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """The aligned arm over STEPS steps, saving every 2 steps: its run folder, process and summary."""
    run_dir = tmp_path_factory.mktemp("grpo") / "aligned"
    completed, summary = _launch(run_dir, f"train.steps={STEPS}", "train.save_every=2")
    return run_dir, completed, summary


def test_aligned_arm_is_exactly_on_policy_over_four_steps(aligned_run):
    run_dir, completed, summary = aligned_run
    _ok(completed)
    assert summary["status"] == "complete" and summary["steps"] == STEPS and summary["world_size"] == 2
    assert summary["align_enabled"] is True and summary["guard"] is True and summary["engine_rank"] == 0
    assert summary["on_policy"]["max_abs_delta_logprob"] == 0.0 and summary["on_policy"]["raw"] == {
        "max_abs_delta_logprob": 0.0, "mean_abs_delta_logprob": 0.0}
    assert summary["sampling"] == {"logprobs": "processed_logprobs", "temperature": 0.7, "top_p": 0.95, "top_k": 20,
                                   "min_p": 0.0}
    for step in summary["per_step"]:
        for figures in (step, step["raw"]):   # processed (trained on, guarded) and raw logprobs
            assert figures["max_abs_delta_logprob"] == figures["mean_abs_delta_logprob"] == 0.0
            assert figures["k3_kl"] == 0.0 and figures["token_mult_prob_error"] == 1.0
            assert figures["num_tokens"] == step["sampled_tokens"]
        assert step["ratio_min"] == step["ratio_max"] == 1.0 and step["clipped_fraction"] == 0.0
        assert step["sync_checked"] is True and step["sampled_tokens"] == step["num_tokens"] > 0
    assert any(step["grad_norm"] > 0 for step in summary["per_step"]), "the rewards differ: GRPO has a gradient"
    rollouts = json.loads((run_dir / "rollouts" / f"step_{STEPS:06d}.json").read_text())
    assert len(rollouts) == 8 and len({r["seed"] for r in rollouts}) == 8
    # the engine returned processed logprobs: at temperature 0.7 with top-k 20 they differ from the raw ones
    assert all(r["engine_logprobs"] != r["engine_raw_logprobs"] for r in rollouts)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("rl/reward_mean")] == list(range(1, STEPS + 1))
    assert [e.value for e in events.Scalars("rl/reward_mean")] == pytest.approx(summary["reward_mean"])
    for arm in ("rl_aligned", "rl_aligned_raw"):
        for metric, identical in (("max_abs_delta_logprob", 0.0), ("mean_abs_delta_logprob", 0.0), ("k3_kl", 0.0),
                                  ("token_mult_prob_error", 1.0)):
            assert [(e.step, e.value) for e in events.Scalars(f"mismatch/{arm}/{metric}")] == [
                (s, identical) for s in range(1, STEPS + 1)], (arm, metric)
    assert "custom_scalars__config__" in events.Tags()["tensors"]
    # the training run's panels too: train/loss is the GRPO objective, grad_norm the trainer's
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (s["step"], pytest.approx(s["objective"], rel=1e-6)) for s in summary["per_step"]]
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx(
        [s["grad_norm"] for s in summary["per_step"]], rel=1e-6)
    assert "contracts/table/text_summary" in events.Tags()["tensors"]
    assert "grad_norm/mlp.linear_fc1/layer_1" in events.Tags()["scalars"]
    # a quiet console: each rank's log path and result line; the engine's (rank 0) log lines in engine.log
    console = (completed.stdout + completed.stderr).splitlines()
    assert len(console) <= 6 and f"engine and library logs: {run_dir / 'engine.log'}" in console, console
    assert not [line for line in console if re.search(VLLM_LOG_LINE, line)]
    assert re.search(VLLM_LOG_LINE + "Initializing a V1 LLM engine", (run_dir / "engine.log").read_text())
    assert (run_dir / "engine.rank1.log").is_file()


def test_fsdp_run_is_on_policy_and_the_unsharded_runs_steps(aligned_run, tmp_path):
    """parallel.fsdp: true (FSDP2 over both ranks): every push gathers the full tensors, the probe check and the
    guard run the sharded forward on both ranks; the run is exactly on policy and takes the unsharded run's steps
    (the same rollouts, objective and rewards; the gradient norm is an fp64 sum shard by shard, in another order)."""
    _, completed, whole = aligned_run
    _ok(completed)
    completed, sharded = _launch(tmp_path / "fsdp", f"train.steps={STEPS}", "parallel.fsdp=true")
    _ok(completed)
    assert sharded["status"] == "complete" and sharded["fsdp"] is True and whole["fsdp"] is False
    assert sharded["on_policy"]["max_abs_delta_logprob"] == 0.0 and sharded["on_policy"]["raw"][
        "max_abs_delta_logprob"] == 0.0
    for ours, theirs in zip(sharded["per_step"], whole["per_step"], strict=True):
        assert ours["sync_checked"] is True
        assert {k: v for k, v in ours.items() if k != "grad_norm"} == {k: v for k, v in theirs.items()
                                                                      if k != "grad_norm"}
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)


TENSOR_PARALLEL = ("parallel.tensor_model_parallel_size=2", "model.tiny.vocab_size=384")  # 384: TP 2 vocab shards


def test_tensor_parallel_run_is_exactly_on_policy_against_a_tp2_engine(tmp_path):
    """Trainer at TP 2 on both ranks (one data-parallel replica), the engine at TP 2 in two worker processes
    on rank 0; every push packs the gathered full tensors into both workers. The recipe's own batch: step 1's
    rewards differ within groups, so the weights move before step 2 is sampled."""
    completed, summary = _launch(tmp_path / "tp2", "train.steps=2", *TENSOR_PARALLEL, sizes=())
    _ok(completed)
    assert summary["status"] == "complete" and summary["tensor_parallel_size"] == 2
    assert summary["engine"] == {"kind": "in_process", "tensor_parallel_size": 2}
    assert summary["on_policy"]["max_abs_delta_logprob"] == 0.0 and summary["on_policy"]["raw"][
        "max_abs_delta_logprob"] == 0.0
    assert all(step["sync_checked"] is True and step["sampled_tokens"] > 0 for step in summary["per_step"])
    assert summary["per_step"][0]["grad_norm"] > 0


def test_planted_stale_sync_at_tensor_parallel_size_2_stops_the_run_naming_the_layer(tmp_path):
    # the engine's side of the divergence search is its tensor-parallel rank 0 worker's activations
    completed, summary = _launch(tmp_path / "stale", "train.steps=2", "rl.sync_check_every=1", *TENSOR_PARALLEL,
                                 worker=STALE_WORKER, sizes=())
    assert completed.returncode != 0 and summary["status"] == "stopped" and summary["steps"] == 0
    assert summary["error"].startswith("step 1: ") and "after the weight sync" in summary["error"]
    assert re.search(r"first divergent block: layer 1 attention \((input_layernorm|qkv_proj)\)", summary["error"])


OWN_LAYOUT_WORKER = Path(__file__).parent / "workers" / "own_layout.py"
CROSS_LAYOUT = ("parallel.fsdp=true", "align.engine_tensor_parallel_size=2", "model.tiny.vocab_size=384")


@pytest.mark.parametrize("worker", [None, OWN_LAYOUT_WORKER], ids=["engine_shards", "own_layout_control"])
def test_fsdp_tp1_trainer_is_on_policy_against_a_tp2_engine(tmp_path, worker):
    """A TP 1 trainer sharded by FSDP2 on both ranks computes the TP 2 engine's shards
    (align.engine_tensor_parallel_size: 2): exactly on policy over steps whose weights move. The control, the
    same run with the model built in its own layout, is stopped by the guard at the first step."""
    completed, summary = _launch(tmp_path / "run", "train.steps=2", *CROSS_LAYOUT, worker=worker, sizes=())
    if worker is None:
        _ok(completed)
        assert summary["engine"] == {"kind": "in_process", "tensor_parallel_size": 2} and summary["fsdp"] is True
        assert summary["tensor_parallel_size"] == 1 and summary["on_policy"]["max_abs_delta_logprob"] == 0.0
        assert summary["on_policy"]["raw"]["max_abs_delta_logprob"] == 0.0
        assert all(step["sync_checked"] is True for step in summary["per_step"])
        assert summary["per_step"][0]["grad_norm"] > 0
    else:
        assert completed.returncode != 0 and summary["status"] == "stopped" and summary["steps"] == 0
        assert summary["error"].startswith("step 1: the trainer's logprobs of the tokens the engine sampled differ")
        assert "first divergent block: not located (the engine's activations are sharded over its 2 workers" \
            in summary["error"]


def test_moe_rollouts_replay_the_engines_routing_and_stay_exact(tmp_path):
    # the recipe's own batch: every step has rewards that differ within a group, so the weights move
    completed, summary = _launch(tmp_path / "moe", "train.steps=3", "model.tiny.architecture=qwen3_moe", sizes=())
    _ok(completed)
    assert summary["status"] == "complete" and summary["on_policy"]["max_abs_delta_logprob"] == 0.0
    assert all(step["sync_checked"] is True and step["grad_norm"] > 0 for step in summary["per_step"])
    for rollout in json.loads((tmp_path / "moe" / "rollouts" / "step_000003.json").read_text()):
        routed = torch.tensor(rollout["routed_experts"])
        assert routed.shape == (len(rollout["prompt"]) + len(rollout["completion"]) - 1, 2, 2)   # 2 MoE layers, top-2


def test_native_arm_differs_and_continues(tmp_path):
    completed, summary = _launch(tmp_path / "native", "train.steps=2", "align.enabled=false")
    _ok(completed)
    assert summary["status"] == "complete" and summary["steps"] == 2 and summary["guard"] is False
    on_policy = summary["on_policy"]
    assert on_policy["max_abs_delta_logprob"] > 0 and on_policy["raw"]["max_abs_delta_logprob"] > 0
    assert all(step["sync_checked"] is None for step in summary["per_step"])
    events = EventAccumulator(str(tmp_path / "native" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for arm in ("rl_native", "rl_native_raw"):
        figures = [step if arm == "rl_native" else step["raw"] for step in summary["per_step"]]
        for metric in ("max_abs_delta_logprob", "mean_abs_delta_logprob", "k3_kl", "token_mult_prob_error"):
            assert [e.value for e in events.Scalars(f"mismatch/{arm}/{metric}")] == pytest.approx(
                [f[metric] for f in figures], rel=1e-6)
        assert all(f["k3_kl"] > 0 and f["token_mult_prob_error"] > 1 for f in figures)


@pytest.mark.parametrize("sync_check_every, stops_at, where", [
    (0, 2, "the tokens the engine sampled"),     # the guard: the first step sampled from the stale engine
    (1, 1, "after the weight sync"),             # the sync check right after the stale push
])
def test_planted_stale_sync_stops_the_run_naming_the_layer(tmp_path, sync_check_every, stops_at, where):
    # The recipe's own batch (4 prompts x 4 samples x 16 tokens): its step 1 has rewards that differ
    # within groups, so the step moves layer 1 and the first sync is really stale. (A step with no
    # reward signal moves no bf16 weight, and a skipped layer then changes nothing.)
    completed, summary = _launch(tmp_path / "stale", "train.steps=4", f"rl.sync_check_every={sync_check_every}",
                                 worker=STALE_WORKER, sizes=())
    assert completed.returncode != 0
    if stops_at == 2:
        assert summary["per_step"][0]["grad_norm"] > 0
    assert summary["status"] == "stopped" and summary["steps"] == stops_at - 1
    assert summary["error"].startswith(f"step {stops_at}: ") and where in summary["error"]
    # layer 1's weights were not pushed: the first op of layer 1 whose bf16 weight the step moved differs
    # first (its input norm's weights, near 1, often round back to the same bf16 value: then qkv_proj)
    assert re.search(r"first divergent block: layer 1 attention \((input_layernorm|qkv_proj)\): \d+ of \d+ values "
                     r"differ", summary["error"]), summary["error"]
    assert "OnPolicyMismatch" in completed.stderr


def test_resumed_run_is_bitwise_the_uninterrupted_one(aligned_run, tmp_path):
    whole_dir, completed, whole = aligned_run
    _ok(completed)
    completed, resumed = _launch(tmp_path / "resumed", f"train.steps={STEPS}", "train.save_every=2",
                                 f"train.resume_from={whole_dir / 'checkpoints' / 'step_000002'}")
    _ok(completed)
    assert resumed["per_step"] == whole["per_step"]
    for step in (3, 4):
        name = f"step_{step:06d}.json"
        assert (tmp_path / "resumed" / "rollouts" / name).read_text() == (whole_dir / "rollouts" / name).read_text()
    final = [torch.load(run / "checkpoints" / "step_000004" / "state.pt", weights_only=True)["model"]
             for run in (whole_dir, tmp_path / "resumed")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


def test_a_batch_the_ranks_cannot_split_is_refused_before_any_step(tmp_path):
    completed, summary = _launch(tmp_path / "odd", "rl.prompts_per_step=1", "rl.group_size=3")
    assert completed.returncode != 0 and summary == {}
    assert "recipe error: rl.prompts_per_step: 1 prompts x 3 samples = 3 sequences do not split over 2 ranks" \
        in completed.stderr
    assert not (tmp_path / "odd" / "initial_model").exists()
    assert not (tmp_path / "odd" / "engine.log").exists()   # refused by the launcher, before the run's imports

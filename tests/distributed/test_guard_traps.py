"""Acceptance of the training guards under real ``torchrun --nproc-per-node 2`` on gloo.

One launch runs every scenario in ``workers/`` (torchrun start-up costs seconds); each rank
writes its figures to a JSON file that the tests below assert on.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_vllm_align.utils.torchrun import torchrun_command

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]
SCENARIOS = ("dump_timing", "fsdp2", "freeze", "replacement", "incomplete")
WORLD = 2
TIMEOUT_S = 240



@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("guard_traps")
    command = torchrun_command(WORLD, str(WORKERS / "main.py"), str(out), *SCENARIOS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    figures = [line for line in completed.stdout.splitlines() if line.startswith("[")]
    print("\n".join(figures))
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-4000:]}\n{completed.stderr[-8000:]}"
    return [json.loads((out / f"results_rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_dump_timing_trap_expert_scaling(results):
    for rank_result in results:
        timing = rank_result["dump_timing"]
        scaling = timing["recorded_scaling"]
        assert (scaling["dp_size"], scaling["expert_dp_size"], scaling["expert_grad_factor"]) == (2, 1, 0.5)
        assert all(timing["record_is_expert"][n] for n in timing["expert_names"])
        assert {timing["record_grad_factor"][n] for n in timing["expert_names"]} == {0.5}
        # the naive dump differs from what the optimizer used by exactly dp / expert_dp = 2
        assert timing["expert_ratio_min"] == timing["expert_ratio_max"] == 2.0
        assert timing["expert_naive_is_exactly_ratio_times_used"]
        # the pre-hook dump is the gradient the optimizer used: the replayed step is bitwise equal
        assert timing["replay_from_prehook_bitwise"] is True
        assert timing["replay_from_naive_bitwise"] is False
        assert timing["replay_from_naive_max_abs_param_diff"] > 1e-4
        assert timing["dumped_steps"] == [0, 1]
    rank0 = results[0]["dump_timing"]
    assert rank0["prehook_vs_reference_rel_l2"] < 1e-6  # fp32, sums of 32 tokens in another order
    assert rank0["naive_experts_vs_reference_norm_ratio"] == [2.0]


def test_dump_records_clip_coefficient_and_still_replays(results):
    for rank_result in results:
        timing = rank_result["dump_timing"]
        clipped = timing["clipped_scaling"]
        assert clipped["clip_coefficient"] == pytest.approx(1e-3 / (clipped["grad_norm"] + 1e-6), rel=1e-12)
        assert clipped["clip_coefficient"] < 1.0
        assert timing["clipped_replay_bitwise"] is True


def test_fsdp2_forward_only_leaves_unsharded_copies(results):
    for rank_result in results:
        fsdp = rank_result["fsdp2"]
        assert fsdp["by_name_is_dtensor"] == {"0.weight": True, "0.bias": True, "2.weight": False, "2.bias": False}
        assert fsdp["by_name_in_optimizer"] == {"0.weight": True, "0.bias": True, "2.weight": False, "2.bias": False}
        assert fsdp["perturbation_reached_master"] is False
        assert fsdp["findings_after_forward_only"] == {"fsdp_unsharded_copy_registered": ["2.weight", "2.bias"]}
        built_late = fsdp["findings_optimizer_built_unsharded"]
        assert built_late["fsdp_unsharded_copy_in_optimizer"] == ["2.weight", "2.bias"]
        assert built_late["not_in_optimizer"] == ["2.weight", "2.bias"]
        assert fsdp["findings_after_reshard"] == {}
        assert fsdp["findings_with_forward"] == {}
        assert fsdp["resharded_after_check"] is True


def test_fsdp2_dump_reassembles_to_single_process_reference(results):
    for rank_result in results:
        fsdp = rank_result["fsdp2"]
        assert fsdp["dump_names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert set(fsdp["dump_placements"].values()) == {"block"}
        for name, metrics in fsdp["dump_vs_reference"].items():
            assert metrics["rel_l2"] < 1e-6, (name, metrics)


def test_freeze_trap_zeroed_grad_under_adamw(results):
    for rank_result in results:
        freeze = rank_result["freeze"]
        assert freeze["raised"] is True
        assert list(freeze["reports"]) == ["0.weight"]
        report = freeze["reports"]["0.weight"]
        assert report["moved"] is True and report["max_abs_change"] > 0
        assert "zeroed, not None" in report["reasons"][0]
        assert "0.weight: moved, max |change|" in freeze["message"]
        # the reported move is the largest over both ranks' shards
        assert report["max_abs_change"] == max(r["freeze"]["local_max_abs_change"]["0.weight"] for r in results)
        assert freeze["bitwise_unchanged"] == {"0.weight": False, "1.weight": True, "2.weight": True}


def test_incomplete_dump_is_reported_and_leaves_no_complete_looking_files(results):
    rank0, rank1 = (r["incomplete"] for r in results)
    assert rank0["step_error"] is None and rank0["dumped_steps"] == [0]
    assert "cannot write the gradient dump of rank 1, step 0" in rank1["step_error"]
    assert rank1["dumped_steps"] == []
    for result in (rank0, rank1):
        assert "is incomplete: world size 2, missing ranks [1]" in result["load_error"]
        # rank 1 left neither an index nor a temporary file (the folder is the planted obstacle)
        assert result["files"] == ["rank_00000.json", "rank_00000.safetensors", "rank_00001.safetensors/"]


def test_replacement_trap_names_the_new_parameter(results):
    for rank_result in results:
        replacement = rank_result["replacement"]
        assert replacement["before"] == []
        by_kind = {f["kind"]: f for f in replacement["after"]}
        assert sorted(by_kind) == ["not_a_model_parameter", "not_in_optimizer"]
        missing = by_kind["not_in_optimizer"]
        assert missing["name"] == "0.weight"
        assert "VllmDenseLinear" in missing["reason"] and "forward uses it" in missing["reason"]
        assert by_kind["not_a_model_parameter"]["name"] == "optimizer[0].param_groups[0][0]"

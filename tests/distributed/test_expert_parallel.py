"""Expert parallelism: an EP = 2 MoE trainer (2 ``torchrun`` ranks, gloo; TP = EP = 2, expert TP 1) against a
real vLLM engine with ``tensor_parallel_size=2, enable_expert_parallel=True`` (2 worker processes), bit for
bit, on prompt logprobs and on the logprobs of tokens the engine sampled (also through ``check --tp 2``); gradients of
an EP = 2 step against the TP = 1 step; the CPU engine fix (``mva_cpu_moe_expert_map``) that makes the EP engine run at
all.

Model: Qwen3-MoE (8 experts, top-2, 2 layers; 4 experts per rank). The EP = 2 engine's logprobs differ
from the TP = 1 engine's (a negative control: the layouts really compute differently).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.check import main as check_main
from megatron_vllm_align.engine.tiny_models import (
    TinyModelConfig,
    build_tiny_hf_model,
)
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.logprobs import SAMPLED_LAYOUTS
from megatron_vllm_align.megatron.parallel_logprobs import tensor_parallel_logprobs
from megatron_vllm_align.ops.routed_experts import expert_map as expert_map_fix

pytestmark = [pytest.mark.engine, pytest.mark.distributed, pytest.mark.usefixtures("invariant_module")]

KV_CACHE_BYTES = 32 * 1024 * 1024
QWEN3_MOE = TinyModelConfig(architecture="qwen3_moe", num_experts=8, top_k=2, moe_intermediate_size=128, seed=11)
QWEN2_MOE = TinyModelConfig(architecture="qwen2_moe", num_experts=8, top_k=2, moe_intermediate_size=128,
                            shared_expert_intermediate_size=192, seed=12)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("ep") / "qwen3_moe", QWEN3_MOE)


@pytest.fixture(scope="module")
def ep2_rollout(qwen3_moe, engine_rollout) -> dict:
    config = ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES, tensor_parallel_size=2, enable_expert_parallel=True)
    return engine_rollout(qwen3_moe, QWEN3_MOE.vocab_size, config)


def test_ep2_trainer_equals_ep2_engine_bitwise(qwen3_moe, ep2_rollout, assert_equals_engine):
    completions = ep2_rollout["completions"]
    assert all(torch.isfinite(lp).all() for lp in ep2_rollout["prompt"])
    ours = tensor_parallel_logprobs(qwen3_moe, 2, ep2_rollout["prompts"], [c.prompt for c in completions],
                                    [c.tokens for c in completions], layouts=SAMPLED_LAYOUTS, expert_parallel=True)
    assert_equals_engine("EP=2", ours, ep2_rollout)


def test_check_tp2_on_moe_is_bit_exact_expert_parallel(qwen3_moe, tmp_path):
    """``check --tp 2`` on an MoE checkpoint: engine and trainer expert-parallel over the 2 ranks, exit 0."""
    assert check_main(["--model", str(qwen3_moe), "--tp", "2", "--seeds", "0", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "check.json").read_text())
    assert summary["bit_exact"] == {"prompt": True, "sampled": True}
    assert summary["tensor_parallel"] == {"engine": 2, "trainer": 2, "engine_shards_emulated": False}


def test_ep2_engine_differs_from_the_tp1_engine(qwen3_moe, ep2_rollout, max_delta):
    """The EP = 2 engine rounds each rank's partial expert sum to bf16 before the all-reduce (and runs
    TP = 2 attention): its logprobs are not the TP = 1 engine's, on the prompts nor on the EP = 2 engine's
    sampled tokens (scored by the TP = 1 engine as prompt logprobs of prompt + completion)."""
    completions = ep2_rollout["completions"]
    llm = start_reference_engine(qwen3_moe, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES))
    try:
        tp1_prompt = prompt_logprobs(llm, ep2_rollout["prompts"])
        scored = prompt_logprobs(llm, [list(c.prompt) + list(c.tokens) for c in completions])
    finally:
        shutdown_engine(llm)
    tp1_sampled = [lp[-len(c.tokens):] for lp, c in zip(scored, completions, strict=True)]
    assert max_delta("EP=2 engine (prompt)", ep2_rollout["prompt"], tp1_prompt, "TP=1 engine") > 0.0
    assert max_delta("EP=2 engine (sampled)", [c.logprobs for c in completions], tp1_sampled, "TP=1 engine") > 0.0


def test_the_plugin_makes_cpu_experts_honour_expert_map(tiny_moe_context):
    """vLLM's CPU fused experts with an expert map: unpatched ``apply`` ignores it (it computes every
    expert the IDs name, the crash of a real EP rank whose IDs exceed its experts); patched, a rank's output
    is the weighted sum over its local experts only, i.e. the kernel on :func:`local_routing`'s routing."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )

    from megatron_vllm_align.ops.routed_experts import VllmRoutedExpertsKernel

    assert expert_map_fix.install_expert_map_fix()
    patched = CPUUnquantizedExperts.apply
    assert patched.honours_expert_map
    generator = torch.Generator().manual_seed(0)
    kernel = VllmRoutedExpertsKernel(tiny_moe_context("ep_plugin"), 256, 128, 8, 2)
    kernel.load(torch.randn(8, 256, 256, generator=generator) / 16, torch.randn(8, 256, 128, generator=generator) / 11)
    x = torch.randn(13, 256, generator=generator).to(torch.bfloat16)
    weights = torch.rand(13, 2, generator=generator)
    ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(13)]).to(torch.int32)
    half = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)   # rank 0 of EP = 2 on all 8 experts
    full = kernel(x, weights, ids)
    routed = kernel.runner.routed_experts
    routed._expert_map = half
    try:
        local = kernel(x, weights, ids)
        CPUUnquantizedExperts.apply = inspect.unwrap(patched)   # vLLM's own (under any other wrappers)
        unpatched = kernel(x, weights, ids)
    finally:
        CPUUnquantizedExperts.apply = patched
        routed._expert_map = None
    assert torch.equal(unpatched, full)
    assert torch.equal(local, kernel(x, *expert_map_fix.local_routing(weights, ids, half)))
    assert not torch.equal(local, full)
    only_local = torch.where(ids < 4, weights, torch.zeros(()))
    assert torch.equal(local, kernel(x, only_local, ids))


def test_the_plugin_is_an_installed_version_gated_entry_point():
    """vLLM's ``load_general_plugins`` (what every engine process runs) installs the fix; on a vLLM version
    it was not written for, it patches nothing."""
    script = """
import vllm
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from megatron_vllm_align.ops.routed_experts import expert_map
version = vllm.__version__
vllm.__version__ = "0.31.0"
print(expert_map.install_expert_map_fix(), getattr(CPUUnquantizedExperts.apply, "honours_expert_map", False))
vllm.__version__ = version
from vllm.plugins import load_general_plugins
load_general_plugins()
print(getattr(CPUUnquantizedExperts.apply, "honours_expert_map", False))
"""
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                               check=False, env={**os.environ, "MVA_INVARIANT": "0"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.split()[-3:] == ["False", "False", "True"], completed.stdout


def test_engine_config_validates_expert_parallel():
    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1"):
        ReferenceEngineConfig(enable_expert_parallel=True)
    with pytest.raises(ValueError, match="must be a bool"):
        ReferenceEngineConfig(tensor_parallel_size=2, enable_expert_parallel="yes")




# Per-parameter bound on |g_EP2 - g_TP1| / |g_TP1| with the TP = 1 step's routing replayed: the EP = 2 forward
# differs from TP = 1 in the last bits (TP = 2 attention GEMM splits, partial expert sums rounded to bf16
# before the all-reduce), so no gradient is bitwise.
GRAD_REL_L2_BOUND = 2e-2


@pytest.fixture(scope="module")
def tp1_step(qwen3_moe, tmp_path_factory, grads_runs) -> tuple[dict, Path]:
    """The TP = 1 step's result and the file holding it (its routing, replayed at EP = 2)."""
    folder = tmp_path_factory.mktemp("tp1")
    return grads_runs(1, folder, {"tp1": (qwen3_moe,)})["tp1"], folder / "tp1.pt"


@pytest.fixture(scope="module")
def ep2_runs(qwen3_moe, tp1_step, tmp_path_factory, grads_runs) -> dict:
    """The EP = 2 steps (right, planted, refusals) in one launch."""
    qwen2_moe = build_tiny_hf_model(tmp_path_factory.mktemp("qwen2_moe") / "qwen2_moe", QWEN2_MOE)
    replay = ("--expert-parallel", "--replay", tp1_step[1])
    return grads_runs(2, tmp_path_factory.mktemp("ep2"), {
        "ep2": (qwen3_moe, *replay, "--dump"),
        "no_routing_weight_reduce": (qwen3_moe, *replay, "--plant", "no_routing_weight_reduce"),
        "refusals": (qwen3_moe, "--moe-refusals", "--shared-expert-model", qwen2_moe),
    })


def test_ep2_gradients_match_tp1(tp1_step, ep2_runs, rel_l2, check_gradient_dumps):
    """Router replay at EP = 2 (the TP = 1 step's experts): every gradient, the experts gathered from both
    ranks, within GRAD_REL_L2_BOUND of the TP = 1 step's. Without replay the bf16 noise of the TP = 2
    forward flips some tokens' experts, a discrete change (measured and printed). The step's gradient dump
    (each rank's experts placed along dim 0, marked expert-parallel) reads back as exactly the reassembled
    gradients, and a planted placement bug is caught."""
    tp1, ep2 = tp1_step[0], ep2_runs["ep2"]
    check_gradient_dumps(ep2)
    assert all(torch.equal(a, b) for a, b in zip(ep2["routing"], tp1["routing"], strict=True))
    assert ep2["grads"].keys() == tp1["grads"].keys()
    assert all(g.shape == tp1["grads"][name].shape for name, g in ep2["grads"].items())
    worst = {name: rel_l2(g, tp1["grads"][name]) for name, g in ep2["grads"].items()}
    print("worst EP=2 vs TP=1 gradient rel L2:", max(worst.values()), max(worst, key=worst.get))
    print("router / experts:", {name: f"{value:.2e}" for name, value in worst.items() if ".mlp." in name})
    assert max(worst.values()) <= GRAD_REL_L2_BOUND, worst
    assert abs(ep2["loss"].item() - tp1["loss"].item()) < 1e-3


def test_router_gradient_without_the_other_ranks_experts_is_caught(tp1_step, ep2_runs, rel_l2):
    router = {name: rel_l2(g, tp1_step[0]["grads"][name]) for name, g in ep2_runs["no_routing_weight_reduce"][
        "grads"].items() if name.endswith("mlp.router.weight")}
    print("planted: router gradient rel L2:", router)
    assert router and min(router.values()) > 10 * GRAD_REL_L2_BOUND, router


def test_unsupported_moe_layouts_are_refused(ep2_runs):
    found = ep2_runs["refusals"]
    assert "vLLM's TP-sharded experts are not built" in found["tp_without_ep"], found
    assert "a shared expert at expert_model_parallel_size > 1 is not built" in found["shared_expert"], found

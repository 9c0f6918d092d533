"""Shared by the tests that compare a parallel trainer with a parallel vLLM engine: one rollout of fixed requests."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vllm_align.engine.tiny_models import random_token_sequences
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)

PROMPT_LENGTHS = (1, 9, 33, 4)
SAMPLED_PROMPT_LENGTHS = (3, 20, 41)
MAX_TOKENS = (14, 4, 9)   # requests finish at different steps: the decode batch shrinks 3 -> 2 -> 1


@pytest.fixture(scope="session")
def engine_rollout():
    """``rollout(checkpoint, vocab_size, config) -> {"prompts", "prompt", "completions", "max_tokens"}``: an
    engine started with ``config`` gives the prompt logprobs of fixed prompts and samples fixed requests
    (temperature 1, seeded, ``max_tokens`` per request), then is shut down."""
    from vllm import SamplingParams

    def rollout(checkpoint: Path, vocab_size: int, config: ReferenceEngineConfig) -> dict:
        prompts = random_token_sequences(PROMPT_LENGTHS, vocab_size=vocab_size, seed=21)
        sampled_prompts = random_token_sequences(SAMPLED_PROMPT_LENGTHS, vocab_size=vocab_size, seed=22)
        params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, seed=200 + i, ignore_eos=True)
                  for i, n in enumerate(MAX_TOKENS)]
        llm = start_reference_engine(checkpoint, config)
        try:
            return {"prompts": prompts, "prompt": prompt_logprobs(llm, prompts),
                    "completions": sample_completions(llm, sampled_prompts, params), "max_tokens": list(MAX_TOKENS)}
        finally:
            shutdown_engine(llm)

    return rollout


@pytest.fixture
def assert_equals_engine(max_delta):
    """``check(label, ours, rollout)``: a parallel trainer's logprobs ``ours`` (``tensor_parallel_logprobs`` of
    the rollout's requests in every layout of ``SAMPLED_LAYOUTS``) equal the engine's of ``rollout`` (from
    ``engine_rollout``) bitwise, prompt and sampled-token logprobs; the sampled requests ran to their
    ``max_tokens``. ``label`` names the layout in the printed deltas."""
    import torch

    from megatron_vllm_align.megatron.logprobs import SAMPLED_LAYOUTS

    def check(label: str, ours: dict, rollout: dict) -> None:
        completions = rollout["completions"]
        assert [len(c.tokens) for c in completions] == rollout["max_tokens"]
        assert max_delta(f"{label} trainer (prompt)", ours["prompt"], rollout["prompt"], f"{label} engine") == 0.0
        assert all(torch.equal(a, b) for a, b in zip(ours["prompt"], rollout["prompt"], strict=True))
        engine_sampled = [c.logprobs for c in completions]
        for i, layout in enumerate(SAMPLED_LAYOUTS):
            key = "sampled" if i == 0 else f"sampled.{layout}"
            delta = max_delta(f"{label} trainer (sampled, {layout})", ours[key], engine_sampled, f"{label} engine")
            assert delta == 0.0
            assert all(torch.equal(a, b) for a, b in zip(ours[key], engine_sampled, strict=True))

    return check


@pytest.fixture(scope="session")
def torchrun_runs():
    """``runs(worker, nproc, folder, {name: args}) -> {name: result}``: the torchrun ``worker`` (a path under
    ``workers/`` taking ``--out FILE`` and ``--runs``, ``workers/batch.py``) on ``nproc`` ranks (one thread
    each), every named run in one launch, each with its ``args`` and ``--out folder/<name>.pt``; the results
    read back."""
    import json
    import os
    import subprocess

    import torch

    from megatron_vllm_align.utils.torchrun import torchrun_command

    repo = Path(__file__).resolve().parents[2]

    def runs(worker: Path, nproc: int, folder: Path, named: dict[str, tuple]) -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps([*map(str, args), "--out", str(folder / f"{name}.pt")]) for name, args in named.items()]
        (folder / "runs.jsonl").write_text("\n".join(lines) + "\n")
        command = torchrun_command(nproc, str(worker), "--runs", str(folder / "runs.jsonl"))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-5000:]}"
        return {name: torch.load(folder / f"{name}.pt", weights_only=False) for name in named}

    return runs


@pytest.fixture(scope="session")
def grads_runs(torchrun_runs):
    """``runs(nproc, folder, {name: (model, *args)}) -> {name: result}``: ``workers/tensor_parallel_grads.py``
    (``torchrun_runs``), each run for its checkpoint ``model`` (vocabulary 512) with its own ``args``."""
    worker = Path(__file__).parent / "workers" / "tensor_parallel_grads.py"

    def runs(nproc: int, folder: Path, named: dict[str, tuple]) -> dict:
        return torchrun_runs(worker, nproc, folder, {name: ("--model", model, "--vocab-size", 512, *args)
                                                      for name, (model, *args) in named.items()})

    return runs


@pytest.fixture(scope="session")
def rel_l2():
    """``rel_l2(a, b) -> |a - b| / |b|`` (L2 norms, float64)."""
    return lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="session")
def check_gradient_dumps(rel_l2):
    """``check(result)`` for a ``grads_runs`` result run with ``--dump``: the GradientDumper's dump, read back
    with ``load_gradient_dump``, is bitwise the reassembled gradient of every parameter; the planted dump with
    every shard at rank 0's place is refused by the loader; the planted dump of a gated ``linear_fc1`` shard as
    one block reads back wrong ``linear_fc1`` gradients (checked when the model has a gated dense MLP)."""
    import torch

    def check(result: dict) -> None:
        grads, dump = result["grads"], result["dump"]
        assert dump.keys() == grads.keys()
        differ = [name for name, grad in grads.items() if not torch.equal(dump[name], grad)]
        assert not differ, differ
        assert result["dump_rank0_offsets"] is not None and "replicas disagree" in result["dump_rank0_offsets"]
        fc1 = [name for name in grads if ".linear_fc1.weight" in name]
        one_block = result["dump_fc1_one_block"]
        assert all(rel_l2(one_block[name], grads[name]) > 0.5 for name in fc1), fc1
        assert all(torch.equal(one_block[name], grads[name]) for name in grads if name not in fc1)

    return check

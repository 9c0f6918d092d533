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


@pytest.fixture(scope="session")
def grads_worker():
    """``run(model, out, nproc, *args) -> dict``: ``workers/tensor_parallel_grads.py`` on ``nproc`` torchrun
    ranks (one thread each) for the checkpoint ``model`` (vocabulary 512), writing to ``out``; its result."""
    import os
    import subprocess

    import torch

    from megatron_vllm_align.utils.torchrun import torchrun_command

    repo = Path(__file__).resolve().parents[2]
    worker = Path(__file__).parent / "workers" / "tensor_parallel_grads.py"

    def run(model: Path, out: Path, nproc: int, *args: str) -> dict:
        command = torchrun_command(nproc, str(worker), "--model", str(model), "--out", str(out), "--vocab-size", "512",
                                   *args)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-5000:]}"
        return torch.load(out)

    return run


@pytest.fixture(scope="session")
def rel_l2():
    """``rel_l2(a, b) -> |a - b| / |b|`` (L2 norms, float64)."""
    return lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

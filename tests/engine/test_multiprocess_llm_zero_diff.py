"""Sampled tokens from vLLM's ``LLM`` with V1 multiprocessing on (its default: the engine core in its
own process) equal the trainer bit for bit with MVA_INVARIANT=1; with it off they do not.

This test process runs engines in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so each ``LLM``
runs in a child process, tests/engine/workers/multiprocess_llm.py, without that variable and with
``MVA_INVARIANT`` 1 or 0 (:func:`~megatron_vllm_align.engine.server.server_env`), the engine's
OpenMP threads on every CPU (:func:`~megatron_vllm_align.engine.server.omp_threads_on_all_cpus`).
Qwen3 at Qwen3-0.6B widths (2 layers), eager, chunked prefill in steps of at most 64 tokens, prefix
caching on, at most 4 requests running at once. Workload: ``engine.serving_workload`` with 16
requests, prompts of 3 to 300 tokens, every fourth behind a shared 128-token prefix, outputs of 1
to 24 tokens and one of 48 decoded alone at the end, submitted in one ``generate`` call
(temperature 1, unseeded). The workers write their completions to a JSON file (atomically); the
aligned trainer (MVA_INVARIANT=1 in this process) recomputes every sampled token of both runs.

The invariant run: the plugin's line from the ``LLM``'s process and from every vLLM process it
started (its engine core, another pid, and the engine's worker), and max |delta| = 0 on every
sampled token. The control (MVA_INVARIANT=0): no plugin line,
and a difference > 0, else the test fails saying the workload does not exercise batch dependence.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.server import invariance_pids, omp_threads_on_all_cpus, server_env, vllm_processes
from megatron_vllm_align.engine.serving_workload import ServingWorkload
from megatron_vllm_align.engine.tiny_models import QWEN3_0_6B_WIDTHS, TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.megatron.logprobs import completion_logprobs
from megatron_vllm_align.validation.logprob_mismatch import ControlDelta

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

WORKER = Path(__file__).parent / "workers" / "multiprocess_llm.py"
QWEN3_06B_WIDTHS = TinyModelConfig(seed=9, **QWEN3_0_6B_WIDTHS)
WORKLOAD = ServingWorkload(requests=16, max_prompt_tokens=300, max_new_tokens=48, shared_prefix_tokens=128,
                           chunk_tokens=64)
MAX_NUM_SEQS = 4
KV_CACHE_BYTES = 256 * 1024 * 1024
TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{invariant: (checkpoint, worker output, worker log text)}``: both workers run concurrently."""
    root = tmp_path_factory.mktemp("multiprocess_llm")
    checkpoint = build_tiny_hf_model(root / "qwen3_0.6b_widths", QWEN3_06B_WIDTHS)
    requests = WORKLOAD.build(QWEN3_06B_WIDTHS.vocab_size, QWEN3_06B_WIDTHS.max_position_embeddings, seed=3)
    (root / "requests.json").write_text(json.dumps({"prompts": requests.prompts, "max_tokens": requests.max_tokens}))
    launched = {}
    for invariant in (True, False):
        name = "invariant" if invariant else "off"
        log = open(root / f"{name}.log", "wb")   # noqa: SIM115 (closed below)
        command = [sys.executable, str(WORKER), "--model", str(checkpoint), "--requests", str(root / "requests.json"),
                   "--out", str(root / f"{name}.json"), "--max-num-seqs", str(MAX_NUM_SEQS),
                   "--max-num-batched-tokens", str(WORKLOAD.chunk_tokens), "--kv-cache-bytes", str(KV_CACHE_BYTES)]
        launched[invariant] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                env=server_env(invariant, None, omp_threads_on_all_cpus())),
                               log, root / name)
    results = {}
    try:
        for invariant, (process, log, stem) in launched.items():
            try:
                process.wait(timeout=TIMEOUT_S)
            finally:
                log.close()
            text = stem.with_suffix(".log").read_text(errors="replace")
            tail = "\n".join(text.splitlines()[-40:])
            assert process.returncode == 0, (f"multiprocess LLM worker (MVA_INVARIANT={int(invariant)}) exited "
                                             f"{process.returncode}; log {stem}.log:\n{tail}")
            results[invariant] = (json.loads(stem.with_suffix(".json").read_text()), text)
    finally:
        for process, log, _ in launched.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    return {"checkpoint": checkpoint, "requests": requests, **results}


def recompute(trainer, output: dict) -> tuple[ControlDelta, int]:
    """The trainer against one worker's completions: (max |delta| over the sampled tokens, tokens that differ)."""
    completions = output["completions"]
    with torch.no_grad():
        ours = completion_logprobs(trainer, [c["prompt"] for c in completions], [c["tokens"] for c in completions])
    engine = [torch.tensor(c["logprobs"], dtype=torch.float32) for c in completions]
    delta = torch.cat([(a.double() - b.double()).abs() for a, b in zip(ours, engine, strict=True)])
    return ControlDelta(float(delta.max()), delta.numel()), int((delta > 0).sum())


def test_multiprocess_llm_sampled_tokens_equal_trainer_and_control_differs(runs, require_batch_dependence):
    (on, on_log), (off, off_log) = runs[True], runs[False]
    requests = runs["requests"]
    for output in (on, off):
        assert output["multiprocessing"] is True, output["engine_core_client"]
        assert [c["prompt"] for c in output["completions"]] == requests.prompts
        assert [len(c["tokens"]) for c in output["completions"]] == requests.max_tokens
    processes = vllm_processes(on_log)
    engine_cores = {pid for pid, name in processes.items() if name.startswith("EngineCore")}
    assert engine_cores and on["pid"] not in engine_cores, processes
    assert invariance_pids(on_log) >= {on["pid"], *processes}, (
        f"invariance plugin installed in pids {sorted(invariance_pids(on_log))}; the LLM's process is {on['pid']}, "
        f"its vLLM processes {processes}")
    assert not invariance_pids(off_log)

    init_single_process_cpu(seed=1234)
    trainer = build_gpt_from_hf(runs["checkpoint"], align=True)
    aligned, differing = recompute(trainer, on)
    print(f"aligned trainer vs multiprocess LLM (MVA_INVARIANT=1): max |delta| = {aligned.max_abs_delta_logprob:.3g}, "
          f"{differing} of {aligned.tokens} sampled tokens differ", flush=True)
    assert aligned.max_abs_delta_logprob == 0.0 and differing == 0
    control, differing = recompute(trainer, off)
    print(f"control: {differing} of {control.tokens} sampled tokens differ", flush=True)
    require_batch_dependence(control, f"multiprocess LLM, {WORKLOAD.requests} requests, prompts of 3 to "
                                      f"{WORKLOAD.max_prompt_tokens} tokens, max_num_seqs {MAX_NUM_SEQS}, "
                                      f"{WORKLOAD.chunk_tokens}-token chunks")

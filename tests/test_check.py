"""``python -m megatron_vllm_align check --model DIR`` as a user runs it on a checkpoint of their own:
bit-exact (prompt and sampled-token logprobs, layer 1 at the model's widths) on a tiny Llama (with the
user's ``--engine-args`` applied), a tiny Qwen3-MoE (the engine's routing replayed, and the trainer's own
routing in a second row), a Llama-3.2-1B-width checkpoint with llama3 RoPE scaling and a Qwen3-0.6B-width
one (random weights, 2 layers); a planted trainer bug is reported with exit 1, naming the op where the
activations first diverge; unsupported features, unknown or conflicting engine flags and a compiled engine
are refused with one error naming them (exit 2). ``check --server URL`` is tested against the servers of
tests/engine/test_server_zero_diff.py."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.serving_workload import ServingWorkload
from megatron_vllm_align.engine.tiny_models import QWEN3_0_6B_WIDTHS as QWEN3_06B
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.invariance.row_tiles import RowRule
from megatron_vllm_align.megatron.cpu_report import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
LLAMA32_1B = dict(hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64, intermediate_size=8192,
                  vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# The wide models (where the trainer's recompute costs most) are checked on a smaller serving workload;
# the widest (hidden 2048, FFN 8192) on a smaller one still (its second arm: requests 0, 4 and 8).
SMALL_WORKLOAD = ("--requests", "16", "--max-prompt-tokens", "300", "--max-new-tokens", "32")
WIDEST_WORKLOAD = ("--requests", "10", "--max-prompt-tokens", "300", "--max-new-tokens", "16")


def sampled_tokens(*args: str, arm: bool = False) -> int:
    """Tokens check samples: every request runs to its max_tokens (ignore_eos), whatever the model; ``arm``:
    those of the second sampling arm (every fourth request, not the longest-lived one)."""
    sizes = {flag: int(value) for flag, value in zip(args[::2], args[1::2]) if value.isdigit()}
    workload = ServingWorkload(requests=sizes.get("--requests", 64), max_new_tokens=sizes.get("--max-new-tokens", 128))
    max_tokens = workload.build(vocab_size=512, max_model_len=4096).max_tokens
    return sum(n for n in max_tokens[::4] if n < max(max_tokens)) if arm else sum(max_tokens)


def run_check_command(model: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``python -m megatron_vllm_align check`` as a user runs it: its own process (its console, its log file)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MVA_INVARIANT", "WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-m", "megatron_vllm_align", "check", "--model", str(model),
                           "--output-dir", str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    summary = out / "check.json"
    return done, json.loads(summary.read_text()) if summary.exists() else None


def run_check_here(model: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """The same command's ``main`` in this process (no interpreter start: ~10 s of imports saved per check),
    returned in :func:`run_check_command`'s shape with what it printed (stdout; stderr is left to pytest's
    own capture: a logging handler vLLM creates here must not hold a per-test capture stream that closes)."""
    import vllm  # noqa: F401  (vLLM binds its log handler to sys.stdout when imported: not to the redirect)

    from megatron_vllm_align.check import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["--model", str(model), "--output-dir", str(out), *args])
    summary = out / "check.json"
    return subprocess.CompletedProcess(["check"], status, printed.getvalue(), ""), \
        json.loads(summary.read_text()) if summary.exists() else None


@pytest.mark.engine
@pytest.mark.parametrize("name, config, workload", [
    ("tiny_llama", TinyModelConfig(seed=3), ("--engine-args", "--max-num-seqs 24 --max-num-batched-tokens 128")),
    ("tiny_qwen3_moe", TinyModelConfig(architecture="qwen3_moe", seed=6), ()),
    ("llama3.2_1b_widths_llama3_rope", TinyModelConfig(seed=3, **LLAMA32_1B), WIDEST_WORKLOAD),
    ("qwen3_0.6b_widths", TinyModelConfig(seed=9, **QWEN3_06B), SMALL_WORKLOAD),
])
def test_check_is_bit_exact_on_the_models_we_claim(tmp_path, name, config, workload):
    """The tiny Llama runs the command in its own process (its quiet console and log file checked); the
    others run its ``main`` here (the same code path after the interpreter start)."""
    model = build_tiny_hf_model(tmp_path / name, config)
    cli = name == "tiny_llama"
    done, summary = (run_check_command(model, tmp_path / "out", *workload) if cli
                     else run_check_here(model, tmp_path / "out", *workload))
    tokens = sampled_tokens(*workload)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # the workload at temperature 1 and, in the same batch, a quarter of it at 0.7 / 0.95 / 20 (processed)
    assert summary["bit_exact"] == {"prompt": True, "sampled": True, "sampled_processed": True}
    assert summary["layer1_passed"]
    assert summary["logprobs"]["sampled"]["num_tokens"] == tokens and summary["logprobs"]["prompt"]["num_tokens"] == 117
    assert summary["logprobs"]["sampled_processed"]["num_tokens"] == sampled_tokens(*workload, arm=True) > 0
    assert summary["sampling"]["logprobs"] == "processed_logprobs" and summary["sampling"]["processed_arm"] == {
        "temperature": 0.7, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "every_nth_request": 4}
    assert summary["first_divergence"] == {"prompt": None, "sampled": None, "sampled_processed": None}
    assert summary["widths"]["hidden"] == config.hidden_size and summary["invariant"]
    cases = {row["case"] for row in summary["layer1"]}
    assert f"rms_norm[hidden={config.hidden_size}]" in cases
    assert any(case.startswith("routed_experts") for case in cases) == (config.architecture == "qwen3_moe")
    report = (tmp_path / "out" / "check.md").read_text()
    assert "verdict: **bit-exact** (exit 0)" in report and "| sampled-token logprobs (decode) | True | 0 |" in report
    assert f"{'sampled-token logprobs (decode)':<50} {'True':>9} {0:>13} {tokens:>7}" in done.stdout
    assert f"{'  processed, temperature=0.7, top_p=0.95, top_k=20':<50} {'True':>9} {0:>13}" in done.stdout
    assert summary["calibration"]["exercised"] is not None and "batch dependence" in report
    # where it ran, and the row rule the invariance layer measured for each of the model's linear shapes
    assert summary["machine"]["cpu"] == cpu_isa().describe() and f"- machine: {cpu_isa().describe()}" in report
    rules = summary["machine"]["row_rules"]
    for k, n in ((config.hidden_size, config.vocab_size), (config.num_heads * config.head_dim, config.hidden_size)):
        assert any(f" {k} -> {n} " in kernel for kernel in rules), (k, n, rules)
    assert set(rules.values()) <= {rule.value for rule in RowRule} and "## Row rules measured" in report
    groups = summary["machine"]["attention_groups"]
    assert any(f" {config.num_heads // config.num_kv_heads} x {config.head_dim} " in shape for shape in groups), groups
    assert all(group >= 1 for group in groups.values()) and "query groups of" in report
    if config.architecture == "qwen3_moe" or cli:   # (in this process other checks may have measured experts)
        assert bool(summary["machine"]["expert_rules"]) == (config.architecture == "qwen3_moe")
    if cli:
        assert len((done.stdout + done.stderr).splitlines()) < 25
        assert "vLLM" in (tmp_path / "out" / "engine.log").read_text()
    resolved = summary["engine"]["resolved"]
    assert resolved["enforce_eager"] and resolved["compilation_mode"] == "NONE"
    if "--engine-args" in workload:   # the user's flags reach the engine, as vLLM resolved them
        assert summary["engine"]["overrides"] == {"max_num_seqs": 24, "max_num_batched_tokens": 128}
        assert resolved["max_num_seqs"] == 24 and resolved["max_num_batched_tokens"] == 128
        assert '"max_num_seqs": 24' in report and "--engine-args --max-num-seqs 24" in done.stdout
    else:
        assert summary["engine"]["overrides"] == {} and resolved["max_num_seqs"] != 24
    if config.architecture == "qwen3_moe":   # the verdict's row replays the engine's routing; the second does not
        own = summary["logprobs"]["sampled_own_routing"]
        assert own["num_tokens"] == tokens and "sampled_own_routing" not in summary["bit_exact"]
        routing = summary["routing"]
        assert routing["compared"] > routing["tokens"] > 0
        assert (routing["differing"] == 0) == (own["max_abs_delta_logprob"] == 0.0), (routing, own)
        assert "| same, trainer's own routing |" in report and "decides the verdict" in report
    else:
        assert "sampled_own_routing" not in summary["logprobs"] and summary["routing"] == {}


@pytest.mark.engine
def test_check_without_invariance_never_claims_bit_exact(tmp_path):
    """``--no-invariant`` on a Qwen3-0.6B-width checkpoint: the serving-shaped workload (the wide models'
    :data:`SMALL_WORKLOAD`, as in the bit-exact case of the same checkpoint) makes the engine's
    sampled-token logprobs depend on its batch, so check reports NOT bit-exact (exit 1) with the calibration
    showing the dependence, or, on a machine where the workload did not exercise it, says so; never a bare
    "bit-exact"."""
    model = build_tiny_hf_model(tmp_path / "qwen3", TinyModelConfig(seed=9, **QWEN3_06B))
    done, summary = run_check_here(model, tmp_path / "out", "--no-invariant", "--seeds", "0", *SMALL_WORKLOAD)
    print(summary["verdict"], summary["calibration"], summary["logprobs"]["sampled"]["max_abs_delta_logprob"])
    assert summary["verdict"] != "bit-exact" and not summary["invariant"]
    if summary["calibration"]["exercised"]:
        assert done.returncode == 1 and not summary["bit_exact"]["sampled"]
    else:
        assert done.returncode == 0 and "did not exercise batch dependence" in summary["verdict"]


@pytest.mark.engine
def test_planted_trainer_bug_is_reported_at_its_op(tmp_path, monkeypatch):
    """The trainer's layer-1 down projection planted off by 2^-4 (deployed value refreshed): both kinds of
    logprobs differ, the check exits 1 and names ``layer 1 mlp (down_proj)`` for each."""
    import megatron_vllm_align.megatron as megatron
    from megatron_vllm_align.check import CheckConfig, markdown, run_check, summary
    from megatron_vllm_align.ops.refresh import refresh_deployed_weights

    build = megatron.build_gpt_from_hf

    def planted(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.no_grad():
            model.decoder.layers[1].mlp.linear_fc2.weight.add_(2.0 ** -4)
        refresh_deployed_weights(model)
        return model

    monkeypatch.setattr(megatron, "build_gpt_from_hf", planted)
    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    config = CheckConfig(model=model, output_dir=tmp_path / "out", seeds=0)
    result = run_check(config)
    assert result.exit_status == 1 and not result.exact("prompt") and not result.exact("sampled")
    assert not result.exact("sampled_processed")
    for kind in ("prompt", "sampled"):
        assert result.divergence[kind].startswith("layer 1 mlp (down_proj): "), result.divergence[kind]
    report = markdown(result, config)
    assert "NOT bit-exact" in report and "- prompt: layer 1 mlp (down_proj): " in report
    assert result.layer1_passed is None and summary(result, config)["layer1_passed"] is None  # seeds=0: not run
    assert "| not run (--seeds 0) |" in markdown(result, config)


@pytest.mark.parametrize("edit, message", [
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "longrope", "factor": 4.0}},
     "rope type 'longrope' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type 'gemma2'"),
])
def test_unsupported_feature_is_one_clear_error(tmp_path, capfd, edit, message):
    """Refused before any engine starts: one line on stderr, exit 2, no summary (in this process: the
    command's own subprocess form is test_bad_tensor_parallel_sizes_are_refused)."""
    from megatron_vllm_align.check import main

    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    capfd.readouterr()
    assert main(["--model", str(model), "--output-dir", str(tmp_path / "out")]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"check: cannot check {model}: ") and message in lines[0], lines
    assert not (tmp_path / "out" / "check.json").exists()


def test_bad_tensor_parallel_sizes_are_refused(tmp_path):
    """TP = 2 runs for dense models (tests/distributed/test_tensor_parallel.py) and MoE models
    (tests/distributed/test_expert_parallel.py); --tp 0 is a usage error."""
    model = build_tiny_hf_model(tmp_path / "moe", TinyModelConfig(architecture="qwen3_moe", seed=6))
    done, _ = run_check_command(model, tmp_path / "out", "--tp", "0")
    assert done.returncode == 2 and "--tp and --trainer-tp >= 1" in done.stderr


@pytest.mark.parametrize("flags, message", [
    ("--max-num-seqs 8 --no-such-flag 3", "unrecognized arguments: --no-such-flag 3"),
    ("--max-num-seqs many", "argument --max-num-seqs: invalid int value: 'many'"),
    ("--model other --tensor-parallel-size 2", "--model: the check serves the checkpoint of its own --model; "
                                               "--tensor-parallel-size 2 is not the check's --tp 1"),
    ("--dtype float16", "--dtype float16: the aligned trainer reproduces the bfloat16 engine"),
    ("--quantization fp8", "--quantization fp8: pass the check's --quantization"),
])
def test_engine_args_are_vllms_and_conflicts_are_one_error(tmp_path, capfd, flags, message):
    """The user's serving flags go through vLLM's own parser before anything starts: an unknown flag, a
    bad value or a flag the comparison cannot accept is one line on stderr and exit 2, not a traceback."""
    from megatron_vllm_align.check import main

    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    capfd.readouterr()
    assert main(["--model", str(model), "--output-dir", str(tmp_path / "out"), "--engine-args", flags]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"check: cannot check {model}: --engine-args ") and \
        message in lines[0], lines
    assert not (tmp_path / "out" / "check.json").exists()


SAMPLING_FLAGS = ("--temperature", "0.7", "--top-p", "0.95", "--top-k", "20", "--min-p", "0.05")


@pytest.mark.engine
def test_check_with_sampling_flags_is_bit_exact_on_processed_logprobs(tmp_path):
    """``--temperature 0.7 --top-p 0.95 --top-k 20 --min-p 0.05`` on a tiny Llama, a small serving workload:
    the engine runs in ``processed_logprobs`` mode and the trainer's logprobs of the sampled tokens under the
    same SamplingParams equal its own bit for bit (the raw ones would not: temperature 0.7)."""
    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    workload = ("--requests", "8", "--max-prompt-tokens", "64", "--max-new-tokens", "16", "--seeds", "0")
    done, summary = run_check_command(model, tmp_path / "out", *SAMPLING_FLAGS, *workload)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert summary["sampling"] == {"logprobs": "processed_logprobs", "temperature": 0.7, "top_p": 0.95, "top_k": 20,
                                   "min_p": 0.05}
    assert summary["engine"]["vllm_arguments"]["logprobs_mode"] == "processed_logprobs"
    assert summary["bit_exact"] == {"prompt": True, "sampled": True}
    assert summary["logprobs"]["sampled"]["num_tokens"] == sampled_tokens(*workload[:6])


@pytest.mark.parametrize("options, emulated", [
    ({}, False),
    ({"tensor_parallel_size": 2}, False),                # the trainer runs at TP 2 itself
    ({"tensor_parallel_size": 2, "trainer_tensor_parallel_size": 1}, True),
    ({"tensor_parallel_size": 2, "trainer_tensor_parallel_size": 1, "layout_emulation": False}, False),
    ({"tensor_parallel_size": 4, "trainer_tensor_parallel_size": 1}, False),  # not emulated: reported as differing
])
def test_a_tp1_trainer_computes_the_shards_of_a_tp2_engine_only(tmp_path, options, emulated):
    from megatron_vllm_align.check import CheckConfig

    assert CheckConfig(model=tmp_path, **options).emulated_layout is emulated


@pytest.mark.parametrize("options, arm", [
    ({}, True),
    ({"processed_arm": False}, False),
    ({"temperature": 0.7}, False),                       # the flags' own sampling replaces the arm
    ({"server": "http://127.0.0.1:9"}, False),
    ({"tensor_parallel_size": 2}, False),
    ({"trainer_tensor_parallel_size": 2}, False),
])
def test_the_second_sampling_arm_runs_on_the_checks_own_engine_at_tp_1(tmp_path, options, arm):
    """Which runs sample every fourth request again at 0.7 / 0.95 / 20, the engine's logprobs mode, and the
    requests: seeded after the workload's, never the request decoded alone at the end."""
    from megatron_vllm_align.check import PROCESSED_ARM, CheckConfig, _sampled_requests

    config = CheckConfig(model=tmp_path, **options)
    assert (config.second_arm == PROCESSED_ARM) == arm
    assert config.logprobs_mode == ("processed_logprobs" if arm or config.processed else "raw_logprobs")
    requests = ServingWorkload(requests=16, max_new_tokens=32).build(vocab_size=512, max_model_len=4096)
    prompts, params, n = _sampled_requests(config, requests)
    assert n == 16 and prompts[:n] == requests.prompts and [p.seed for p in params[:n]] == list(range(16))
    if arm:   # requests 0, 4, 12 again (8 is the longest-lived: 32 tokens, decoded alone)
        assert requests.max_tokens[8] == 32 and prompts[n:] == [requests.prompts[i] for i in (0, 4, 12)]
        assert [(p.seed, p.temperature, p.top_p, p.top_k, p.max_tokens) for p in params[n:]] == [
            (16 + i, 0.7, 0.95, 20, requests.max_tokens[j]) for i, j in enumerate((0, 4, 12))]
    else:
        assert len(prompts) == len(params) == n


def test_layer1_runs_the_processed_logprob_op_only_with_sampling_flags(tmp_path):
    from megatron_vllm_align.check import layer1_ops
    from megatron_vllm_align.megatron.hf_checkpoint import read_hf_config

    hf = read_hf_config(build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3)))
    assert "processed_logprob" in layer1_ops(hf, None, processed=True)
    assert "processed_logprob" not in layer1_ops(hf, None)


@pytest.mark.parametrize("extra, message", [
    (("--top-p", "1.5"), "--temperature/--top-p/--top-k/--min-p: SamplingParams: top_p must be in (0, 1], got 1.5"),
    (("--temperature", "0.005"), "SamplingParams.temperature: vLLM replaces 0.005 by 0.01"),
    (("--temperature", "0.7", "--server", "http://127.0.0.1:9"), "with --server: the server's --logprobs-mode"),
    (("--temperature", "0.7", "--trainer-tp", "2"), "need the trainer at TP 1"),
    (("--temperature", "0.7", "--engine-args", "--logprobs-mode raw_logprobs"),
     "--logprobs-mode raw_logprobs: the check compares processed_logprobs"),
])
def test_sampling_flags_the_check_cannot_compare_are_one_error(tmp_path, capfd, extra, message):
    from megatron_vllm_align.check import main

    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    capfd.readouterr()
    assert main(["--model", str(model), "--output-dir", str(tmp_path / "out"), *extra]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"check: cannot check {model}: ") and message in lines[0], lines
    assert not (tmp_path / "out" / "check.json").exists()


@pytest.mark.engine
def test_a_compiled_engine_is_refused_by_name(tmp_path, capfd):
    """``--engine-args --no-enforce-eager`` (a single flag, no quoting tricks needed) asks for vLLM's compiled
    engine: the invariance layer refuses it when the engine resolves its config, and the check exits 2 with
    that message; ``--no-invariant`` would run it."""
    from megatron_vllm_align.check import main

    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    capfd.readouterr()
    assert main(["--model", str(model), "--output-dir", str(tmp_path / "out"), "--seeds", "0",
                 "--engine-args", "--no-enforce-eager"]) == 2
    # (vLLM's own log lines reach this process's stderr too: its handler was set up before the check's log file)
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("check: ")]
    assert len(err) == 1 and err[0].startswith(f"check: cannot check {model}: ") and \
        "this engine is compiled" in err[0] and "enforce_eager=True" in err[0], err


def test_own_routing_row_counts_routing_that_differs(tmp_path):
    """The MoE comparison of the trainer's own routing with the engine's: the trainer's recorded routing
    given back as the engine's agrees everywhere; one expert of one token changed is counted once."""
    from megatron_vllm_align.check import OWN_ROUTING, CheckResult, _own_routing
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.engine.vllm_reference import SampledCompletion
    from megatron_vllm_align.megatron import build_gpt_from_hf, init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import completion_logprobs
    from megatron_vllm_align.megatron.vllm_moe import recorded_routing

    config = TinyModelConfig(architecture="qwen3_moe", seed=6)
    init_single_process_cpu()
    model = build_gpt_from_hf(build_tiny_hf_model(tmp_path / "moe", config), align=True)
    prompts, tokens = random_token_sequences((9, 4), config.vocab_size, seed=1), \
        random_token_sequences((5, 3), config.vocab_size, seed=2)
    with torch.no_grad():
        own = completion_logprobs(model, prompts, tokens)
    routing = torch.stack(recorded_routing(model), dim=1)     # [tokens, MoE layers, top_k]
    rows = [routing[:14], routing[14:]]                        # per sequence: 9 + 5 and 4 + 3 tokens
    completions = [SampledCompletion(tuple(p), tuple(t), lp) for p, t, lp in zip(prompts, tokens, own)]
    result = CheckResult(model="moe", architecture="qwen3_moe", widths={})
    _own_routing(result, model, completions, [r[:-1] for r in rows])
    assert result.routing == {"compared": 2 * 19, "differing": 0, "tokens_with_a_differing_layer": 0, "tokens": 19}
    assert result.logprobs[OWN_ROUTING]["max_abs_delta_logprob"] == 0.0
    planted = rows[1][:-1].clone()
    k = planted.shape[-1]
    planted[2, 1, 0] = next(e for e in range(config.num_experts) if e not in planted[2, 1, :k].tolist())
    _own_routing(result, model, completions, [rows[0][:-1], planted])
    assert result.routing["differing"] == 1 and result.routing["tokens_with_a_differing_layer"] == 1

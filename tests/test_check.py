"""``python -m megatron_vllm_align check --model DIR`` as a user runs it on a checkpoint of their own:
bit-exact (prompt and sampled-token logprobs, layer 1 at the model's widths) on a tiny Llama, a tiny
Qwen3-MoE, a Llama-3.2-1B-width checkpoint with llama3 RoPE scaling and a Qwen3-0.6B-width one (random
weights, 2 layers); a planted trainer bug is reported with exit 1, naming the op where the activations
first diverge; unsupported features are refused with one error naming them (exit 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.serving_workload import ServingWorkload
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
LLAMA32_1B = dict(hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64, intermediate_size=8192,
                  vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# The wide models (where the trainer's recompute costs most) are checked on a smaller serving workload.
SMALL_WORKLOAD = ("--requests", "16", "--max-prompt-tokens", "300", "--max-new-tokens", "32")


def sampled_tokens(*args: str) -> int:
    """Tokens check samples: every request runs to its max_tokens (ignore_eos), whatever the model."""
    sizes = dict(zip(args[::2], map(int, args[1::2])))
    workload = ServingWorkload(requests=sizes.get("--requests", 64), max_new_tokens=sizes.get("--max-new-tokens", 128))
    return sum(workload.build(vocab_size=512, max_model_len=4096).max_tokens)
QWEN3_06B = dict(architecture="qwen3", hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)


def run_check_command(model: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("MVA_INVARIANT", "WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-m", "megatron_vllm_align", "check", "--model", str(model),
                           "--output-dir", str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    summary = out / "check.json"
    return done, json.loads(summary.read_text()) if summary.exists() else None


@pytest.mark.engine
@pytest.mark.parametrize("name, config, workload", [
    ("tiny_llama", TinyModelConfig(seed=3), ()),
    ("tiny_qwen3_moe", TinyModelConfig(architecture="qwen3_moe", seed=6), ()),
    ("llama3.2_1b_widths_llama3_rope", TinyModelConfig(seed=3, **LLAMA32_1B), SMALL_WORKLOAD),
    ("qwen3_0.6b_widths", TinyModelConfig(seed=9, **QWEN3_06B), SMALL_WORKLOAD),
])
def test_check_is_bit_exact_on_the_models_we_claim(tmp_path, name, config, workload):
    model = build_tiny_hf_model(tmp_path / name, config)
    done, summary = run_check_command(model, tmp_path / "out", *workload)
    tokens = sampled_tokens(*workload)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert summary["bit_exact"] == {"prompt": True, "sampled": True} and summary["layer1_passed"]
    assert summary["logprobs"]["sampled"]["num_tokens"] == tokens and summary["logprobs"]["prompt"]["num_tokens"] == 117
    assert summary["first_divergence"] == {"prompt": None, "sampled": None}
    assert summary["widths"]["hidden"] == config.hidden_size and summary["invariant"]
    cases = {row["case"] for row in summary["layer1"]}
    assert f"rms_norm[hidden={config.hidden_size}]" in cases
    assert any(case.startswith("routed_experts") for case in cases) == (config.architecture == "qwen3_moe")
    report = (tmp_path / "out" / "check.md").read_text()
    assert "verdict: **bit-exact** (exit 0)" in report and "| sampled-token logprobs (decode) | True | 0 |" in report
    assert f"sampled-token logprobs (decode)         True             0 {tokens:>7}" in done.stdout
    assert summary["calibration"]["exercised"] is not None and "batch dependence" in report
    assert len((done.stdout + done.stderr).splitlines()) < 25
    assert "vLLM" in (tmp_path / "out" / "engine.log").read_text()


@pytest.mark.engine
def test_check_without_invariance_never_claims_bit_exact(tmp_path):
    """``--no-invariant`` on a Qwen3-0.6B-width checkpoint: the serving-shaped workload makes the engine's
    sampled-token logprobs depend on its batch, so check reports NOT bit-exact (exit 1) with the calibration
    showing the dependence, or, on a machine where the workload did not exercise it, says so; never a bare
    "bit-exact"."""
    model = build_tiny_hf_model(tmp_path / "qwen3", TinyModelConfig(seed=9, **QWEN3_06B))
    done, summary = run_check_command(model, tmp_path / "out", "--no-invariant", "--seeds", "0")
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
def test_unsupported_feature_is_one_clear_error(tmp_path, edit, message):
    model = build_tiny_hf_model(tmp_path / "llama", TinyModelConfig(seed=3))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    done, summary = run_check_command(model, tmp_path / "out")
    assert done.returncode == 2 and summary is None
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"check: cannot check {model}: ") and message in lines[0], lines


def test_bad_tensor_parallel_sizes_are_refused(tmp_path):
    """TP = 2 runs for dense models (tests/distributed/test_tensor_parallel.py) and MoE models
    (tests/distributed/test_expert_parallel.py); --tp 0 is a usage error."""
    model = build_tiny_hf_model(tmp_path / "moe", TinyModelConfig(architecture="qwen3_moe", seed=6))
    done, _ = run_check_command(model, tmp_path / "out", "--tp", "0")
    assert done.returncode == 2 and "--tp and --trainer-tp >= 1" in done.stderr

"""The main job end to end (reduced: one layer-1 seed, two layer-3 steps): exit status, a
complete report whose numbers equal summary.json, TensorBoard events holding every documented
panel tag with the report's values, a quiet console (engine and library logs in engine.log); an
engine that fails to start leaves only the INCOMPLETE placeholder."""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_vllm_align.megatron.cpu_report import cpu_isa
from megatron_vllm_align.ops.registry import CaseContexts, layer1_cases
from megatron_vllm_align.report import ARMS, INCOMPLETE_MARKER, STEP_METRICS
from megatron_vllm_align.validation.layer2 import PRECISIONS, PROJECTIONS

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
PANELS_DOC = ROOT / "docs" / "panels.md"
# vLLM's log format: "(<process> pid=<pid>) <LEVEL> <mm-dd hh:mm:ss> [<file>:<line>] <message>"
VLLM_LOG_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] ")
SECTIONS = ("## Gradient contracts", "## Forward: trainer vs inference engine", "## Layer 1", "## Layer 2",
            "## Layer 3", "## Missing coverage")


def run_main_job(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_vllm_align", "--output-dir", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_job")
    done = run_main_job(out, "--seeds", "1", "--layer3-steps", "2")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return out, done, summary


def test_exit_status_zero_and_summary_table(job):
    out, done, summary = job
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["exit_status"] == 0 and summary["forward_exact"] and summary["layer1_passed"]
    assert summary["sampled_exact"] and summary["sampled"]["megatron_vllm_spec"]["num_tokens"] == 125
    assert summary["sampled"]["megatron_local_spec"]["max_abs_delta_logprob"] > 0.0
    assert summary["layer3"]["verdict"] == "pass"
    assert summary["machine"]["cpu"] == cpu_isa().describe() and summary["machine"]["row_rules"]
    assert ("bit-exact: prompt logprobs True, sampled tokens True   layer 1 passed: True   layer 3 verdict: pass"
            in done.stdout)
    assert f"report: {out / 'report.md'}" in done.stdout


def test_console_is_quiet_and_the_engine_logs_are_in_engine_log(job):
    out, done, _ = job
    console = (done.stdout + done.stderr).splitlines()
    assert len(console) < 40, "\n".join(console)
    assert console[0] == f"engine and library logs: {out / 'engine.log'}"
    assert len([line for line in console if line.startswith("[main job] ")]) == 8 and not done.stderr
    assert not [line for line in console if VLLM_LOG_LINE.search(line)]
    log = (out / "engine.log").read_text()
    assert "Initializing a V1 LLM engine (v0.32.0)" in log
    assert len([line for line in log.splitlines() if VLLM_LOG_LINE.search(line)]) > 20
    assert "UserWarning" in log     # Python warnings of the libraries (Megatron-Core's fallbacks)


def test_report_is_complete_and_shows_the_summary_values(job):
    out, _, summary = job
    text = (out / "report.md").read_text()
    assert INCOMPLETE_MARKER not in text.splitlines()[0]
    positions = [text.index(heading) for heading in SECTIONS]
    assert positions == sorted(positions)
    assert summary["forward"]["megatron_vllm_spec"]["max_abs_delta_logprob"] == 0.0
    assert text.index("prompt logprobs (prefill)") < text.index("sampled-token logprobs (decode")
    for name, m in [*summary["forward"].items(), *summary["sampled"].items()]:
        assert (f"| {name} | {m['max_abs_delta_logprob']:.6g} | {m['mean_abs_delta_logprob']:.6g} | "
                f"{m['token_mult_prob_error']:.9g} | {m['gen_kl_error']:.6g} | {m['k3_kl']:.6g} | "
                f"{m['num_tokens']} |") in text
    unbuilt = CaseContexts(bf16=None, fp8=None, moe=None)
    assert {row["case"] for row in summary["layer1"]} == {case.name for case in layer1_cases(unbuilt)}, \
        "the main job runs every registered layer-1 case"
    for row in summary["layer1"]:
        assert f"| {row['case']} | {row['passed']}/{row['total']} | {row['worst_rel_l2']:.4g} |" in text
    for s in summary["layer2"]["class_summary"]:
        assert (f"| {s['precision']} | {s['gradient']} | {s['module_class']} | {s['layers']} | "
                f"{s['min_cosine']:.6f} |") in text
    assert {s["precision"] for s in summary["layer2"]["class_summary"]} == set(PRECISIONS)
    layer3 = summary["layer3"]
    assert f"Verdict within the window: **{layer3['verdict'].upper()}** - {layer3['verdict_detail']}" in text
    for arm in ARMS:
        last = layer3["last_step"][arm]
        assert last["step"] == 2
        assert f"| {arm} | 2 | " + " | ".join(f"{float(last[m]):.6g}" for m in STEP_METRICS) + " |" in text
    for image in re.findall(r"\]\((plots/[^)]+\.png)\)", text):
        assert (out / image).read_bytes().startswith(b"\x89PNG")


def documented_tags(summary: dict) -> dict[str, set[str]]:
    """Every tag of docs/panels.md with its placeholders filled from this run, by kind."""
    values = {"module_class": PROJECTIONS, "precision": tuple(PRECISIONS), "gradient": ("dX", "dW"),
              "trainer": (*summary["forward"], *(f"{name}_sampled" for name in summary["sampled"])),
              "arm": ARMS, "plot": ("histogram", "qq", "scatter")}
    tags: dict[str, set[str]] = {"scalar": set(), "histogram": set(), "image": set()}
    rows = re.findall(r"^\| `([^`]+)` \| (scalar|histogram|image) \|.*\| ([^|]+) \|$", PANELS_DOC.read_text(),
                      flags=re.MULTILINE)
    rows = [(pattern, kind) for pattern, kind, written_by in rows if "main job" in written_by]
    assert len(rows) >= 20
    for pattern, kind in rows:
        names = re.findall(r"{(\w+)}", pattern)
        for combo in itertools.product(*(values[n] for n in names)):
            tags[kind].add(pattern.format(**dict(zip(names, combo))))
    return tags


def test_tensorboard_holds_every_documented_tag_with_the_report_values(job):
    out, _, summary = job
    events = EventAccumulator(str(out / "tensorboard"),
                              size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    events.Reload()
    found = events.Tags()
    expected = documented_tags(summary)
    assert expected["scalar"] <= set(found["scalars"])
    assert expected["histogram"] <= set(found["histograms"])
    assert expected["image"] <= set(found["images"])
    assert "custom_scalars__config__" in found["tensors"]          # the three-arm shared charts
    sampled = {f"{name}_sampled": m for name, m in summary["sampled"].items()}
    for trainer, m in {**summary["forward"], **sampled}.items():
        for metric in ("max_abs_delta_logprob", "mean_abs_delta_logprob", "token_mult_prob_error", "gen_kl_error",
                       "k3_kl"):
            assert events.Scalars(f"mismatch/{trainer}/{metric}")[-1].value == pytest.approx(m[metric], rel=1e-6,
                                                                                             abs=1e-12)
    for arm in ARMS:
        last = summary["layer3"]["last_step"][arm]
        for metric in STEP_METRICS:
            event = events.Scalars(f"layer3/{metric}/{arm}")[-1]
            assert (event.step, event.value) == (2, pytest.approx(last[metric], rel=1e-6))
    for s in summary["layer2"]["class_summary"]:
        cosines = events.Scalars(f"layer2.{s['module_class']}/{s['precision']}/{s['gradient']}/cosine")
        assert sorted(e.step for e in cosines) == list(range(s["layers"]))
        assert min(e.value for e in cosines) == pytest.approx(s["min_cosine"], rel=1e-6)


def test_engine_that_fails_to_start_gives_a_clear_error_and_no_complete_report(tmp_path):
    (tmp_path / "tiny_llama").mkdir()
    (tmp_path / "tiny_llama" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_')
    (tmp_path / "report.md").write_text("# megatron-vllm-align: main job report\n\n## Layer 3\n")  # an old run's
    (tmp_path / "summary.json").write_text("{}")
    done = run_main_job(tmp_path, "--seeds", "1", "--layer3-steps", "1")
    assert done.returncode == 2
    assert "main job failed: stage 'vLLM engine: prompt and sampled-token logprobs'" in done.stderr
    assert str(tmp_path / "tiny_llama" / "config.json") in done.stderr and "not a valid JSON" in done.stderr
    assert "Traceback" not in done.stderr and f"Engine and library logs: {tmp_path / 'engine.log'}" in done.stderr
    assert VLLM_LOG_LINE.search((tmp_path / "engine.log").read_text())
    assert not VLLM_LOG_LINE.search(done.stdout + done.stderr)
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(f"# {INCOMPLETE_MARKER}") and "## Layer" not in report
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "tensorboard").exists()

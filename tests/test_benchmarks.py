"""``make bench``'s plumbing: the runner merges each benchmark's ``--json`` figures under the documented
keys (``<benchmark>.<model>.<figure>``). Times are never asserted; the bytes saved for backward are
deterministic, so their ratio is (aligned <= native)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_run(benchmark: str, tmp_path) -> tuple[dict, str]:
    """``make bench --quick`` of one benchmark: (its merged figures, the runner's stdout)."""
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick", "--only", benchmark,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_runner_writes_the_spec_step_figures(tmp_path):
    figures, stdout = _quick_run("spec_step", tmp_path)
    assert set(figures) == {f"spec_step.tiny-t1.{name}" for name in
                            ("step_ratio", "saved_bytes_ratio", "peak_rss_growth_ratio")}
    assert all(math.isfinite(v) and v > 0 for v in figures.values())
    assert figures["spec_step.tiny-t1.saved_bytes_ratio"] <= 1.0
    assert "spec_step.tiny-t1.saved_bytes_ratio" in stdout


def test_runner_writes_the_layer2_overhead_figures(tmp_path):
    """The layer-2 hook's benchmark (measure between backward and update, as train.run does) runs
    and reports both ratios; their values are times, so only their presence is asserted."""
    figures, _ = _quick_run("layer2_overhead", tmp_path)
    assert set(figures) == {f"layer2_overhead.hidden128-every10.{name}" for name in ("mean_ratio", "median_ratio")}
    assert all(math.isfinite(v) and v > 0 for v in figures.values())


def test_runner_writes_the_cross_layout_figures(tmp_path):
    """The cross-layout benchmark (a TP = 1 trainer computing a TP = 2 engine's shards vs its own layout) runs
    and reports both ratios; times, so only their presence is asserted."""
    figures, _ = _quick_run("cross_layout", tmp_path)
    assert set(figures) == {f"cross_layout.tiny.{name}" for name in ("step_ratio", "forward_ratio")}
    assert all(math.isfinite(v) and v > 0 for v in figures.values())

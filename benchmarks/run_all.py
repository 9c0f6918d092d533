"""``make bench``: every benchmark in one run, each printing ratios measured side by side against the
native path, and (``--json FILE``) all their figures merged into one flat JSON file.

    .venv/bin/python benchmarks/run_all.py [--json runs/bench/figures.json] [--quick]

Runs, each in its own process: ``spec_step.py`` (aligned vs local spec: step time, bytes saved for
backward, peak RSS growth; tiny, hidden 1024 and Qwen3-0.6B widths at 1 and 2 threads),
``moe_layer.py`` (aligned MoE layer vs plain PyTorch and Megatron-Core), ``guards_overhead.py``
(training guards on vs off), ``invariance_cost.py`` (MVA_INVARIANT=1 vs off: engine decode per
batch size 1-64, prefill per prompt length 128-4096, trainer step), ``layer2_overhead.py`` (the
training-time layer-2 hook at ``every: 10`` vs off) and
``cross_layout.py`` (a TP = 1 trainer computing a TP = 2 engine's shards vs its own layout). ``--quick`` runs
fewer steps and models (a smoke run; its numbers are not the ones to quote). Not a test: nothing is asserted; exit
status 1 when a benchmark fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from figures import write_json

HERE = Path(__file__).resolve().parent
# benchmark -> its arguments under --quick (without: each script's defaults)
QUICK_ARGUMENTS = {
    "spec_step": ["--models", "tiny", "--threads", "1", "--steps", "2", "--warmup", "1"],
    "moe_layer": ["--reps", "2", "--tokens", "128"],
    "guards_overhead": ["--steps", "12"],
    "invariance_cost": ["--repeats", "1", "--new-tokens", "8", "--requests", "1,4", "--prefill", "128"],
    "layer2_overhead": ["--blocks", "2"],
    "cross_layout": ["--models", "tiny", "--steps", "2", "--warmup", "1"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer steps and models: a smoke run")
    parser.add_argument("--only", default=",".join(QUICK_ARGUMENTS),
                        help=f"comma-separated subset of {list(QUICK_ARGUMENTS)}")
    args = parser.parse_args()
    merged: dict[str, float] = {}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            out = Path(tmp) / f"{name}.json"
            print(f"== {name}", flush=True)
            quick = QUICK_ARGUMENTS[name] if args.quick else []
            done = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *quick, "--json", str(out)], check=False)
            if done.returncode != 0 or not out.exists():
                failed.append(name)
                continue
            merged.update(json.loads(out.read_text()))
    print("\n== ratios (aligned or guarded / native, same run)")
    for key, value in sorted(merged.items()):
        print(f"  {key:60s} {value:8.3f}")
    write_json(args.json, merged)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

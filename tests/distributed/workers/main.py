"""torchrun entry: ``main.py OUT_DIR SCENARIO...``; every rank writes OUT_DIR/results_rank<r>.json.

Each scenario module has ``run(out_dir) -> dict`` (JSON-serialisable); it gets its own folder.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name in scenarios:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        results[name] = importlib.import_module(f"scenario_{name}").run(folder)
        dist.barrier()
    path = out / f"results_rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
    os.replace(path.with_suffix(".tmp"), path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

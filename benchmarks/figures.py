"""The ``--json`` output every benchmark shares: flat keys ``<benchmark>.<model>.<figure>`` (for
example ``spec_step.hidden1024-t1.step_ratio``) mapped to numbers, written atomically."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_vllm_align.utils.atomic_io import atomic_write_text


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as flat JSON to this file")


def write_figures(path: Path | None, benchmark: str, figures: dict[str, dict[str, float]]) -> None:
    """``figures[model][figure]`` as ``{"<benchmark>.<model>.<figure>": value}`` into ``path`` (None: nothing)."""
    write_json(path, {f"{benchmark}.{model}.{name}": value for model, values in figures.items()
                      for name, value in values.items()})


def write_json(path: Path | None, flat: dict[str, float]) -> None:
    """Flat figures into ``path`` as sorted JSON (None: nothing)."""
    if path is not None:
        atomic_write_text(path, json.dumps(flat, indent=1, sort_keys=True) + "\n", what="benchmark figures",
                          make_dirs=True)

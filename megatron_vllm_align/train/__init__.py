"""Training from recipes: schema and loading (:mod:`.config`), the generated SFT corpus
(:mod:`.data`), one arm's step (:mod:`.trainer`), checkpoints (:mod:`.checkpoint`), the SFT run
(:mod:`.run`) and the layer-3 three-arm comparison (:mod:`.layer3`). Entry point:
``torchrun --nproc-per-node N -m megatron_vllm_align.train --recipe R.yaml [overrides]``.

Names load lazily (PEP 562), so the entry point imports Megatron only once its run starts, with
the library logs already going to the run's log file."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "Recipe": "config", "RecipeError": "config", "apply_overrides": "config", "dump_recipe": "config",
    "load_recipe": "config",
    "ByteTokenizer": "data", "SFTExample": "data", "build_splits": "data",
    "config_diff_markdown": "layer3", "run_layer3": "layer3",
    "GuardError": "run", "run_sft": "run",
    "Trainer": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

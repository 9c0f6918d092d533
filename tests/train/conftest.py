"""A small recipe shared by the training tests (tiny Llama, short sequences, few steps)."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vllm_align.train.config import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture
def small_recipe(tmp_path):
    """Load a shipped recipe with fast settings; returns ``make(name, *overrides)``."""
    def make(name: str = "tiny_llama_sft.yaml", *overrides: str):
        return load_recipe(RECIPES / name, ["data.num_train=32", "data.num_validation=4", "train.global_batch_size=4",
                                            "train.progress_bar=false", f"train.run_dir={tmp_path / 'run'}",
                                            *overrides])
    return make

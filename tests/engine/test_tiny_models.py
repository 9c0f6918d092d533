"""``build_tiny_hf_model`` with ``$MVA_TINY_MODEL_CACHE`` (which this suite sets): the same bytes and the
same random state after it as a build without it, built once per config however many processes ask at
once; the seed is part of the key; an existing directory is still an error."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import pytest
import torch

from megatron_vllm_align.engine.tiny_models import CACHE_ENV_VAR, TinyModelConfig, build_tiny_hf_model

CONFIG = TinyModelConfig(architecture="qwen2", seed=31, hidden_size=128, num_heads=2, num_kv_heads=1,
                         intermediate_size=256, vocab_size=300)


def digests(folder) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def test_the_cache_gives_the_bytes_of_a_fresh_build_and_builds_each_config_once(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    fresh = digests(build_tiny_hf_model(tmp_path / "fresh", CONFIG))
    drawn_after_a_build = torch.rand(4)
    assert {"config.json", "model.safetensors"} <= set(fresh)

    cache = tmp_path / "cache"
    code = ("import sys; from megatron_vllm_align.engine.tiny_models import *; "
            f"build_tiny_hf_model(sys.argv[1], {CONFIG!r})")
    env = {**os.environ, CACHE_ENV_VAR: str(cache)}
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"copy{i}")], env=env) for i in range(3)]
    assert [run.wait(timeout=300) for run in runs] == [0, 0, 0]
    assert [digests(tmp_path / f"copy{i}") for i in range(3)] == [fresh] * 3
    assert len([entry for entry in cache.iterdir() if entry.is_dir()]) == 1   # one build for three processes

    monkeypatch.setenv(CACHE_ENV_VAR, str(cache))
    torch.manual_seed(99)
    build_tiny_hf_model(tmp_path / "hit", CONFIG)   # a cache hit in this process
    assert torch.equal(torch.rand(4), drawn_after_a_build)
    other = digests(build_tiny_hf_model(tmp_path / "other_seed", dataclasses.replace(CONFIG, seed=32)))
    assert other["model.safetensors"] != fresh["model.safetensors"]   # the seed is part of the key
    assert len([entry for entry in cache.iterdir() if entry.is_dir()]) == 2
    with pytest.raises(FileExistsError, match="already exists"):
        build_tiny_hf_model(tmp_path / "copy0", CONFIG)

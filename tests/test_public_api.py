"""The names promised to users import from the package top level, lazily; every import the README and
docs/usage.md show resolves, and their top-level imports are exports."""
import importlib
import re
import subprocess
import sys
from pathlib import Path

import megatron_vllm_align

ROOT = Path(__file__).resolve().parents[1]
_IMPORT = re.compile(r"^from (megatron_vllm_align[\w.]*) import ([\w, ]+?)\s*(?:#.*)?$", re.MULTILINE)


def documented_imports(*texts: str) -> set[tuple[str, str]]:
    """(module, name) of every ``from megatron_vllm_align... import a, b`` line in ``texts``."""
    return {(module, name.strip()) for text in texts for module, names in _IMPORT.findall(text)
            for name in names.split(",") if name.strip()}


def test_every_export_resolves():
    for name in megatron_vllm_align.__all__:
        assert getattr(megatron_vllm_align, name) is not None, name


def test_unknown_name_is_a_clear_error():
    try:
        megatron_vllm_align.not_a_name  # noqa: B018
    except AttributeError as error:
        assert "not_a_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_load_vllm_or_megatron():
    code = "import sys, megatron_vllm_align; print('vllm' in sys.modules, 'megatron.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_documented_imports_resolve_and_top_level_ones_are_exports():
    imports = documented_imports(*((ROOT / f).read_text() for f in ("README.md", "docs/usage.md")))
    assert ("megatron_vllm_align", "build_gpt_from_hf") in imports, "the README's first example is parsed"
    top_level = {name for module, name in imports if module == "megatron_vllm_align"}
    assert top_level - set(megatron_vllm_align.__all__) == set(), "a documented top-level import is not exported"
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"
    # control: a documented name the package does not export is reported
    planted = documented_imports("from megatron_vllm_align import build_gpt_from_hf, not_exported\n")
    assert {name for _, name in planted} - set(megatron_vllm_align.__all__) == {"not_exported"}

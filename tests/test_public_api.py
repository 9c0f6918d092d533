"""The names promised to users import from the package top level, lazily."""
import subprocess
import sys

import megatron_vllm_align


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

"""The vLLM plugin: registered where vLLM looks, inert when off, refusing what it does not cover."""
import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from megatron_vllm_align import invariance
from megatron_vllm_align.invariance import InvarianceUnsupported
from megatron_vllm_align.invariance.plugin import check_vllm_version
from megatron_vllm_align.ops.vllm_context import EngineSpec, VllmContext
from megatron_vllm_align.utils.versions import SUPPORTED_VLLM_VERSIONS

# Run in a fresh interpreter: vLLM loads general plugins once per process, as an engine process does.
# It also reads Linux's AMX tile-data permission (arch_prctl ARCH_GET_XCOMP_PERM, bit 18 XTILEDATA) before vLLM is
# imported and after the plugins loaded.
PROBE = """
import ctypes, json, sys
import torch
def amx_permitted():
    mask = ctypes.c_uint64(0)
    assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0
    return bool(mask.value >> 18 & 1)
amx_before = amx_permitted()
import vllm
if len(sys.argv) > 1:
    vllm.__version__ = sys.argv[1]
from vllm.plugins import load_general_plugins
error = None
try:
    load_general_plugins()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
print(json.dumps({"error": error, "tiled": hasattr(UnquantizedLinearMethod.apply, "_mva_row_tiled"),
                  "query_groups": hasattr(CPUAttentionMetadataBuilder.build, "_mva_query_groups"),
                  "amx": [torch.cpu._is_amx_tile_supported(), amx_before, amx_permitted()]}))
"""


def _probe(env_value: str, *args: str) -> dict:
    import os

    env = {**os.environ, invariance.ENV_VAR: env_value}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_entry_point_is_registered_for_vllm():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("mva_invariant") == "megatron_vllm_align.invariance.plugin:register"
    assert names.get("mva_cpu_seeded_chunked_prefill") == "megatron_vllm_align.engine.seeded_sampling:register"


def test_vllm_loads_the_plugin_and_it_patches_only_when_asked():
    off, on = _probe("0"), _probe("1")
    assert {key: off[key] for key in ("error", "tiled", "query_groups")} == {"error": None, "tiled": False,
                                                                           "query_groups": False}
    assert {key: on[key] for key in ("error", "tiled", "query_groups")} == {"error": None, "tiled": True,
                                                                          "query_groups": True}
    # The probes run vLLM's kernels before vLLM does; where the CPU has AMX they must not be a process's first
    # AMX user without the permission (a TP = 2 worker died with SIGILL on an AMX Xeon). A fresh process starts
    # without it (the control); the plugin asks for it.
    has_amx = on["amx"][0]
    assert off["amx"] == [has_amx, False, False]
    assert on["amx"] == [has_amx, False, has_amx]


def test_an_unsupported_vllm_is_refused_before_anything_is_patched():
    result = _probe("1", "0.31.0")
    assert result["tiled"] is False and result["query_groups"] is False
    assert "InvarianceUnsupported" in result["error"] and "0.31.0" in result["error"]
    assert SUPPORTED_VLLM_VERSIONS[0] in result["error"]


def test_version_check_names_both_versions():
    check_vllm_version(SUPPORTED_VLLM_VERSIONS[0])
    with pytest.raises(InvarianceUnsupported, match=r"0\.32\.0.*0\.99\.1"):
        check_vllm_version("0.99.1")


def test_the_switch_takes_only_zero_or_one(monkeypatch):
    monkeypatch.setenv(invariance.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="MVA_INVARIANT must be '0' or '1'"):
        invariance.requested()
    monkeypatch.delenv(invariance.ENV_VAR)
    assert invariance.requested() is False


def _config_dir(tmp_path, engine_model_dir, name, **fields):
    """A directory with the tiny Llama's config.json, `fields` replaced."""
    with open(f"{engine_model_dir}/config.json") as file:
        base = json.load(file)
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**base, **fields}))
    return str(path)


def test_a_covered_model_resolves(tmp_path, engine_model_dir, invariant):
    VllmContext(EngineSpec(_config_dir(tmp_path, engine_model_dir, "llama")))


@pytest.mark.parametrize("name,fields,quantization,match", [
    ("mistral", {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, None, "MistralForCausalLM"),
    ("qwen2_window", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                      "sliding_window": 64, "max_window_layers": 0}, None, "sliding-window"),
    ("fp8_per_tensor", {}, "fp8", "quantization 'fp8'"),
])
def test_what_is_not_covered_is_refused_by_name(tmp_path, engine_model_dir, invariant, name, fields, quantization,
                                                match):
    """Through vLLM's own config resolution (the platform hook every engine and trainer config passes)."""
    with pytest.raises(InvarianceUnsupported, match=match):
        VllmContext(EngineSpec(_config_dir(tmp_path, engine_model_dir, name, **fields), quantization=quantization))


def test_a_compiled_engine_is_refused_naming_enforce_eager(engine_model_dir, invariant):
    """vLLM's default (compiled) engine config, resolved as ``LLM(model)`` or the server resolve it, is refused;
    the same config with ``enforce_eager=True`` resolves (the control)."""
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(InvarianceUnsupported, match="enforce_eager=True.*--enforce-eager"):
        EngineArgs(model=engine_model_dir, skip_tokenizer_init=True).create_engine_config()
    EngineArgs(model=engine_model_dir, skip_tokenizer_init=True, enforce_eager=True).create_engine_config()

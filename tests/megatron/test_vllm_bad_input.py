"""Bad input to the vLLM-forward model: each a clear error naming what is wrong and where.
No engine is started."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.hf_checkpoint import HFCheckpointError
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

QKV = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoints):
    return tiny_checkpoints["llama"]


def edited_checkpoint(source, target, edit) -> str:
    """A copy of checkpoint `source` at `target` whose tensors are `edit(tensors)`."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    save_file(edit(tensors), target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_unsupported_head_dim_names_kv_channels_and_the_backend(megatron_cpu, tmp_path):
    checkpoint = build_tiny_hf_model(tmp_path / "head48", TinyModelConfig(hidden_size=192, head_dim=48, seed=4))
    with pytest.raises(ValueError, match=r"config.kv_channels \(head_dim\) = 48 is not served by vLLM's CPU_ATTN "
                                         r"backend \(supported: \[.*64.*\]\)"):
        build_gpt_from_hf(checkpoint, align=True)


def test_params_dtype_other_than_the_engines_is_refused(megatron_cpu, llama_dir):
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(ValueError, match=rf"TransformerConfig.params_dtype = {dtype}; "
                                             r"the vLLM-forward layer needs torch.bfloat16"):
            build_gpt_from_hf(llama_dir, align=True, params_dtype=dtype)


@pytest.mark.parametrize("field, overrides, reason", [
    ("pipeline_model_parallel_size", {"pipeline_dtype": torch.bfloat16},
     r"a pipeline stage boundary would carry the \[branch \| residual\] stream of 2h"),
    ("context_parallel_size", {}, r"vLLM's attention reads each sequence whole"),
])
def test_pipeline_and_context_parallel_are_refused_with_the_reason(megatron_cpu, llama_dir, field, overrides, reason):
    with pytest.raises(ValueError, match=rf"TransformerConfig.{field} = 2; the vLLM-forward layer needs 1 \({reason}"):
        build_gpt_from_hf(llama_dir, align=True, **{field: 2}, **overrides)


def test_unsupported_engine_dtype_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"EngineSpec.dtype must be one of \('bfloat16', 'float16', 'float32'\), "
                                         r"got 'float64'"):
        EngineSpec(str(llama_dir), dtype="float64")


def test_unknown_quantization_is_refused_by_vllms_config(llama_dir):
    with pytest.raises(Exception, match=r"Unknown quantization method: int3"):
        vllm_context(EngineSpec(str(llama_dir), quantization="int3"))


def test_quantization_on_the_local_spec_is_refused(megatron_cpu, llama_dir):
    with pytest.raises(ValueError, match=r"quantization='fp8_per_channel' needs align=True"):
        build_gpt_from_hf(llama_dir, quantization="fp8_per_channel")


def test_engine_context_with_other_quantization_is_refused(megatron_cpu, llama_dir):
    context = vllm_context(EngineSpec(str(llama_dir), quantization="fp8_per_channel"))
    with pytest.raises(ValueError, match=r"quantization=None but engine_context serves "
                                         r"quantization='fp8_per_channel'"):
        build_gpt_from_hf(llama_dir, align=True, engine_context=context)
    with pytest.raises(ValueError, match=r"engine_tensor_parallel_size=2 but engine_context serves "
                                         r"tensor_parallel_size=None"):
        build_gpt_from_hf(llama_dir, align=True, engine_context=vllm_context(EngineSpec(str(llama_dir))),
                          engine_tensor_parallel_size=2)


@pytest.mark.parametrize("align", [True, False])
def test_tensor_with_a_wrong_shape_names_the_tensor_and_both_shapes(megatron_cpu, llama_dir, tmp_path, align):
    def truncate(tensors):
        tensors[QKV] = tensors[QKV][:64].clone()
        return tensors

    checkpoint = edited_checkpoint(llama_dir, tmp_path / "wrong_shape", truncate)
    with pytest.raises(HFCheckpointError, match=rf"tensor '{QKV}' has shape \(64, 256\), but config.json implies "
                                                r"\(128, 256\): the checkpoint does not fit its config"):
        build_gpt_from_hf(checkpoint, align=align)


def test_missing_tensor_names_the_tensor_and_its_shape(megatron_cpu, llama_dir, tmp_path):
    name = "model.layers.0.post_attention_layernorm.weight"
    checkpoint = edited_checkpoint(llama_dir, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(HFCheckpointError, match=rf"checkpoint lacks tensor '{name}' \(expected shape \(256,\)\)"):
        build_gpt_from_hf(checkpoint, align=True)


def test_config_that_does_not_fit_the_tensors_is_refused(megatron_cpu, llama_dir, tmp_path):
    import json

    checkpoint = tmp_path / "wrong_config"
    shutil.copytree(llama_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["intermediate_size"] = 384
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
                                                r"\(512, 256\), but config.json implies \(384, 256\)"):
        build_gpt_from_hf(checkpoint, align=True)

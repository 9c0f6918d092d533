"""What the engine actually runs on this CPU, measured from the live engine and pinned here.

docs/engine_facts.md explains these facts; if vLLM's CPU path changes, these tests say which.
The numerics tests replay captured engine tensors through candidate formulas and require
bitwise equality, so they tell the spec authors exactly which arithmetic to reproduce.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megatron_vllm_align.engine.engine_facts import (
    capture_module_io,
    measure_engine_facts,
)
from megatron_vllm_align.megatron.hf_checkpoint import read_hf_tensors
from megatron_vllm_align.ops.cpu_cast import cast_like_cpu_kernel, cpu_bf16_cast_truncates

pytestmark = pytest.mark.engine

KNOWN_GEMMS = {
    "sgl weight_packed_linear (torch.ops._C.weight_packed_linear)",
    "oneDNN onednn_mm (torch.ops._C.onednn_mm)",
    "torch.nn.functional.linear",
}


@pytest.fixture(scope="module")
def facts(engine, engine_sequences):
    measured = measure_engine_facts(engine, engine_sequences[2:5])
    print(json.dumps(dataclasses.asdict(measured), indent=1))
    return measured


def test_engine_runs_eager_without_compiled_or_graph_paths(facts):
    assert facts.compilation_mode == "0"  # CompilationMode.NONE
    assert facts.cudagraph_mode == "NONE"
    assert facts.custom_ops_setting == ["all"]
    # vLLM records an op as enabled in the compilation config current when the op object is built.
    # get_rope caches rotary objects per process, so after another vLLM context in the same process
    # built the same rope the engine reuses it and records nothing: rotary is checked through the
    # forward method its modules dispatch to (below), which does not depend on that cache.
    assert {"rms_norm", "silu_and_mul"} <= set(facts.enabled_custom_ops)
    assert set(facts.enabled_custom_ops) <= {"rms_norm", "silu_and_mul", "rotary_embedding", "apply_rotary_emb"}
    assert facts.forward_method_by_op == {
        "RMSNorm": "forward_cpu",
        "SiluAndMul": "forward_cpu",
        "RotaryEmbedding": "forward_cpu",
        "ApplyRotaryEmb": "forward_cpu",
    }


def test_engine_norms_are_the_native_ir_implementation(facts):
    assert facts.ir_op_priority["rms_norm"] == ["native"]
    assert facts.ir_op_priority["fused_add_rms_norm"] == ["native"]
    assert "_C::rms_norm" not in facts.custom_kernels_run
    assert "_C::fused_add_rms_norm" not in facts.custom_kernels_run
    assert facts.aten_ops_run.get("aten::rsqrt", 0) == 5  # 2 layers x 2 norms + final norm


def test_engine_kernels_for_activation_rotary_attention_and_gemm(facts):
    assert "_C::silu_and_mul" not in facts.custom_kernels_run and "aten::silu" in facts.aten_ops_run
    assert facts.custom_kernels_run["_C::rotary_embedding"] == 2
    assert facts.custom_kernels_run["_C::cpu_attention_with_kv_cache"] == 2
    assert facts.attention_backends == ["CPU_ATTN"]
    assert facts.kv_block_size == 128
    assert facts.rope_cache_dtypes == ["torch.bfloat16"]
    assert set(facts.gemm_by_layer.values()) <= KNOWN_GEMMS
    if torch.cpu._is_amx_tile_supported():  # the small-weight sgl path needs AMX
        assert set(facts.gemm_by_layer.values()) == {"sgl weight_packed_linear (torch.ops._C.weight_packed_linear)"}


def test_logits_reach_compute_logprobs_in_bf16(facts):
    assert facts.logits_dtypes_at_compute_logprobs == ["torch.bfloat16"]


def test_engine_disables_torch_set_num_threads_in_process(facts):
    assert facts.set_num_threads_disabled


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise in fp32, round to bf16, then multiply by the bf16 weight in bf16."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(weight.dtype) * weight


def fp32_weight_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The other candidate: multiply by the weight in fp32, round once at the end."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.fixture(scope="module")
def captured(engine, engine_sequences):
    names = [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp.act_fn",
        "model.layers.0.self_attn.rotary_emb",
    ]
    return capture_module_io(engine, names, engine_sequences[2:5])


def test_first_norm_is_native_rms_norm_bitwise(captured, engine_checkpoint):
    weight = read_hf_tensors(engine_checkpoint)["model.layers.0.input_layernorm.weight"]
    (call,) = captured["model.layers.0.input_layernorm"]
    (x,) = call.args
    assert torch.equal(call.output, native_rms_norm(x, weight))
    assert not torch.equal(call.output, fp32_weight_rms_norm(x, weight))


def test_fused_add_norm_normalises_the_unrounded_fp32_sum(captured, engine_checkpoint):
    weight = read_hf_tensors(engine_checkpoint)["model.layers.0.post_attention_layernorm.weight"]
    (call,) = captured["model.layers.0.post_attention_layernorm"]
    x, residual = call.args
    normed, new_residual = call.output
    fp32_sum = x.float() + residual.float()
    assert torch.equal(new_residual, fp32_sum.to(torch.bfloat16))
    assert torch.equal(normed, native_rms_norm(fp32_sum, weight).to(torch.bfloat16))
    assert not torch.equal(normed, native_rms_norm(fp32_sum.to(torch.bfloat16), weight))


def test_silu_and_mul_is_bf16_torch_ops(captured):
    (call,) = captured["model.layers.0.mlp.act_fn"]
    (x,) = call.args
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(call.output, F.silu(gate) * up)
    assert not torch.equal(call.output, (F.silu(gate.float()) * up.float()).to(x.dtype))


def test_rotary_is_fp32_math_on_a_bf16_cos_sin_cache(captured):
    call = captured["model.layers.0.self_attn.rotary_emb"][0]  # one module shared by all layers
    positions, query, key = call.args
    rotated_query, rotated_key = call.output
    head_dim, theta = 64, 10000.0
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, head_dim).float()
        first, second = heads.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        return cast_like_cpu_kernel(out, x.dtype).view_as(x)

    bf16_cos, bf16_sin = angles.cos().bfloat16().float(), angles.sin().bfloat16().float()
    assert torch.equal(rotated_query, rotate(query, bf16_cos, bf16_sin))
    assert torch.equal(rotated_key, rotate(key, bf16_cos, bf16_sin))
    assert not torch.equal(rotated_query, rotate(query, angles.cos(), angles.sin()))
    if cpu_bf16_cast_truncates():  # AVX2 builds: the fp32 -> bf16 output cast truncates, never rounds
        rounded = rotate(query.float(), bf16_cos, bf16_sin).to(query.dtype)  # round to nearest even
        assert not torch.equal(rotated_query, rounded)

"""A stale deployed value is caught on every GEMM path vLLM's CPU dispatch can pick.

vLLM's ``dispatch_cpu_unquantized_gemm`` packs an unquantized linear's weight for oneDNN
(``create_onednn_mm``) or sgl-kernel (``weight_packed_linear``) and then empties ``layer.weight``, or
keeps it for ``torch.nn.functional.linear``. Which one it picks depends on the CPU (sgl needs AMX,
oneDNN a bf16 matmul the CPU can run), so each path is forced here through vLLM's own switches
(``check_cpu_sgl_kernel``, ``_custom_ops._supports_onednn``): the kernels that run are vLLM's real
ones. On each path a correct module passes the probe for several seeds, and an optimizer step
without a refresh is caught."""
from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from megatron_vllm_align.engine.engine_facts import gemm_kernel_name
from megatron_vllm_align.megatron.cpu_report import cpu_isa
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
from megatron_vllm_align.ops.moe_router.module import VllmMoERouter
from megatron_vllm_align.ops.refresh import deployed_values_match_master
from megatron_vllm_align.ops.routed_experts.module import VllmRoutedExperts
from megatron_vllm_align.ops.shared_expert.module import VllmSharedExpert

GEMM_PATHS = {
    "oneDNN": "oneDNN onednn_mm (torch.ops._C.onednn_mm)",
    "sgl": "sgl weight_packed_linear (torch.ops._C.weight_packed_linear)",
    "torch": "torch.nn.functional.linear",
}
SEEDS = (0, 1, 2)


SGL_KERNEL_RUNS = """
import torch
from vllm import _custom_ops as ops
packed = torch.ops._C.convert_weight_packed(torch.ones(128, 256, dtype=torch.bfloat16))
for rows in (1, 4, 16, 64):  # small M runs a vector loop, larger M the brgemm
    ops.weight_packed_linear_cpu(torch.ones(rows, 256, dtype=torch.bfloat16), packed, 128, None)
"""


@functools.cache
def sgl_kernel_runs() -> bool:
    """Whether sgl-kernel's ``weight_packed_linear`` runs on this CPU: its bf16 brgemm aborts the process
    where oneDNN has no bf16 matrix ISA (AVX2, or ``ONEDNN_MAX_CPU_ISA=AVX2``), so ask a child process."""
    return subprocess.run([sys.executable, "-c", SGL_KERNEL_RUNS], capture_output=True, timeout=300).returncode == 0


@pytest.fixture
def forced_gemm_path(request, monkeypatch):
    """Make vLLM's CPU dispatch pick ``request.param`` for the layers built in the test."""
    import vllm._custom_ops as vllm_ops
    import vllm.model_executor.layers.utils as vllm_layer_utils

    path = request.param
    if path == "sgl" and not sgl_kernel_runs():
        pytest.skip(f"sgl-kernel's weight_packed_linear cannot run on this CPU ({cpu_isa().describe()}); vLLM picks "
                    "it only with AMX")
    monkeypatch.setattr(vllm_layer_utils, "check_cpu_sgl_kernel", lambda n, k, dtype: path == "sgl")
    monkeypatch.setattr(vllm_ops, "_supports_onednn", path == "oneDNN" and vllm_ops._supports_onednn)
    return path


def _step_without_refresh(module: torch.nn.Module, x: torch.Tensor) -> None:
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    output = module(x)
    (output[0] if isinstance(output, tuple) else output).float().square().sum().backward()
    optimizer.step()


@pytest.mark.parametrize("forced_gemm_path", list(GEMM_PATHS), indirect=True)
def test_a_stale_linear_is_caught_on_every_gemm_path(bf16_context, forced_gemm_path):
    layers = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        layer = VllmDenseLinear(256, 128, bias=True, vllm_context=bf16_context, prefix="probe.linear")
        chosen = gemm_kernel_name(layer.kernel.layer.cpu_linear)
        if forced_gemm_path == "oneDNN" and chosen != GEMM_PATHS["oneDNN"]:
            pytest.skip(f"oneDNN cannot create a bf16 matmul on this CPU ({cpu_isa().describe()}); vLLM falls "
                        f"back to {chosen}")
        assert chosen == GEMM_PATHS[forced_gemm_path]
        assert layer.deployed_matches_master(), f"seed {seed}: a freshly refreshed layer fails the probe"
        layers.append(layer)
    # The control: on the packed paths the shadow's weight is gone, so comparing weights would read nothing.
    assert (layers[0].kernel.layer.weight.numel() == 0) == (forced_gemm_path != "torch")
    for layer in layers:
        _step_without_refresh(layer, torch.randn(8, 256).to(torch.bfloat16))
        assert not layer.deployed_matches_master(), f"{forced_gemm_path}: a stale deployed value passed the probe"
        layer.refresh_deployed()
        assert layer.deployed_matches_master()


def test_stale_moe_deployed_values_are_caught(tiny_moe_context):
    """The router's gate GEMM, the routed experts and the shared expert: each caught when stale."""
    context = tiny_moe_context("probe_qwen3_moe")
    hidden, experts, top_k, ffn = 256, 8, 2, 128
    torch.manual_seed(0)
    modules = torch.nn.ModuleDict({
        "router": VllmMoERouter(hidden, experts, top_k, vllm_context=context),
        "experts": VllmRoutedExperts(experts, hidden, ffn, top_k, vllm_context=context),
        "shared": VllmSharedExpert(hidden, ffn, vllm_context=context),
    })
    assert deployed_values_match_master(modules) == {"router": True, "experts": True, "shared": True}
    x = torch.randn(8, hidden).to(torch.bfloat16)
    with torch.no_grad():
        weights, ids, _ = modules["router"](x.clone())
    _step_without_refresh(modules["router"], x.clone())
    _step_without_refresh(modules["shared"], x.clone())
    optimizer = torch.optim.AdamW(modules["experts"].parameters(), lr=1e-2)
    modules["experts"](x.clone(), weights, ids).float().square().sum().backward()
    optimizer.step()
    assert deployed_values_match_master(modules) == {"router": False, "experts": False, "shared": False}
    for module in modules.values():
        module.refresh_deployed()
    assert all(deployed_values_match_master(modules).values())

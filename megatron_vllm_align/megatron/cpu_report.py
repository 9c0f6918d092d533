"""Where a run happened: the CPU's instruction set, the GEMM kernel vLLM's CPU dispatch picks for
each linear layer of a model and the row rule the invariance layer measures for it.

Numerics facts (which GEMM is row-invariant, how a kernel casts) hold per ISA, so logs, benchmarks
and reports name it. ``python -m megatron_vllm_align.megatron.cpu_report`` prints all three for the tiny
test Llama (aligned spec, no engine started); ``.ci/run`` runs it before the tests.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class CpuIsa:
    """``capability``: torch's CPU capability (``DEFAULT``, ``AVX2``, ``AVX512``, ...);
    ``avx512_bf16`` / ``amx_bf16``: the CPU's bf16 matrix units (``/proc/cpuinfo`` flags);
    ``onednn_max_isa``: the ``ONEDNN_MAX_CPU_ISA`` cap on oneDNN's kernels, if set."""

    model_name: str
    capability: str
    avx512_bf16: bool
    amx_bf16: bool
    onednn_max_isa: str | None = None

    @property
    def has_bf16_matrix_units(self) -> bool:
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        units = [name for name, present in (("avx512_bf16", self.avx512_bf16), ("amx_bf16", self.amx_bf16))
                 if present]
        cap = f", oneDNN capped at {self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.model_name}, torch CPU capability {self.capability}, bf16 matrix units: " \
               f"{', '.join(units) or 'none'}{cap}"


def cpu_isa() -> CpuIsa:
    """This machine's :class:`CpuIsa` (flags empty where ``/proc/cpuinfo`` is unreadable)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    return CpuIsa(model_name=fields.get("model name\t", "unknown CPU").strip(),
                  capability=torch.backends.cpu.get_cpu_capability(),
                  avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags,
                  onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or None)


def fp8_gemm_on_onednn() -> bool:
    """Whether ``torch._scaled_mm`` (vLLM's FP8 GEMM on CPUs without AMX-FP8) runs on oneDNN here: torch sends a
    GEMM of two FP8 operands of one dtype to oneDNN where oneDNN is enabled and the CPU has AMX-INT8, and
    computes it in fp32 otherwise; how much slower oneDNN's path is: docs/fp8_facts.md."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and "amx_int8" in flags.split()


def machine_facts() -> dict[str, object]:
    """Where a run happened, for its report: ``cpu`` (:meth:`CpuIsa.describe`) and the invariance layer's
    ``row_rules`` / ``expert_rules`` / ``attention_groups`` (query tokens per attention request) measured in
    this process so far (empty where invariance never ran)."""
    from megatron_vllm_align.invariance import attention, expert_rows, row_tiles

    return {"cpu": cpu_isa().describe(), "row_rules": row_tiles.measured_rules(),
            "expert_rules": expert_rows.measured_rules(), "attention_groups": attention.measured_groups()}


def gemm_paths(model: nn.Module) -> dict[str, str]:
    """``{module name: GEMM kernel}`` for every vLLM-forward linear and output layer of an aligned
    model, as vLLM's weight processing bound it (``engine_facts.gemm_kernel_name``)."""
    from megatron_vllm_align.engine.engine_facts import gemm_kernel_name

    paths = {}
    for name, module in model.named_modules():
        kernel = getattr(module, "kernel", None)
        layer = getattr(kernel, "layer", None) or getattr(kernel, "lm_head", None)
        if layer is not None and hasattr(layer, "cpu_linear"):
            paths[name] = gemm_kernel_name(layer.cpu_linear)
    return paths


def row_rules(model: nn.Module, tokens: int = 8) -> dict[str, str]:
    """The row rules the invariance layer's probes pick for an aligned model's linears in this process
    (``invariance.row_tiles.measured_rules``), after one forward of ``tokens`` tokens with it on."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.invariance.row_tiles import measured_rules
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    with invariance.switched(True), torch.no_grad():
        token_logprobs(model, [list(range(1, tokens + 1))])
    return measured_rules()


def main() -> int:
    """Print the ISA, the GEMM path of each linear of the tiny test Llama (bf16, aligned spec) and the
    invariance layer's row rule for each of its linear shapes and query group for its attention."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    print(f"cpu: {cpu_isa().describe()}")
    init_single_process_cpu(seed=0)
    with tempfile.TemporaryDirectory() as root:
        model = build_gpt_from_hf(build_tiny_hf_model(Path(root) / "llama", TinyModelConfig()), align=True)
    for name, kernel in gemm_paths(model).items():
        print(f"vLLM GEMM path  {name:45s} {kernel}")
    for shape, rule in row_rules(model).items():
        print(f"MVA_INVARIANT=1 row rule  {shape:60s} {rule}")
    from megatron_vllm_align.invariance.attention import measured_groups

    for shape, group in measured_groups().items():
        print(f"MVA_INVARIANT=1 attention query group  {shape:47s} {group} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

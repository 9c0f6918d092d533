"""The CPU report names this machine's ISA and the GEMM kernel vLLM bound to every linear layer."""
from __future__ import annotations

import torch

from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_report import cpu_isa, gemm_paths

KNOWN_KERNELS = {"oneDNN onednn_mm (torch.ops._C.onednn_mm)", "torch.nn.functional.linear",
                 "sgl weight_packed_linear (torch.ops._C.weight_packed_linear)", "zentorch_linear_unary"}


def test_cpu_isa_matches_torch():
    isa = cpu_isa()
    assert isa.capability == torch.backends.cpu.get_cpu_capability()
    assert isa.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert str(isa.capability) in isa.describe()


def test_every_linear_of_the_aligned_model_has_a_known_gemm_path(megatron_cpu, llama_dir):
    paths = gemm_paths(build_gpt_from_hf(llama_dir, align=True))
    assert len(paths) == 2 * 4 + 1 and "output_layer" in paths  # qkv, proj, fc1, fc2 per layer; lm_head
    assert set(paths.values()) <= KNOWN_KERNELS, paths
    assert not gemm_paths(build_gpt_from_hf(llama_dir))  # the local spec has no vLLM layers


def test_the_report_names_a_row_rule_for_every_linear_shape(megatron_cpu, llama_dir):
    from megatron_vllm_align.invariance.row_tiles import RowRule
    from megatron_vllm_align.megatron.cpu_report import row_rules

    model = build_gpt_from_hf(llama_dir, align=True)
    rules = row_rules(model)
    shapes = {(module.kernel.in_features, module.kernel.out_features) for module in model.modules()
              if hasattr(getattr(module, "kernel", None), "in_features")}
    for k, n in shapes:
        assert any(f" {k} -> {n} " in key for key in rules), (k, n, rules)
    assert set(rules.values()) <= {rule.value for rule in RowRule}
    from megatron_vllm_align.invariance.attention import GROUP_CANDIDATES, measured_groups

    groups = measured_groups()     # the forward's attention probed its query group too
    assert groups and set(groups.values()) <= {1, *GROUP_CANDIDATES}, groups

"""Child process of tests/invariance/test_row_rules_per_isa.py: on this process's oneDNN ISA (the parent sets
``ONEDNN_MAX_CPU_ISA``), for each linear shape of Qwen3-0.6B and its MoE experts: the rule the probe picked,
whether the plain kernel (``MVA_INVARIANT=0``) gives probed rows other bits than the batch, and whether rows
keep their bits under the rule at row counts the probe never used. Prints one JSON line."""
import json
import os
import sys
import tempfile

import torch

from megatron_vllm_align import invariance
from megatron_vllm_align.invariance import expert_rows, row_tiles
from megatron_vllm_align.megatron.cpu_report import cpu_isa
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel
from megatron_vllm_align.ops.routed_experts.kernel import VllmRoutedExpertsKernel
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
from megatron_vllm_align.validation.layer1_suite import TINY_LLAMA_CONFIG, TINY_QWEN3_MOE_CONFIG, write_model_config

LINEAR_SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]
UNPROBED = ((1, 100), (1, 150), (6, 11), (23, 40), (40, 0), (100, 13), (200, 7))


def facts(call, batch_rows, outputs_per_row, rules):
    """(rule, plain differs, holds under the rule) of ``call(start, stop)`` on rows of a batch of at least the
    probe's rows; ``rules()`` the measured rules."""
    os.environ[invariance.ENV_VAR] = "1"
    reference = call(0, batch_rows)
    rule = rules()
    holds = all(torch.equal(call(start, start + count), reference[start:start + count]) for count, start in UNPROBED)
    os.environ[invariance.ENV_VAR] = "0"
    plain_differs = row_tiles.first_difference(call, row_tiles.probe_plan(outputs_per_row)) is not None
    return {"rule": rule, "plain_differs": plain_differs, "holds": holds}


def main() -> None:
    tmp = tempfile.mkdtemp()
    invariance.enable()
    context = vllm_context(EngineSpec(write_model_config(f"{tmp}/llama", TINY_LLAMA_CONFIG)))
    gen = torch.Generator().manual_seed(0)
    result = {"isa": cpu_isa().describe(), "kernels": {}}
    for k, n in LINEAR_SHAPES:
        kernel = VllmLinearKernel(context, k, n, False, quantized=False)
        kernel.load(torch.randn(n, k, generator=gen) * k ** -0.5, None)
        rows = max(256, row_tiles.probe_plan(n)[0])
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        result["kernels"][f"linear {k} -> {n}"] = facts(
            lambda start, stop: kernel(x[start:stop]), rows, n,
            lambda: row_tiles.measured_rules()[f"UnquantizedLinearMethod {k} -> {n} bfloat16 "
                                               f"{torch.get_num_threads()} threads"])
    hidden, ffn, experts, top_k = 1024, 768, 8, 2
    moe = vllm_context(EngineSpec(write_model_config(f"{tmp}/moe", {
        **TINY_QWEN3_MOE_CONFIG, "hidden_size": hidden, "moe_intermediate_size": ffn, "num_experts": experts,
        "num_experts_per_tok": top_k})))
    kernel = VllmRoutedExpertsKernel(moe, hidden, ffn, experts, top_k)
    kernel.load((torch.randn(experts, 2 * ffn, hidden, generator=gen) * hidden ** -0.5).to(torch.bfloat16),
                (torch.randn(experts, hidden, ffn, generator=gen) * ffn ** -0.5).to(torch.bfloat16))
    rows = max(256, row_tiles.probe_plan(hidden)[0])
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(rows, experts, generator=gen).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.randn(rows, top_k, generator=gen), -1)
    result["kernels"][f"experts {experts} x {hidden} -> {ffn}"] = facts(
        lambda start, stop: kernel(x[start:stop], weights[start:stop], ids[start:stop]), rows, hidden,
        lambda: next(iter(expert_rows.measured_rules().values())))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

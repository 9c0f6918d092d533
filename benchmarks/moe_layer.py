"""Step time and peak memory of the aligned MoE layer against plain PyTorch and Megatron-Core.

One training step = forward of router + routed experts on x [tokens, hidden], then backward of a
fixed random dY (gradients for x, the router weight and every expert weight). Three arms:

* aligned: ``VllmMoERouter`` + ``VllmRoutedExperts`` (vLLM's CPU kernels forward, glue backward);
* plain: a per-expert PyTorch MoE in bf16 autograd (gate GEMM, fp32 softmax top-k, per-expert
  ``F.linear`` / SiLU-and-mul / ``F.linear``, weighted ``index_add``);
* megatron: Megatron-Core's ``MoELayer`` from its local spec (``SequentialMLP``, allgather
  dispatcher). It does not run on CPU as shipped (0.16.1): ``TopKRouter.gating`` moves its weight
  to ``torch.cuda.current_device()``, ``router_gating_linear`` reads ``te_general_gemm``, a name
  only defined when Transformer Engine imports (NameError otherwise), and the alltoall dispatcher
  creates a ``torch.cuda.Stream``. This script runs it with those two names replaced for its
  own process (``torch.cuda.current_device`` -> "cpu", ``te_general_gemm`` -> None) and says so.

Peak memory: the largest running total of bytes allocated minus freed during one step, from the
PyTorch profiler's memory events (excludes the parameters and inputs allocated before the step).
Times are medians over ``--reps`` steps after one warm-up; the aligned layer's
``refresh_deployed`` (needed after every optimizer step) is timed on its own. Run:
``.venv/bin/python benchmarks/moe_layer.py [--tokens 512 --hidden 512 --ffn 256 --experts 16 --top-k 2]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from figures import add_json_option, write_figures
from torch import nn


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int


def qwen3_moe_config(shape: Shape) -> dict:
    """A Qwen3-MoE ``config.json`` with the benchmark's MoE sizes (only the vLLM config is built)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": shape.hidden,
            "intermediate_size": 4 * shape.hidden, "moe_intermediate_size": shape.ffn, "num_experts": shape.experts,
            "num_experts_per_tok": shape.top_k, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 1, "vocab_size": 512,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False}


class AlignedMoE(nn.Module):
    """Router + routed experts of megatron_vllm_align, chained."""

    def __init__(self, shape: Shape, context) -> None:
        from megatron_vllm_align.ops.moe_router.module import VllmMoERouter
        from megatron_vllm_align.ops.routed_experts.module import VllmRoutedExperts

        super().__init__()
        self.router = VllmMoERouter(shape.hidden, shape.experts, shape.top_k, vllm_context=context)
        self.experts = VllmRoutedExperts(shape.experts, shape.hidden, shape.ffn, shape.top_k, vllm_context=context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, _ = self.router(x)
        return self.experts(x, weights, ids)


class PlainMoE(nn.Module):
    """Per-expert MoE in plain bf16 PyTorch autograd (one ``nn.Linear`` pair per expert, renormalised
    softmax top-k routing)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.router = nn.Linear(shape.hidden, shape.experts, bias=False, dtype=torch.bfloat16)
        self.fc1 = nn.ModuleList(nn.Linear(shape.hidden, 2 * shape.ffn, bias=False, dtype=torch.bfloat16)
                                 for _ in range(shape.experts))
        self.fc2 = nn.ModuleList(nn.Linear(shape.ffn, shape.hidden, bias=False, dtype=torch.bfloat16)
                                 for _ in range(shape.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, ids = self.router(x).float().topk(self.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for expert, (fc1, fc2) in enumerate(zip(self.fc1, self.fc2)):
            token, slot = (ids == expert).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = fc1(x[token]).chunk(2, dim=-1)
            y = fc2(F.silu(gate) * up)
            out = out.index_add(0, token, y.float() * weights[token, slot, None])
        return out.to(x.dtype)


class MegatronMoE(nn.Module):
    """Megatron-Core's MoELayer (local spec), input [tokens, 1, hidden]."""

    def __init__(self, shape: Shape) -> None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        config = TransformerConfig(
            num_layers=1, hidden_size=shape.hidden, num_attention_heads=4, ffn_hidden_size=4 * shape.hidden,
            moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts, moe_router_topk=shape.top_k,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
            params_dtype=torch.bfloat16, use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32")
        spec = get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False)
        self.layer = build_module(spec.submodules.mlp, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.unsqueeze(1))[0].squeeze(1)


def allow_megatron_moe_on_cpu() -> list[str]:
    """Replace, for this process, the two names that stop Megatron's MoELayer on CPU; returns what."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu()
    torch.cuda.current_device = lambda: "cpu"
    moe_utils.te_general_gemm = None
    return ["torch.cuda.current_device -> 'cpu'", "moe_utils.te_general_gemm -> None"]


def peak_step_bytes(step: Callable[[], None]) -> int:
    """Largest running total of allocated minus freed bytes while ``step`` runs (profiler events)."""
    activity = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity], profile_memory=True) as prof:
        step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    running = peak = 0
    for event in events:
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak


def measure(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, reps: int) -> tuple[float, int]:
    """(median step seconds, peak step bytes) for forward + backward of ``dy``."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        module(inp).backward(dy)

    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak_step_bytes(step)


def refresh_seconds(module: nn.Module, reps: int) -> float:
    """Median seconds of ``refresh_deployed_weights(module)`` (vLLM rebuilds and prepacks)."""
    from megatron_vllm_align.ops.refresh import refresh_deployed_weights

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        refresh_deployed_weights(module)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    add_json_option(parser)
    args = parser.parse_args()
    shape = Shape(args.tokens, args.hidden, args.ffn, args.experts, args.top_k)

    from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

    torch.manual_seed(0)
    x = torch.randn(shape.tokens, shape.hidden).bfloat16()
    dy = torch.randn(shape.tokens, shape.hidden).bfloat16()
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(qwen3_moe_config(shape), handle)
        context = vllm_context(EngineSpec(model_dir))
        aligned = AlignedMoE(shape, context)
        results = {"aligned": measure(aligned, x, dy, args.reps)}
        refresh = refresh_seconds(aligned, args.reps)
    results["plain"] = measure(PlainMoE(shape), x, dy, args.reps)
    try:
        shims = allow_megatron_moe_on_cpu()
        results["megatron"] = measure(MegatronMoE(shape), x, dy, args.reps)
        print(f"megatron MoELayer ran with CPU shims: {', '.join(shims)}")
    except (RuntimeError, AssertionError, NameError, ImportError) as exc:  # report why; the other arms stand
        print(f"megatron MoELayer did not run on CPU: {type(exc).__name__}: {exc}")

    print(f"shape {shape}, torch threads {torch.get_num_threads()}, median of {args.reps} steps")
    base_time, base_mem = results["plain"]
    print(f"{'arm':10s} {'step ms':>9s} {'peak MiB':>9s} {'time/plain':>11s} {'mem/plain':>10s}")
    for arm, (seconds, peak) in results.items():
        print(f"{arm:10s} {1e3 * seconds:9.1f} {peak / 2**20:9.1f} {seconds / base_time:11.2f} {peak / base_mem:10.2f}")
    print(f"aligned refresh_deployed (rebuild of vLLM's layers after an optimizer step, not in the "
          f"step above): {1e3 * refresh:.1f} ms")
    figures = {"aligned_vs_plain": {"step_ratio": results["aligned"][0] / base_time,
                                    "peak_memory_ratio": results["aligned"][1] / base_mem}}
    if "megatron" in results:
        aligned, megatron = results["aligned"], results["megatron"]
        print(f"aligned / megatron: time {aligned[0] / megatron[0]:.2f}, memory {aligned[1] / megatron[1]:.2f}")
        figures["aligned_vs_megatron"] = {"step_ratio": aligned[0] / megatron[0],
                                          "peak_memory_ratio": aligned[1] / megatron[1]}
    write_figures(args.json, "moe_layer", figures)


if __name__ == "__main__":
    main()

"""Step time and memory of the vLLM-forward spec against Megatron's local spec, on CPU.

    .venv/bin/python benchmarks/spec_step.py [--steps 7] [--warmup 2] [--threads 1,2] [--json FILE]
        [--backward-precision library|fp32]

For each model (the tiny test model, hidden 256; a wider one, hidden 1024; Qwen3-0.6B widths with
2 layers), each thread count (``OMP_NUM_THREADS`` of the child) and each spec, one fresh subprocess
builds the model from the same random checkpoint and runs forward + backward (mean negative prompt
logprob of a fixed batch) repeatedly; it reports the median step time after warm-up, the growth of
the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) from just
before the first step to the end, and the bytes the forward saves for backward
(``validation.saved_activations``: deterministic). Why max RSS in separate processes, not
tracemalloc: tracemalloc sees only Python's allocator, while the tensors (torch's CPU allocator,
oneDNN, vLLM's packed weights) come from malloc; and ru_maxrss never decreases, so each measurement
needs its own process. Prints the ISA it ran on first (:func:`isa_description`: torch's CPU
capability and the ``avx512_bf16`` / ``amx_bf16`` flags, which decide whether a bf16 GEMM is fast
or ~50x slower than fp32), then the ratios vLLM-spec / local-spec (``--json``: keys
``spec_step.<model>-t<threads>.step_ratio``, ``.saved_bytes_ratio``, ``.peak_rss_growth_ratio``).
``--interleaved``: instead, per model and thread count, one subprocess builds both specs from the
same checkpoint and alternates their steps, printing each spec's minimum and median step time and
the ratio of the minima: on a machine shared with other work a load burst can only raise a minimum,
and both specs see the same bursts (peak RSS is not measured in this mode).
Throughput: each line also gives the step's achieved FLOP/s, ``step_flops / step time``, where
:func:`step_flops` counts the GEMM FLOPs of one forward + backward: ``6 * (weights in GEMMs) * tokens``
(2 forward, 4 backward: dX and dW; the weights of the QKV, attention output, MLP and output-layer
linears; the output layer over all T rows, as both specs compute every position's logits; the
embedding lookup is not a GEMM) plus causal attention, ``3 * 2 * n^2 * heads * head_dim`` per
sequence of n tokens and layer (QK^T and PV over the causal half, forward once and backward
twice); elementwise ops, norms and the softmaxes are not counted. Next to it, the machine's bf16 and fp32 GEMM
FLOP/s measured in the same child process, with the same thread count (:func:`gemm_flops_per_s`:
best of a few ``torch.nn.functional.linear`` of [512, 1024] inputs and a [3072, 1024] weight, the
batch's tokens times the Qwen3-0.6B MLP's widths, in a linear layer's own operand layout).
``--backward-precision fp32``: the vLLM spec's linears run the fp32 closed-form backward
(``align.backward_precision: fp32``) instead of the library's GEMMs; keys then end in ``-fp32``.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from figures import add_json_option, write_figures

MODELS = {
    "tiny": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=512),
    "hidden1024": dict(hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=2816, vocab_size=2048),
    "qwen3_0.6b": dict(architecture="qwen3", hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
}
BATCH_LENGTHS = (128, 128, 128, 128)  # equal lengths: the local spec's padded batch has no padding


def isa_description() -> str:
    """``"<torch CPU capability>, avx512_bf16 yes|no, amx_bf16 yes|no"`` for this machine."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    marks = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))
    return f"{torch.backends.cpu.get_cpu_capability()}, {marks}"


def step_flops(name: str) -> float:
    """GEMM FLOPs of one forward + backward of model ``name`` on :data:`BATCH_LENGTHS` (module docstring)."""
    from megatron_vllm_align.engine.tiny_models import TinyModelConfig

    config = TinyModelConfig(**MODELS[name])
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
    per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * config.intermediate_size
    weights = config.num_layers * per_layer + config.vocab_size * hidden
    tokens = sum(BATCH_LENGTHS)
    attention = config.num_layers * sum(3 * 2 * n * n * config.num_heads * head_dim for n in BATCH_LENGTHS)
    return 6.0 * weights * tokens + attention


def gemm_flops_per_s(dtype_name: str, shape: tuple[int, int, int] = (512, 1024, 3072), repeats: int = 7) -> float:
    """Best-of-``repeats`` FLOP/s of ``torch.nn.functional.linear`` of [m, k] inputs and an [n, k] weight
    in ``dtype_name`` ("bfloat16" / "float32") in this process (its thread count)."""
    import torch

    m, k, n = shape
    dtype = getattr(torch, dtype_name)
    inputs, weight = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    torch.nn.functional.linear(inputs, weight)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(inputs, weight)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best


def machine_gemm() -> dict:
    """``{"gemm_bf16_flops": ..., "gemm_fp32_flops": ...}`` (:func:`gemm_flops_per_s`)."""
    return {f"gemm_{short}_flops": gemm_flops_per_s(name) for short, name in (("bf16", "bfloat16"),
                                                                              ("fp32", "float32"))}


def run_one(checkpoint: str, align: bool, steps: int, warmup: int) -> dict:
    """In this process: build, warm up, time `steps` forward+backward steps; returns the figures (the linear
    backward in the precision the caller set, ``set_backward_precision``)."""
    import torch

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import token_logprobs
    from megatron_vllm_align.validation.saved_activations import model_blocks, saved_activation_bytes

    init_single_process_cpu()
    model = build_gpt_from_hf(checkpoint, align=align)
    model.train()
    batch = random_token_sequences(BATCH_LENGTHS, vocab_size=model.vocab_size, seed=0)
    saved = saved_activation_bytes(model_blocks(model), lambda: -torch.cat(token_logprobs(model, batch)).mean())
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        (-torch.cat(token_logprobs(model, batch)).mean()).backward()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"median_step_s": statistics.median(times), "min_step_s": min(times),
            "peak_rss_growth_mib": (rss_after_kib - rss_before_kib) / 1024,
            "peak_rss_mib": rss_after_kib / 1024, "saved_bytes": saved.total(), **machine_gemm()}


def alternated_times(models: dict, phases: dict, steps: int, warmup: int) -> dict[str, list[float]]:
    """``{"<model>_<phase>": [seconds]}``: in each of ``warmup + steps`` rounds every model runs every phase
    (``phase(model)``) in turn; the last ``steps`` rounds are kept."""
    times: dict[str, list[float]] = {f"{name}_{phase}": [] for name in models for phase in phases}
    for step in range(warmup + steps):
        for name, model in models.items():
            for phase, run in phases.items():
                start = time.perf_counter()
                run(model)
                if step >= warmup:
                    times[f"{name}_{phase}"].append(time.perf_counter() - start)
    return times


def training_step(batch) -> Callable:
    """``step(model)``: zero the gradients, forward and backward of the mean negative logprob of ``batch``."""
    import torch

    from megatron_vllm_align.megatron.logprobs import token_logprobs

    def step(model) -> None:
        model.zero_grad(set_to_none=True)
        (-torch.cat(token_logprobs(model, batch)).mean()).backward()

    return step


def run_interleaved(checkpoint: str, steps: int, warmup: int) -> dict:
    """In this process: both specs built, their steps alternated; min and median step time of each."""
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu()
    models = {"local": build_gpt_from_hf(checkpoint, align=False).train(),
              "vllm": build_gpt_from_hf(checkpoint, align=True).train()}
    batch = random_token_sequences(BATCH_LENGTHS, vocab_size=models["local"].vocab_size, seed=0)
    times = alternated_times(models, {"step": training_step(batch)}, steps, warmup)
    return {**{f"{name}_{stat.__name__}_s": stat(times[f"{name}_step"]) for name in models
               for stat in (min, statistics.median)}, **machine_gemm()}


def measure(checkpoint: Path, align: bool | None, steps: int, warmup: int, threads: int,
            backward_precision: str = "library") -> dict:
    """:func:`run_one` in a fresh subprocess (its own ru_maxrss) with ``threads`` OpenMP threads
    (``align=None``: :func:`run_interleaved`) and the vLLM spec's linear backward in ``backward_precision``."""
    command = [sys.executable, __file__, "--child", str(checkpoint), "--steps", str(steps), "--warmup", str(warmup),
               "--backward-precision", backward_precision]
    if align is None:
        command.append("--interleaved")
    elif align:
        command.append("--align")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"measurement subprocess failed ({checkpoint.name}, align={align}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _throughput(flops: float, local_s: float, aligned_s: float, gemm: dict) -> str:
    return (f"achieved {flops / local_s / 1e9:.0f} (local) / {flops / aligned_s / 1e9:.0f} (vLLM) GFLOP/s; "
            f"machine GEMM bf16 {gemm['gemm_bf16_flops'] / 1e9:.0f}, fp32 {gemm['gemm_fp32_flops'] / 1e9:.0f} GFLOP/s")


def main() -> None:
    from megatron_vllm_align.ops.dense_linear.vjp import BACKWARD_PRECISIONS, set_backward_precision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", default="1,2", help="comma-separated OMP_NUM_THREADS values")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--child")
    parser.add_argument("--align", action="store_true")
    parser.add_argument("--interleaved", action="store_true", help="alternate both specs in one process (docstring)")
    parser.add_argument("--backward-precision", default="library", choices=BACKWARD_PRECISIONS,
                        help="the vLLM spec's linear backward (align.backward_precision)")
    add_json_option(parser)
    args = parser.parse_args()
    if args.child:
        set_backward_precision(args.backward_precision)
        run = run_interleaved(args.child, args.steps, args.warmup) if args.interleaved else \
            run_one(args.child, args.align, args.steps, args.warmup)
        print(json.dumps(run))
        return
    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model

    print(f"ISA: {isa_description()}")
    suffix = "" if args.backward_precision == "library" else f"-{args.backward_precision}"
    print(f"vLLM spec's linear backward: {args.backward_precision}")
    print(f"batch {BATCH_LENGTHS} tokens; median of {args.steps} steps after {args.warmup} warm-up; "
          f"memory = growth of ru_maxrss, saved = bytes saved for backward")
    figures = {}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            checkpoint = build_tiny_hf_model(Path(root) / name, TinyModelConfig(**MODELS[name]))
            flops = step_flops(name)
            print(f"{name}: {flops / 1e9:.1f} GFLOP per step (GEMMs + causal attention, module docstring)")
            for threads in (int(t) for t in args.threads.split(",")):
                if args.interleaved:
                    both = measure(checkpoint, None, args.steps, args.warmup, threads, args.backward_precision)
                    ratio = both["vllm_min_s"] / both["local_min_s"]
                    figures[f"{name}-t{threads}{suffix}"] = {"step_ratio_of_minima": ratio}
                    print(f"{name}, {threads} thread(s), interleaved: step local min {both['local_min_s'] * 1e3:.1f} "
                          f"ms (median {both['local_median_s'] * 1e3:.1f}), vLLM min {both['vllm_min_s'] * 1e3:.1f} "
                          f"ms (median {both['vllm_median_s'] * 1e3:.1f}), ratio of minima {ratio:.2f} | "
                          f"{_throughput(flops, both['local_min_s'], both['vllm_min_s'], both)}")
                    continue
                local = measure(checkpoint, False, args.steps, args.warmup, threads)
                aligned = measure(checkpoint, True, args.steps, args.warmup, threads, args.backward_precision)
                ratios = {"step_ratio": aligned["median_step_s"] / local["median_step_s"],
                          "saved_bytes_ratio": aligned["saved_bytes"] / local["saved_bytes"],
                          "peak_rss_growth_ratio":
                              aligned["peak_rss_growth_mib"] / max(local["peak_rss_growth_mib"], 1e-9)}
                figures[f"{name}-t{threads}{suffix}"] = ratios
                print(f"{name}, {threads} thread(s): step local {local['median_step_s'] * 1e3:.1f} ms, vLLM "
                      f"{aligned['median_step_s'] * 1e3:.1f} ms, ratio {ratios['step_ratio']:.2f} | saved for backward "
                      f"{local['saved_bytes'] / 2**20:.1f} vs {aligned['saved_bytes'] / 2**20:.1f} MiB, ratio "
                      f"{ratios['saved_bytes_ratio']:.2f} | peak RSS growth {local['peak_rss_growth_mib']:.1f} vs "
                      f"{aligned['peak_rss_growth_mib']:.1f} MiB, ratio {ratios['peak_rss_growth_ratio']:.2f} | "
                      f"{_throughput(flops, local['median_step_s'], aligned['median_step_s'], aligned)}")
    write_figures(args.json, "spec_step", figures)


if __name__ == "__main__":
    main()

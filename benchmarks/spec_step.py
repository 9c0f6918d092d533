"""Step time and peak memory of the vLLM-forward spec against Megatron's local spec, on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_step.py [--steps 7] [--warmup 2]

For each model (the tiny test model, hidden 256, and a wider one, hidden 1024) and each spec,
one fresh subprocess builds the model from the same random checkpoint and runs forward +
backward (mean negative prompt logprob of a fixed batch) repeatedly; it reports the median step
time after warm-up, and the growth of the process's peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) from just before the first step to the end.
Why max RSS in separate processes, not tracemalloc: tracemalloc sees only Python's allocator,
while the tensors (torch's CPU allocator, oneDNN, vLLM's packed weights) come from malloc; and
ru_maxrss never decreases, so each measurement needs its own process. Prints the ratios
vLLM-spec / local-spec. Not a test: nothing is asserted.
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
from pathlib import Path

MODELS = {
    "tiny (hidden 256)": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=512),
    "wide (hidden 1024)": dict(hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=2816,
                               vocab_size=2048),
}
BATCH_LENGTHS = (128, 128, 128, 128)  # equal lengths: the local spec's padded batch has no padding


def run_one(checkpoint: str, align: bool, steps: int, warmup: int) -> dict:
    """In this process: build, warm up, time `steps` forward+backward steps; returns the figures."""
    import torch

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    init_single_process_cpu()
    model = build_gpt_from_hf(checkpoint, align=align)
    model.train()
    batch = random_token_sequences(BATCH_LENGTHS, vocab_size=model.vocab_size, seed=0)
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        (-torch.cat(token_logprobs(model, batch)).mean()).backward()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"median_step_s": statistics.median(times), "peak_rss_growth_mib": (rss_after_kib - rss_before_kib) / 1024,
            "peak_rss_mib": rss_after_kib / 1024}


def measure(checkpoint: Path, align: bool, steps: int, warmup: int) -> dict:
    """:func:`run_one` in a fresh subprocess (its own ru_maxrss)."""
    command = [sys.executable, __file__, "--child", str(checkpoint), "--steps", str(steps), "--warmup", str(warmup)]
    if align:
        command.append("--align")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measurement subprocess failed ({checkpoint.name}, align={align}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child")
    parser.add_argument("--align", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.align, args.steps, args.warmup)))
        return
    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model

    print(f"torch threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; batch {BATCH_LENGTHS} "
          f"tokens; median of {args.steps} steps after {args.warmup} warm-up; memory = growth of ru_maxrss")
    with tempfile.TemporaryDirectory() as root:
        for name, shape in MODELS.items():
            checkpoint = build_tiny_hf_model(Path(root) / name.split()[0], TinyModelConfig(**shape))
            local = measure(checkpoint, False, args.steps, args.warmup)
            aligned = measure(checkpoint, True, args.steps, args.warmup)
            print(f"{name}: step local {local['median_step_s'] * 1e3:.1f} ms, vLLM {aligned['median_step_s'] * 1e3:.1f} ms, "
                  f"ratio {aligned['median_step_s'] / local['median_step_s']:.2f} | peak RSS growth local "
                  f"{local['peak_rss_growth_mib']:.1f} MiB, vLLM {aligned['peak_rss_growth_mib']:.1f} MiB, ratio "
                  f"{aligned['peak_rss_growth_mib'] / max(local['peak_rss_growth_mib'], 1e-9):.2f} | peak RSS local "
                  f"{local['peak_rss_mib']:.0f} MiB, vLLM {aligned['peak_rss_mib']:.0f} MiB, ratio "
                  f"{aligned['peak_rss_mib'] / local['peak_rss_mib']:.2f}")


if __name__ == "__main__":
    main()

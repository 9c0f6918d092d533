"""Where the step's time goes: ``torch.profiler`` tables (top ops by self CPU time), forward and
backward profiled separately, for Megatron's local spec and the vLLM-forward spec.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py [--models hidden1024,qwen3_0.6b] \
        [--top 12] [--warmup 2]

Same models and batch as ``spec_step.py`` (4 x 128 tokens, mean negative prompt logprob); ``--warmup``
steps, then one profiled forward and one profiled backward per spec. Prints Markdown tables
(op, calls, self CPU ms, share of the phase). Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from spec_step import BATCH_LENGTHS, MODELS


def _table(profile, top: int) -> list[str]:
    events = [e for e in profile.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = ["| op | calls | self CPU ms | share |", "|---|---|---|---|"]
    for e in events[:top]:
        lines.append(f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e3:.1f} "
                     f"| {e.self_cpu_time_total / total:.0%} |")
    lines.append(f"| (total) | | {total / 1e3:.1f} | 100% |")
    return lines


def profile_spec(checkpoint: Path, align: bool, top: int, warmup: int) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    model = build_gpt_from_hf(checkpoint, align=align).train()
    batch = random_token_sequences(BATCH_LENGTHS, vocab_size=model.vocab_size, seed=0)
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        (-torch.cat(token_logprobs(model, batch)).mean()).backward()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as forward:
        loss = -torch.cat(token_logprobs(model, batch)).mean()
    with profile(activities=[ProfilerActivity.CPU]) as backward:
        loss.backward()
    name = "vLLM spec" if align else "local spec"
    return [f"**{name}, forward**", "", *_table(forward, top), "",
            f"**{name}, backward**", "", *_table(backward, top), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hidden1024,qwen3_0.6b")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled steps first")
    args = parser.parse_args()
    import torch

    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu()
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            checkpoint = build_tiny_hf_model(Path(root) / name, TinyModelConfig(**MODELS[name]))
            print(f"### {name} ({torch.get_num_threads()} thread(s), batch {BATCH_LENGTHS})\n")
            for align in (False, True):
                print("\n".join(profile_spec(checkpoint, align, args.top, args.warmup)))


if __name__ == "__main__":
    main()

"""Where the step's time goes: ``torch.profiler`` tables of one forward + backward step, Megatron's
local spec and the vLLM-forward spec side by side.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_step.py [--models tiny,hidden1024,qwen3_0.6b] \
        [--top 15] [--warmup 2] [--profiled 3]

Same models and batch as ``spec_step.py`` (4 x 128 tokens, mean negative prompt logprob). Both specs
are built in this process from the same checkpoint; after ``--warmup`` steps of each, ``--profiled``
steps of each are profiled alternately and the fastest profiled step of each spec is kept (on a
machine shared with other work a load burst only slows a step down). Prints two Markdown tables per
model: the top ops by self CPU time (``aten::*`` kernels, vLLM's ``_C::*`` kernels, the autograd
Functions' own Python time), and the backward node totals (``autograd::engine::evaluate_function``:
each backward Function including the kernels it calls), each with calls and milliseconds per spec.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from spec_step import BATCH_LENGTHS, MODELS, isa_description

SPECS = ("local", "vLLM")
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


def profiled_steps(checkpoint: Path, warmup: int, profiled: int) -> dict[str, dict[str, tuple[int, float, float]]]:
    """Per spec: op name -> (calls, self CPU ms, total CPU ms) of its fastest profiled step, and the
    step's wall time under ``"(step wall ms)"``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    models = {"local": build_gpt_from_hf(checkpoint, align=False).train(),
              "vLLM": build_gpt_from_hf(checkpoint, align=True).train()}
    batch = random_token_sequences(BATCH_LENGTHS, vocab_size=models["local"].vocab_size, seed=0)

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        (-torch.cat(token_logprobs(model, batch)).mean()).backward()

    for _ in range(warmup):
        for model in models.values():
            step(model)
    best: dict[str, tuple[float, dict]] = {}
    for _ in range(profiled):
        for name, model in models.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                step(model)
                wall = time.perf_counter() - start
            if name not in best or wall < best[name][0]:
                best[name] = (wall, {e.key: (e.count, e.self_cpu_time_total / 1e3, e.cpu_time_total / 1e3)
                                     for e in prof.key_averages()})
    return {name: {**events, "(step wall ms)": (1, wall * 1e3, wall * 1e3)} for name, (wall, events) in best.items()}


def side_by_side(events: dict[str, dict], keys: list[str], column: int, top: int, label: str) -> list[str]:
    """Markdown rows of the ``top`` keys by the larger of the two specs' value in ``column`` (1: self
    ms, 2: total ms)."""
    def value(spec: str, key: str) -> tuple[int, float]:
        calls, *times = events[spec].get(key, (0, 0.0, 0.0))
        return calls, times[column - 1]

    keys = sorted(keys, key=lambda k: -max(value(s, k)[1] for s in SPECS))[:top]
    lines = [f"| {label} | local calls | local ms | vLLM calls | vLLM ms |", "|---|---|---|---|---|"]
    for key in keys:
        (lc, lt), (vc, vt) = value("local", key), value("vLLM", key)
        lines.append(f"| `{key.removeprefix(_BACKWARD_NODE)}` | {lc} | {lt:.1f} | {vc} | {vt:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,hidden1024,qwen3_0.6b")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled steps of each spec first")
    parser.add_argument("--profiled", type=int, default=3, help="profiled steps of each spec; the fastest is kept")
    args = parser.parse_args()
    import torch

    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    init_single_process_cpu()
    print(f"ISA: {isa_description()}")
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            checkpoint = build_tiny_hf_model(Path(root) / name, TinyModelConfig(**MODELS[name]))
            events = profiled_steps(checkpoint, args.warmup, args.profiled)
            keys = set(events["local"]) | set(events["vLLM"])
            walls = {spec: events[spec]["(step wall ms)"][1] for spec in SPECS}
            totals = {spec: sum(v[1] for k, v in events[spec].items() if k != "(step wall ms)") for spec in SPECS}
            print(f"\n### {name} ({torch.get_num_threads()} thread(s), batch {BATCH_LENGTHS})\n")
            print(f"profiled step wall time: local {walls['local']:.1f} ms, vLLM {walls['vLLM']:.1f} ms; "
                  f"summed self CPU time: local {totals['local']:.1f} ms, vLLM {totals['vLLM']:.1f} ms\n")
            ops = [k for k in keys if not k.startswith(_BACKWARD_NODE) and k != "(step wall ms)"]
            print("\n".join(side_by_side(events, ops, 1, args.top, "op (self CPU)")) + "\n")
            nodes = [k for k in keys if k.startswith(_BACKWARD_NODE)]
            print("\n".join(side_by_side(events, nodes, 2, args.top, "backward node (total CPU)")))


if __name__ == "__main__":
    main()

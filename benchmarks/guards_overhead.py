"""Step time of a small training loop with the training guards off and on, as ratios.

    python benchmarks/guards_overhead.py [--steps 60] [--hidden 512] [--layers 4] [--every 10]

Arms: no guards; GradientDumper every N steps; GradientDumper every step; validate_freeze
around every step (one frozen layer); check_optimizer_identity (no forward) every step.
Per-step wall time (forward, backward, step and the guard) on CPU in one process, arms
interleaved step by step so that load from other processes hits all alike; the mean includes
the amortised dumps of the every-N arm, the median shows a typical step. Dumps go to a
temporary folder. Not a test: it prints figures.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from figures import add_json_option, write_figures
from torch import nn

from megatron_vllm_align.guards import GradientDumper, check_optimizer_identity, validate_freeze

Arm = Callable[[nn.Module, torch.optim.Optimizer, str], Callable[[], object]]


def _model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers)])


class _Loop:
    """One training loop (own model, optimizer, batch) stepped with one guard arm."""

    def __init__(self, hidden: int, layers: int, arm: Arm, directory: str) -> None:
        self.model = _model(hidden, layers)
        self.model[0][0].weight.requires_grad_(False)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01)
        self.batch = torch.randn(64, hidden, generator=torch.Generator().manual_seed(0))
        self.guarded_step = arm(self.model, self.optimizer, directory)
        self.seconds: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.model(self.batch).pow(2).mean().backward()
        self.guarded_step()
        self.seconds.append(time.perf_counter() - start)


def _plain(model, optimizer, directory):
    return optimizer.step


def _dumper(every: int):
    def arm(model, optimizer, directory):
        GradientDumper(optimizer, directory, every=every, model=model)
        return optimizer.step
    return arm


def _freeze(model, optimizer, directory):
    def step():
        with validate_freeze(model, optimizer, ["0.0.weight"]):
            optimizer.step()
    return step


def _identity(model, optimizer, directory):
    def step():
        findings = check_optimizer_identity(model, optimizer)
        if findings:
            raise RuntimeError(f"unexpected identity findings: {findings}")
        optimizer.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--every", type=int, default=10)
    add_json_option(parser)
    args = parser.parse_args()
    arms = {
        "no guards": _plain,
        f"dump every {args.every} steps": _dumper(args.every),
        "dump every step": _dumper(1),
        "validate_freeze every step": _freeze,
        "check_optimizer_identity every step": _identity,
    }
    params = sum(p.numel() for p in _model(args.hidden, args.layers).parameters())
    print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}), {params / 1e6:.2f} M fp32 parameters; "
          f"{args.steps - 2} steps per arm, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as directory:
        loops = {label: _Loop(args.hidden, args.layers, arm, f"{directory}/{index}")
                 for index, (label, arm) in enumerate(arms.items())}
        for _ in range(args.steps):
            for loop in loops.values():
                loop.step()
    kept = {label: loop.seconds[2:] for label, loop in loops.items()}  # the first steps allocate optimizer state
    mean_base, median_base = statistics.mean(kept["no guards"]), statistics.median(kept["no guards"])
    print(f"{'':38s} {'mean ms':>8s} {'ratio':>6s} {'median ms':>10s} {'ratio':>6s}")
    figures = {}
    for label, seconds in kept.items():
        mean, median = statistics.mean(seconds), statistics.median(seconds)
        print(f"{label:38s} {mean * 1e3:8.2f} {mean / mean_base:6.2f} {median * 1e3:10.2f} {median / median_base:6.2f}")
        if label != "no guards":
            figures[label.replace(" ", "_")] = {"step_ratio": mean / mean_base}
    write_figures(args.json, "guards_overhead", figures)

if __name__ == "__main__":
    main()

"""What computing a TP = 2 engine's shards costs a TP = 1 trainer: the aligned trainer built with
``engine_tensor_parallel_size=2`` (megatron/engine_layout.py) against the same trainer in its own layout.

    .venv/bin/python benchmarks/cross_layout.py [--models tiny,hidden1024,qwen3_0.6b] [--steps 7] [--warmup 2]

Per model (``spec_step``'s models and batch, 4 x 128 tokens), both trainers are built in one process from the
same checkpoint and their steps alternated: a forward + backward step (mean negative prompt logprob) and a
forward without autograd (the logprob recompute of an RL step). Ratios of the minima, emulated / own layout
(a load burst can only raise a minimum); ``OMP_NUM_THREADS`` as the caller sets it. Not a test: nothing is
asserted.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from figures import add_json_option, write_figures
from spec_step import BATCH_LENGTHS, MODELS, alternated_times, isa_description, training_step


def interleaved_minima(checkpoint: Path, steps: int, warmup: int) -> dict[str, float]:
    """``{"<trainer>_<phase>_s": minimum}`` for trainers ``own`` / ``emulated`` and phases ``step`` / ``forward``."""
    import torch

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    models = {"own": build_gpt_from_hf(checkpoint, align=True).train(),
              "emulated": build_gpt_from_hf(checkpoint, align=True, engine_tensor_parallel_size=2).train()}
    batch = random_token_sequences(BATCH_LENGTHS, vocab_size=models["own"].vocab_size, seed=0)

    def forward(model) -> None:
        with torch.no_grad():
            token_logprobs(model, batch)

    times = alternated_times(models, {"step": training_step(batch), "forward": forward}, steps, warmup)
    return {f"{key}_s": min(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    add_json_option(parser)
    args = parser.parse_args()
    import torch

    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model

    print(f"ISA: {isa_description()}; {torch.get_num_threads()} thread(s); batch {BATCH_LENGTHS} tokens; minimum of "
          f"{args.steps} alternated steps after {args.warmup} warm-up")
    figures = {}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            checkpoint = build_tiny_hf_model(Path(root) / name, TinyModelConfig(**MODELS[name]))
            minima = interleaved_minima(checkpoint, args.steps, args.warmup)
            figures[name] = {f"{phase}_ratio": minima[f"emulated_{phase}_s"] / minima[f"own_{phase}_s"]
                             for phase in ("step", "forward")}
            print(f"{name}: step own {minima['own_step_s'] * 1e3:.1f} ms, TP=2 shards "
                  f"{minima['emulated_step_s'] * 1e3:.1f} ms, ratio {figures[name]['step_ratio']:.2f} | forward own "
                  f"{minima['own_forward_s'] * 1e3:.1f} ms, TP=2 shards {minima['emulated_forward_s'] * 1e3:.1f} ms, "
                  f"ratio {figures[name]['forward_ratio']:.2f}")
    write_figures(args.json, "cross_layout", figures)


if __name__ == "__main__":
    main()

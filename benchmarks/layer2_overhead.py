"""Cost of the recipe's layer-2 hook (``train.layer2``) as a ratio of training time, in one run.

    OMP_NUM_THREADS=1 python benchmarks/layer2_overhead.py [--every 10] [--blocks 6] [--recipe R.yaml]
        [--json FILE] [key=value ...]

One process, one model (``recipes/tiny_llama_fp8_layer2.yaml`` unless ``--recipe``; overrides
as for ``-m megatron_vllm_align.train``), one trainer. The loop runs blocks of ``--every``
optimizer steps, alternately without the hook and with it (capture on the block's last step, then
measure and publish between its backward and its optimizer step, as ``train.run`` does:
TensorBoard and ``layer2.md`` into a temporary folder), so that load from other processes hits
both alike. A step's time is batch selection, forward, backward, optimizer step and, in hooked
blocks, the hook; no validation. The first block (warm-up) is dropped.
Prints the mean step time of each kind of block and their ratio (the hook's overhead averaged
over steps at ``layer2.every = --every``), the medians of a measured step's phases (the step with
the capture hooks, measure, publish) and a ratio from medians, robust to other processes' load
spikes on a shared machine; ``--json``: ``layer2_overhead.hidden<H>-every<N>.{mean_ratio,
median_ratio}`` (``figures.py``, the format ``run_all.py`` merges). Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from figures import add_json_option, write_figures

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each kind after the warm-up block")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny_llama_fp8_layer2.yaml"))
    parser.add_argument("overrides", nargs="*")
    add_json_option(parser)
    args = parser.parse_args()

    import torch

    from megatron_vllm_align.logging import PanelWriter
    from megatron_vllm_align.train.config import load_recipe
    from megatron_vllm_align.train.distributed import init_distributed
    from megatron_vllm_align.train.layer2 import Layer2Hook
    from megatron_vllm_align.train.run_setup import (
        build_model,
        initial_checkpoint,
        model_logprobs,
        prepare_run_dir,
        recipe_splits,
        step_batch,
    )
    from megatron_vllm_align.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as folder:
        total = args.every * (2 * args.blocks + 1)
        recipe = load_recipe(args.recipe, [*args.overrides, f"train.run_dir={folder}/run", "train.progress_bar=false",
                                           f"layer2.every={args.every}", f"train.steps={total}"])
        env = init_distributed(recipe.train.seed)
        run_dir = prepare_run_dir(recipe, env, "metrics.json")
        checkpoint = initial_checkpoint(recipe, run_dir, env)
        model = build_model(recipe, checkpoint, True)
        splits = recipe_splits(recipe, checkpoint, model.vocab_size)
        trainer = Trainer(model, model_logprobs(model), recipe.optimizer, total_steps=total)
        hook = Layer2Hook(model, recipe.layer2, run_dir, console=lambda line: None)
        seconds: dict[str, list[float]] = {"without hook": [], "with hook": []}
        phases: dict[str, list[float]] = {"step with capture": [], "measure": [], "publish": []}
        with PanelWriter(run_dir / "tensorboard") as writer:
            for step in range(1, total + 1):
                block = (step - 1) // args.every
                hooked = block % 2 == 0 and block > 0
                start = time.perf_counter()
                examples, tokens, loss_tokens = step_batch(splits, step, recipe, env)
                with hook.capture(step) if hooked else contextlib.nullcontext():
                    trainer.forward_backward(examples, loss_tokens)
                measuring = time.perf_counter()
                if hooked and hook.due(step):   # as train.run: between the backward and the update
                    result = hook.measure(step, hook.take_captures())
                    measured_at = time.perf_counter()
                    hook.publish(step, result, writer)
                    published_at = time.perf_counter()
                trainer.apply_update(step, tokens, loss_tokens)
                if hooked and hook.due(step):
                    phases["step with capture"].append(measuring - start + time.perf_counter() - published_at)
                    phases["measure"].append(measured_at - measuring)
                    phases["publish"].append(published_at - measured_at)
                if block > 0:
                    seconds["with hook" if hooked else "without hook"].append(time.perf_counter() - start)
        measured = len(hook.results)
    width = recipe.model.tiny
    print(f"model: {width.num_layers} layers, hidden {width.hidden_size}, ffn {width.intermediate_size}, "
          f"{len(hook.linears)} FP8 linears; global batch {recipe.train.global_batch_size}; "
          f"{torch.get_num_threads()} threads; layer2.every = {args.every}, {measured} measured steps")
    base = statistics.mean(seconds["without hook"])
    for label, values in seconds.items():
        mean = statistics.mean(values)
        print(f"{label:14s} {len(values):4d} steps  mean {mean * 1e3:8.2f} ms  median "
              f"{statistics.median(values) * 1e3:8.2f} ms  mean ratio {mean / base:6.3f}")
    plain = statistics.median(seconds["without hook"])
    medians = {label: statistics.median(values) for label, values in phases.items()}
    print("measured step, medians: " + ", ".join(f"{label} {value * 1e3:.2f} ms" for label, value in medians.items()))
    extra = medians["step with capture"] - plain + medians["measure"] + medians["publish"]
    robust = 1 + extra / (args.every * plain)
    print(f"robust ratio (medians; the extra time of one measured step spread over {args.every} steps): "
          f"{robust:.3f}")
    write_figures(args.json, "layer2_overhead", {f"hidden{width.hidden_size}-every{args.every}": {
        "mean_ratio": statistics.mean(seconds["with hook"]) / base, "median_ratio": robust}})


if __name__ == "__main__":
    main()

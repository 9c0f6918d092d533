"""``torchrun --nproc-per-node N -m megatron_vllm_align.train --recipe R.yaml [-v] [key.path=value ...]``.

Runs plain SFT, the layer-3 three-arm comparison when the recipe has a ``layer3`` section, or
on-policy GRPO (:mod:`megatron_vllm_align.rl`) when it has an ``rl`` section.
Also valid without torchrun (one process). Exit status 2 on a recipe error, with the message
naming the key. Engine and library logs go to ``<train.run_dir>/engine.log`` (rank N > 0:
``engine.rankN.log``; ``utils.console``), the console shows the progress bar and the result line;
``-v``: everything on the console.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_vllm_align.train.config import Recipe, RecipeError, check_world_size, load_recipe
from megatron_vllm_align.utils.console import engine_logs_to


def run_recipe(recipe: Recipe) -> tuple[int, str]:
    """Run the recipe (module docstring); its exit status and result line."""
    if recipe.layer3 is not None:
        from megatron_vllm_align.train.layer3 import run_layer3

        layer3 = run_layer3(recipe)
        return 1 if layer3.verdict == "fail" else 0, (f"layer3 verdict: {layer3.verdict} - {layer3.verdict_detail}; "
                                                      f"first divergence: {layer3.localisation.stage or 'none'}")
    if recipe.rl is not None:
        from megatron_vllm_align.rl.run import run_grpo

        summary = run_grpo(recipe)
        return 0, (f"grpo done: {summary['steps']} steps, max |delta logprob| on sampled tokens "
                   f"{summary['on_policy']['max_abs_delta_logprob']}, "
                   f"final reward mean {summary['reward_mean'][-1]:.4f}")
    from megatron_vllm_align.train.run import run_sft

    result = run_sft(recipe)
    steps = next(iter(result["arms"].values()))
    if not steps:
        return 0, "sft: no steps"
    return 0, f"sft done: {len(steps)} steps, final train loss {steps[-1]['train_loss']:.6f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vllm_align.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe YAML file")
    parser.add_argument("-v", "--verbose", action="store_true", help="engine and library logs on the console")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. align.enabled=false")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        check_world_size(recipe, int(os.environ.get("WORLD_SIZE", "1")))   # before megatron and vLLM are imported
    except RecipeError as error:
        print(f"recipe error: {error}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    log = Path(recipe.train.run_dir) / ("engine.log" if rank == 0 else f"engine.rank{rank}.log")
    try:
        with engine_logs_to(log, verbose=args.verbose):
            status, line = run_recipe(recipe)
    except RecipeError as error:
        print(f"recipe error: {error}" + ("" if args.verbose else f" (engine and library logs: {log})"),
              file=sys.stderr)
        return 2
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())

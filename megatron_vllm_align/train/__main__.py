"""``torchrun --nproc-per-node N -m megatron_vllm_align.train --recipe R.yaml [key.path=value ...]``.

Runs plain SFT, the layer-3 three-arm comparison when the recipe has a ``layer3`` section, or
on-policy GRPO (:mod:`megatron_vllm_align.rl`) when it has an ``rl`` section.
Also valid without torchrun (one process). Exit status 2 on a recipe error, with the message
naming the key.
"""
from __future__ import annotations

import argparse
import sys

from megatron_vllm_align.train.config import RecipeError, load_recipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vllm_align.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. align.enabled=false")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as error:
        print(f"recipe error: {error}", file=sys.stderr)
        return 2
    if recipe.layer3 is not None:
        from megatron_vllm_align.train.layer3 import run_layer3

        run = run_layer3(recipe)
        print(f"layer3 verdict: {run.verdict} - {run.verdict_detail}; "
              f"first divergence: {run.localisation.stage or 'none'}")
        return 1 if run.verdict == "fail" else 0
    if recipe.rl is not None:
        from megatron_vllm_align.rl.run import run_grpo

        try:
            summary = run_grpo(recipe)
        except RecipeError as error:
            print(f"recipe error: {error}", file=sys.stderr)
            return 2
        print(f"grpo done: {summary['steps']} steps, max |delta logprob| on sampled tokens "
              f"{summary['on_policy']['max_abs_delta_logprob']}, final reward mean {summary['reward_mean'][-1]:.4f}")
        return 0
    from megatron_vllm_align.train.run import run_sft

    result = run_sft(recipe)
    steps = next(iter(result["arms"].values()))
    print(f"sft done: {len(steps)} steps, final train loss {steps[-1]['train_loss']:.6f}" if steps else "sft: no steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun worker: the GRPO run with a planted layout bug. The recipe asks the trainer to compute the TP 2
engine's shards (``align.engine_tensor_parallel_size: 2``), but the model is built in the trainer's own TP 1
layout, so its partial sums are not the engine's. Arguments: as ``python -m megatron_vllm_align.train``."""
import dataclasses
import sys

from megatron_vllm_align.rl import run as rl_run
from megatron_vllm_align.train.__main__ import main

_real = rl_run.build_model


def _own_layout(recipe, checkpoint_dir, align):
    own = dataclasses.replace(recipe, align=dataclasses.replace(recipe.align, engine_tensor_parallel_size=None))
    return _real(own, checkpoint_dir, align)


rl_run.build_model = _own_layout
if __name__ == "__main__":   # the TP 2 engine's workers are spawned: they import this file too
    sys.exit(main(sys.argv[1:]))

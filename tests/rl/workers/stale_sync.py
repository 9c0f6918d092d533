"""torchrun worker: the GRPO run with a planted stale weight sync. Every push into the engine leaves
out decoder layer ``STALE_LAYER``'s tensors, so the engine keeps serving that layer's initial weights
while the trainer's move on. Arguments: as ``python -m megatron_vllm_align.train``."""
import sys

from megatron_vllm_align.rl import run as rl_run
from megatron_vllm_align.train.__main__ import main

STALE_LAYER = 1
_real = rl_run.engine_weights


def _stale(model, hf_config):
    return _real(model, hf_config).without(f"model.layers.{STALE_LAYER}.")


rl_run.engine_weights = _stale
if __name__ == "__main__":   # a tensor-parallel engine's workers are spawned: they import this file too
    sys.exit(main(sys.argv[1:]))

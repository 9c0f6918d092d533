"""Training from recipes: schema and loading (:mod:`.config`), the generated SFT corpus
(:mod:`.data`), one arm's step (:mod:`.trainer`), checkpoints (:mod:`.checkpoint`), the SFT run
(:mod:`.run`) and the layer-3 three-arm comparison (:mod:`.layer3`). Entry point:
``torchrun --nproc-per-node N -m megatron_vllm_align.train --recipe R.yaml [overrides]``."""
from megatron_vllm_align.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_vllm_align.train.config import Recipe, RecipeError, apply_overrides, dump_recipe, load_recipe
from megatron_vllm_align.train.data import ByteTokenizer, SFTExample, build_splits
from megatron_vllm_align.train.layer3 import config_diff_markdown, run_layer3
from megatron_vllm_align.train.run import GuardError, run_sft
from megatron_vllm_align.train.trainer import Trainer

__all__ = [
    "ByteTokenizer", "CheckpointError", "GuardError", "Recipe", "RecipeError", "SFTExample", "Trainer",
    "apply_overrides", "build_splits", "config_diff_markdown", "dump_recipe", "load_checkpoint",
    "load_recipe", "run_layer3", "run_sft", "save_checkpoint",
]

"""Export a Megatron GPTModel (aligned or local spec) back to a Hugging Face checkpoint directory that
vLLM and transformers load as they load the original.

``export_hf_checkpoint(model, source_dir, target_dir)`` writes ``target_dir`` with the model's
parameters in the Hugging Face names and layout (:func:`hf_state_dict`, the exact inverse of the
loader), as safetensors shards of at most ``max_shard_bytes`` (one ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, through
``huggingface_hub.save_torch_state_dict``), and ``config.json``, ``generation_config.json`` and the
tokenizer files copied from ``source_dir`` (the checkpoint the model was built from). The dtype is the
parameters' (bf16 for the aligned model: the master values the engine deploys). The directory is
written beside the target and renamed into place, so a reader sees the old export or the new one,
never a half-written one.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from megatron_vllm_align.megatron.hf_checkpoint import HFDenseConfig, hf_tensors_from_megatron, read_hf_config
from megatron_vllm_align.megatron.vllm_tensor_parallel import full_tensor, is_gated_fc1

# Files of a checkpoint directory that are not weights and travel with an export unchanged.
CARRIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def hf_state_dict(model: nn.Module, hf_config: HFDenseConfig) -> dict[str, torch.Tensor]:
    """The model's parameters as Hugging Face tensors (names and layout of ``hf_config``'s family;
    the aligned MoE layers' stacked experts unstacked). Views of the parameters, not copies; under
    tensor parallelism the full tensors gathered from every rank's shard (collective over TP)."""
    from megatron_vllm_align.megatron.vllm_moe import unstack_expert_weights

    state = unstack_expert_weights({name: full_tensor(p.detach(), p, is_gated_fc1(model, name))
                                    for name, p in model.named_parameters()})
    return hf_tensors_from_megatron(state, hf_config)


def export_hf_checkpoint(model: nn.Module, source_dir: str | os.PathLike, target_dir: str | os.PathLike,
                         max_shard_bytes: int = 2 * 1024 ** 3, write: bool = True) -> Path:
    """Write ``target_dir`` (module docstring); returns it. An existing ``target_dir`` is replaced.
    Under tensor parallelism every rank calls it (the tensors are gathered) and the one with
    ``write=True`` writes.

    Raises OSError naming the target when it cannot be written (nothing is left half-written), and
    ``HFCheckpointError`` when the model does not fit ``source_dir``'s config."""
    from huggingface_hub import save_torch_state_dict

    source, target = Path(source_dir), Path(target_dir)
    tensors = {name: t.contiguous().clone().cpu() for name, t in hf_state_dict(model, read_hf_config(source)).items()}
    if not write:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial"))
    except OSError as error:
        raise OSError(error.errno, f"cannot write the Hugging Face export {str(target)!r}: "
                                   f"{error.strerror or error}") from error
    try:
        save_torch_state_dict(tensors, staging, max_shard_size=max_shard_bytes)
        for name in CARRIED_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        os.chmod(staging, 0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):
            raise OSError(error.errno, f"cannot write the Hugging Face export {str(target)!r}: "
                                       f"{error.strerror or error}") from error
        raise
    return target

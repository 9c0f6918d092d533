"""Bytes a forward saves for its backward, per block of a GPTModel: a memory figure that does not
depend on machine noise, so tests can assert it (the peak RSS that benchmarks measure does).

:func:`saved_activation_bytes` runs ``forward()`` under ``torch.autograd.graph.saved_tensors_hooks``
and attributes every tensor autograd saves to the block whose forward was running when it was
saved (``embedding``, ``layer i``, ``final norm``, ``output layer``, or ``other``: the loss after
the model). A storage is counted once, at its full size, however many saved views share it
(a saved slice keeps its whole storage alive). Only storages created during the forward count:
parameters, fp32 main copies and deployed values (a vLLM shadow layer's processed weight, saved
for the backward's dX) exist before and after the step and are not activations; they are found
as the storages of every tensor alive when the forward starts (``gc``).
"""
from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One saved storage: the block that saved it first, the shape and dtype of that first saved
    view, and the storage's size in bytes."""

    block: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SavedActivations:
    """Every saved storage (first-save order) and their bytes per block."""

    tensors: tuple[SavedTensor, ...]

    def per_block(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for tensor in self.tensors:
            totals[tensor.block] = totals.get(tensor.block, 0) + tensor.nbytes
        return totals

    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def model_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The blocks of a (possibly wrapped) GPTModel in forward order, by name."""
    from megatron.core.utils import get_attr_wrapped_model

    blocks = {"embedding": get_attr_wrapped_model(model, "embedding")}
    decoder = get_attr_wrapped_model(model, "decoder")
    blocks.update({f"layer {i}": layer for i, layer in enumerate(decoder.layers)})
    blocks["final norm"] = decoder.final_layernorm
    blocks["output layer"] = get_attr_wrapped_model(model, "output_layer")
    return blocks


def _live_storages() -> set[int]:
    """Data pointers of the storages of every tensor object alive now that has real data (meta and
    fake tensors, e.g. left by a tracing compiler, have none; some objects warn when ``isinstance``
    inspects them: silenced; a weak proxy whose referent is gone raises ``ReferenceError``: skipped)."""
    pointers = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and not obj.is_meta:
                    pointers.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError, ReferenceError):
                continue
    return pointers


def saved_activation_bytes(blocks: dict[str, nn.Module], forward: Callable[[], object]) -> SavedActivations:
    """What ``forward()`` saves for backward in storages it creates, attributed to ``blocks``
    (module docstring). Returns the saved tensors; ``forward``'s result is dropped (its graph
    with it)."""
    current = ["other"]
    stack: list[str] = []

    def enter(name: str):
        def hook(module, args):
            stack.append(current[0])
            current[0] = name
        return hook

    def leave(module, args, output):
        current[0] = stack.pop() if stack else "other"

    excluded = _live_storages()
    seen: dict[int, SavedTensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in excluded and key not in seen and storage.nbytes():
            seen[key] = SavedTensor(current[0], tuple(tensor.shape), tensor.dtype, storage.nbytes())
        return tensor

    handles = []
    for name, module in blocks.items():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return SavedActivations(tuple(seen.values()))

"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on a vLLM-forward GPTModel.

FSDP2 keeps each rank's shard of the master parameters as DTensors and, before a unit's forward,
all-gathers them into whole Parameters that it swaps into the unit's modules (after the forward
they are freed again; backward gathers them once more). A deployed value (vLLM's processing of a
master weight: prepacking, FP8 quantization) needs the whole weight, so here it is rebuilt from
the gathered master at every forward of its unit, by a forward pre-hook that runs after FSDP2's
own. What FSDP2 gathers is exactly what the optimizer last wrote into the shards, so a deployed
value cannot be stale and no refresh after ``optimizer.step()`` is needed (do not register
:func:`~megatron_vllm_align.ops.refresh.register_deployed_refresh` on a sharded model: its modules
hold DTensor shards between forwards). The gathered master equals the unsharded one bit for bit,
so the forward is the one-rank forward; gradients are FSDP2's reduce-scatter (a mean over the
data-parallel ranks) of the same closed-form VJPs.

Costs, stated: every forward runs vLLM's weight processing once per deployed layer (as Transformer
Engine casts to FP8 after each all-gather), and each rank keeps the whole deployed values (an
inference replica's worth; the FP8 backward reads them); master weights, gradients and optimizer
state are sharded.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.megatron.vllm_output import VllmOutputLayer, output_weight


def _deployed_modules(unit: nn.Module, nested_units: set[int]) -> list[nn.Module]:
    """Modules under ``unit`` with a deployed value, except those inside another FSDP unit."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if callable(getattr(module, "refresh_deployed", None)):
            found.append(module)
        for child in module.children():
            if id(child) not in nested_units:
                visit(child)

    visit(unit)
    return found


def _redeploy_hook(model: nn.Module, modules: list[nn.Module]) -> Callable[..., None]:
    def redeploy(_unit: nn.Module, _args: Any) -> None:
        with torch.no_grad():
            for module in modules:
                if isinstance(module, VllmOutputLayer):
                    module.deploy_from(output_weight(model))
                else:
                    module.refresh_deployed()

    return redeploy


def fully_shard_aligned(model: nn.Module, *, mesh: Any = None, reshard_after_forward: bool = True,
                        **fully_shard_kwargs: Any) -> nn.Module:
    """Shard a vLLM-forward GPTModel (``build_gpt_from_hf(..., align=True)``, tensor parallel size 1)
    with FSDP2: one unit per decoder layer, then the root (embedding, final norm, output layer).
    ``mesh``: a 1-D data-parallel DeviceMesh (default: FSDP2's, the whole world). Other keyword
    arguments go to ``fully_shard``. Returns ``model`` (now an ``FSDPModule``); collective."""
    from torch.distributed.fsdp import fully_shard

    from megatron_vllm_align.megatron.logprobs import uses_vllm_forward

    if not uses_vllm_forward(model):
        raise ValueError("fully_shard_aligned needs a vLLM-forward GPTModel (build_gpt_from_hf(..., align=True)); "
                         "shard Megatron's local spec with fully_shard itself")
    if model.config.tensor_model_parallel_size != 1:
        raise ValueError(f"fully_shard_aligned: tensor_model_parallel_size={model.config.tensor_model_parallel_size}; "
                         "FSDP2 over tensor-parallel shards (2-D) is not supported")
    layers = list(model.decoder.layers)
    units = {id(layer) for layer in layers}
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    for unit in (*layers, model):
        modules = _deployed_modules(unit, units - {id(unit)})
        if modules:
            unit.register_forward_pre_hook(_redeploy_hook(model, modules))
    return model

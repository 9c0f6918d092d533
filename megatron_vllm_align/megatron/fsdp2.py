"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on a vLLM-forward GPTModel.

Master parameters are sharded by FSDP2; every deployed value is rebuilt from the all-gathered master at
each forward of its unit (a forward pre-hook after FSDP2's own), so it is never stale and needs no
refresh after ``optimizer.step()`` (do not register
:func:`~megatron_vllm_align.ops.refresh.register_deployed_refresh` on a sharded model). The forward is
bitwise the one-rank forward; gradients are FSDP2's reduce-scatter (a mean over the data-parallel ranks)
of the same closed-form VJPs (:func:`shard_for_training`: a sum in fp32, the trainer's data-parallel
reduction). Each rank keeps the whole deployed values and reruns vLLM's weight
processing every forward. Why and costs: docs/megatron_facts.md#fsdp2-and-deployed-values-megatronfsdp2py.
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


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by FSDP2 (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_for_training(model: nn.Module, *, mesh: Any = None) -> nn.Module:
    """:func:`fully_shard_aligned` with the trainer's gradient reduction (recipe ``parallel.fsdp``): each
    unit's gradients are reduce-scattered as a SUM in fp32 and rounded back to the parameter dtype, the
    values ``train.distributed.all_reduce_gradients`` gives unsharded (the loss is already divided by the
    global token count, so no mean). Returns ``model``; collective."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    fully_shard_aligned(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)   # a plain SUM (gloo has no pre-multiplied sum)
    return model

"""A model's parameters by name, resolved to the tensor the optimizer must hold (FSDP2-aware).

Under FSDP2 (``fully_shard``) a module registers one of two tensors under a parameter's name:
the sharded DTensor (the real master, which the optimizer steps) or, while the module is
unsharded, an all-gathered compute copy. The root module is not resharded after a forward
(FSDP2 keeps it gathered for the backward that usually follows), so after a forward-only pass
``model.named_parameters()`` returns compute copies for the root's parameters: reading or
perturbing them does not touch the master. :func:`model_parameters` reads FSDP2's own
parameter records so that each name maps to its sharded master whatever state the module is in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelParameter:
    """One named parameter of a model.

    master: the tensor the optimizer must step (FSDP2: the sharded DTensor; else the parameter).
    registered: what ``getattr(module, leaf_name)`` returns now.
    unsharded: FSDP2's all-gathered compute copy (a separate tensor even while freed), else None.
    module_class: class name of the module that owns the parameter.
    """

    name: str
    module_class: str
    master: torch.Tensor
    registered: torch.Tensor
    unsharded: torch.Tensor | None

    @property
    def registered_is_unsharded_copy(self) -> bool:
        """True while the name resolves to an FSDP2 compute copy instead of the sharded master."""
        return self.registered is not self.master


def _fsdp_params_by_slot(model: nn.Module) -> dict[tuple[int, str], object]:
    """FSDP2's ``FSDPParam`` records keyed by (id(owning module), leaf name), shared uses included."""
    from torch.distributed.fsdp import FSDPModule

    slots: dict[tuple[int, str], object] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                slots[(id(info.module), info.param_name)] = fsdp_param
                for shared, leaf in zip(info.shared_modules, info.shared_param_names, strict=True):
                    slots[(id(shared), leaf)] = fsdp_param
    return slots


def model_parameters(model: nn.Module) -> dict[str, ModelParameter]:
    """Every parameter of ``model`` by its qualified name (first name of a shared parameter wins)."""
    fsdp_slots = _fsdp_params_by_slot(model)
    found: dict[str, ModelParameter] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for leaf, registered in module._parameters.items():
            if registered is None:
                continue
            fsdp_param = fsdp_slots.get((id(module), leaf))
            master = registered if fsdp_param is None else fsdp_param.sharded_param
            if id(master) in seen:
                continue
            seen.add(id(master))
            name = f"{module_name}.{leaf}" if module_name else leaf
            unsharded = None if fsdp_param is None else getattr(fsdp_param, "_unsharded_param", None)
            found[name] = ModelParameter(name, type(module).__name__, master, registered, unsharded)
    return found


def resharded_fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` whose parameters are all sharded now (to reshard them
    again after a forward that a check runs)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    modules = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if all(p.sharded_state == ShardedState.SHARDED for group in groups for p in group.fsdp_params):
                modules.append(module)
    return modules

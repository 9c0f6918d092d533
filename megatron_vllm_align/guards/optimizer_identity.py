"""Check that the optimizer steps exactly the parameters the model trains, by identity.

Names are not identity: a module swapped in after the optimizer was built has parameters of
the same names that the optimizer never sees, and under FSDP2 a name can resolve to an
all-gathered compute copy instead of the sharded master (see :mod:`.parameters`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from megatron_vllm_align.guards.optimizer_slots import (
    OptimizerSlot,
    optimizer_slots,
    parameters_by_tensor,
    slot_of,
    slots_by_tensor,
)
from megatron_vllm_align.guards.parameters import ModelParameter, model_parameters, resharded_fsdp_modules

NOT_IN_OPTIMIZER = "not_in_optimizer"
UNSHARDED_COPY_IN_OPTIMIZER = "fsdp_unsharded_copy_in_optimizer"
UNSHARDED_COPY_REGISTERED = "fsdp_unsharded_copy_registered"
NOT_A_MODEL_PARAMETER = "not_a_model_parameter"


@dataclass(frozen=True)
class IdentityFinding:
    """One problem: ``name`` (a parameter name, or the optimizer slot for a tensor the model
    does not have), ``kind`` (one of the module constants) and a sentence saying why."""

    name: str
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: [{self.kind}] {self.reason}"


def _leaves_reached(output: Any) -> set[int]:
    """ids of the leaf tensors that the autograd graph of ``output`` accumulates gradients into."""
    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    leaves = {id(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad}
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return leaves


def _used_in_forward(model: nn.Module, forward: Callable[[], Any], params: dict[str, ModelParameter]) -> set[str]:
    """Names of the parameters the graph of ``forward()`` reaches; FSDP2 modules that were
    resharded before are resharded again afterwards."""
    resharded = resharded_fsdp_modules(model)
    try:
        with torch.enable_grad():
            leaves = _leaves_reached(forward())
    finally:
        for module in resharded:
            module.reshard()
    return {name for name, p in params.items()
            if any(t is not None and id(t) in leaves for t in (p.master, p.registered, p.unsharded))}


def check_optimizer_identity(model: nn.Module, optimizer: object,
                             forward: Callable[[], Any] | None = None) -> list[IdentityFinding]:
    """Findings (empty when all is well) about the optimizer's parameters versus the model's.

    Reported: a parameter that requires grad (and, if ``forward`` is given, that the autograd
    graph of ``forward()`` reaches) but is in no optimizer slot by identity (Megatron's
    ``main_param`` counts as the parameter); an optimizer slot holding an FSDP2 unsharded
    compute copy; a name that currently resolves to such a copy (the module is not resharded);
    an optimizer tensor that is no parameter of the model. Under FSDP2 with ``forward`` every
    rank must call this together (the forward all-gathers).
    """
    params = model_parameters(model)
    by_slot_tensor = slots_by_tensor(optimizer)
    findings = [IdentityFinding(name, UNSHARDED_COPY_REGISTERED,
                                "the model registers FSDP2's unsharded compute copy under this name (the module "
                                "was not resharded, e.g. after a forward-only pass): reading or perturbing it "
                                "by name misses the sharded master the optimizer steps; call reshard() first")
                for name, p in params.items() if p.registered_is_unsharded_copy]
    copies = {id(t): p for p in params.values() for t in (p.unsharded, p.registered)
              if t is not None and t is not p.master}
    slots = optimizer_slots(optimizer)
    for slot in slots:
        if id(slot.tensor) in copies:
            findings.append(IdentityFinding(copies[id(slot.tensor)].name, UNSHARDED_COPY_IN_OPTIMIZER,
                                            f"{slot.where} holds FSDP2's unsharded compute copy, not the sharded "
                                            "DTensor master: its updates are lost at the next all-gather; build "
                                            "the optimizer while the model is resharded"))
    model_ids = parameters_by_tensor(params, optimizer)
    stale: list[OptimizerSlot] = [slot for slot in slots if id(slot.tensor) not in model_ids]
    used = _used_in_forward(model, forward, params) if forward is not None else set(params)
    for name, parameter in params.items():
        if not parameter.master.requires_grad or name not in used:
            continue
        if slot_of(parameter.master, by_slot_tensor) is not None:
            continue
        same_shape = [slot.where for slot in stale if slot.tensor.shape == parameter.master.shape]
        hint = (f"; the optimizer still steps a tensor of this shape that is no longer in the model "
                f"({', '.join(same_shape)}): was this {parameter.module_class} swapped in after the optimizer "
                "was built?") if same_shape else ""
        findings.append(IdentityFinding(name, NOT_IN_OPTIMIZER,
                                        f"requires grad{' and the forward uses it' if forward else ''}, but no "
                                        f"optimizer slot holds this tensor (module {parameter.module_class}){hint}"))
    findings += [IdentityFinding(slot.where, NOT_A_MODEL_PARAMETER,
                                 f"the optimizer steps a tensor of shape {list(slot.tensor.shape)} that is no "
                                 "parameter of the model (left over from a replaced module?)")
                 for slot in stale]
    return findings

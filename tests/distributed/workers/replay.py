"""Replay one optimizer step from saved parameters, optimizer state and given gradients."""
from __future__ import annotations

import copy

import torch
from torch import nn


class StepSnapshot:
    """Parameters (by name) and optimizer state just before a step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.state = copy.deepcopy(optimizer.state_dict())
        self.optimizer_class = type(optimizer)
        self.group_names = [[self.names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def replay(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Parameters after one step of a fresh optimizer with the saved state and ``grads``."""
        fresh = {n: nn.Parameter(t.clone()) for n, t in self.params.items()}
        groups = [{"params": [fresh[n] for n in names]} for names in self.group_names]
        optimizer = self.optimizer_class(groups)
        optimizer.load_state_dict(self.state)
        for name, param in fresh.items():
            param.grad = grads[name].clone()
        optimizer.step()
        return {n: p.detach() for n, p in fresh.items()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

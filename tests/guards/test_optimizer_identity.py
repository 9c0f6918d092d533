"""check_optimizer_identity in one process (FSDP2 and the vLLM replacement run under torchrun)."""
from __future__ import annotations

import torch
from torch import nn

from megatron_vllm_align.guards import check_optimizer_identity
from megatron_vllm_align.guards.optimizer_identity import NOT_A_MODEL_PARAMETER, NOT_IN_OPTIMIZER


class _WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.unused_head = nn.Linear(3, 2)  # registered, trainable, never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _x() -> torch.Tensor:
    return torch.randn(2, 3)


def test_clean_model_has_no_findings():
    model = _WithUnusedHead()
    assert check_optimizer_identity(model, torch.optim.AdamW(model.parameters())) == []
    assert check_optimizer_identity(model, torch.optim.AdamW(model.parameters()), forward=lambda: model(_x())) == []


def test_used_parameter_left_out_of_the_optimizer_is_named():
    model = _WithUnusedHead()
    optimizer = torch.optim.AdamW([model.body.weight, *model.unused_head.parameters()])
    findings = check_optimizer_identity(model, optimizer, forward=lambda: model(_x()))
    assert [(f.name, f.kind) for f in findings] == [("body.bias", NOT_IN_OPTIMIZER)]
    assert "forward uses it" in findings[0].reason and "module Linear" in findings[0].reason


def test_forward_decides_which_parameters_count():
    model = _WithUnusedHead()
    optimizer = torch.optim.AdamW(model.body.parameters())
    assert check_optimizer_identity(model, optimizer, forward=lambda: model(_x())) == []
    without_forward = check_optimizer_identity(model, optimizer)
    assert sorted(f.name for f in without_forward) == ["unused_head.bias", "unused_head.weight"]


def test_frozen_parameter_outside_the_optimizer_is_fine():
    model = _WithUnusedHead()
    model.body.bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([model.body.weight, *model.unused_head.parameters()])
    assert check_optimizer_identity(model, optimizer, forward=lambda: model(_x())) == []


def test_same_name_is_not_identity_after_a_swap():
    model = _WithUnusedHead()
    optimizer = torch.optim.AdamW(model.parameters())
    model.body = nn.Linear(3, 3)  # same names, new tensors
    findings = check_optimizer_identity(model, optimizer, forward=lambda: model(_x()))
    kinds = sorted((f.kind, f.name) for f in findings)
    assert kinds == [(NOT_A_MODEL_PARAMETER, "optimizer[0].param_groups[0][0]"),
                     (NOT_A_MODEL_PARAMETER, "optimizer[0].param_groups[0][1]"),
                     (NOT_IN_OPTIMIZER, "body.bias"), (NOT_IN_OPTIMIZER, "body.weight")]
    weight = next(f for f in findings if f.name == "body.weight")
    assert "optimizer[0].param_groups[0][0]" in weight.reason and "swapped in" in weight.reason

"""Finite-difference cross-check for smooth, non-quantized modules, in float64.

Do not use it on a quantized forward: finite differences of the rounding measure the discrete
forward, which an STE surrogate deliberately differs from (docs/method.md#layer-1-module-vjp).
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call


def gradcheck_module(module: nn.Module, inputs: Sequence[torch.Tensor], *, eps: float = 1e-6,
                     atol: float = 1e-6, rtol: float = 1e-4) -> bool:
    """torch.autograd.gradcheck of ``module`` w.r.t. its floating inputs and parameters in float64.

    The module is deep-copied and cast to float64, so its forward must have a float64 path (a
    native reference path). Raises torch.autograd.gradcheck.GradcheckError naming the
    mismatching input on failure; returns True on success.
    """
    mod64 = copy.deepcopy(module).to(torch.float64)
    names = [n for n, p in mod64.named_parameters() if p.requires_grad]
    params = [mod64.get_parameter(n).detach().clone().requires_grad_(True) for n in names]
    xs = [x.detach().to(torch.float64).requires_grad_(True) if x.is_floating_point() else x
          for x in inputs]
    n_in = len(xs)

    def fn(*args):
        out = functional_call(mod64, dict(zip(names, args[n_in:])), tuple(args[:n_in]))
        return out[0] if isinstance(out, tuple) else out

    return torch.autograd.gradcheck(fn, (*xs, *params), eps=eps, atol=atol, rtol=rtol)

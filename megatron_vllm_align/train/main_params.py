"""Mixed-precision optimizer: fp32 main copies of low-precision model parameters (docs/method.md#weight-values:
main fp32 -> master bf16 -> deployed).

:class:`MainParamsOptimizer` wraps a torch optimizer that steps one *stepped tensor* per model
parameter. For a model parameter whose dtype differs from ``main_dtype`` (bf16 under the
default float32 policy) the stepped tensor is an fp32 main copy, attached to the parameter as
``param.main_param`` (Megatron-Core's convention, which :mod:`megatron_vllm_align.guards`
follows); otherwise (fp32 parameters, or ``main_dtype=None``) the parameter itself is stepped.

One step, in order: :meth:`prepare_grads` copies each parameter's gradient into its main copy
(bf16 -> fp32; the caller clips these fp32 gradients), :meth:`step` runs the inner optimizer on
the stepped tensors (its step pre-hooks, e.g. a gradient dump, see the fp32 gradients), copies
every main copy back into its parameter (round to nearest even), then runs this wrapper's step
post-hooks (e.g. the deployed-value refresh), so they see the updated parameters. Updates
smaller than half a bf16 ulp accumulate in the main copy instead of being lost.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

MAIN_PARAMS_KEY = "main_params"

StepPostHook = Callable[[Any, tuple, dict], None]


class MainParamsOptimizer:
    """``make_inner(stepped_tensors)`` builds the torch optimizer over the stepped tensors (one per
    entry of ``params``, same order). ``main_dtype``: dtype of the main copies (None: no copies,
    every parameter is stepped directly). Exposes the inner optimizer as ``.optimizer``."""

    def __init__(self, params: Sequence[torch.Tensor],
                 make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 main_dtype: torch.dtype | None = torch.float32) -> None:
        self.params = list(params)
        self.main_dtype = main_dtype
        self.stepped: list[torch.Tensor] = []
        for param in self.params:
            if main_dtype is None or param.dtype == main_dtype:
                self.stepped.append(param)
                continue
            main = param.detach().to(main_dtype).requires_grad_(True)
            param.main_param = main
            self.stepped.append(main)
        self.optimizer = make_inner(self.stepped)
        self._post_hooks: OrderedDict[int, StepPostHook] = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def _copies(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(index, model parameter, main copy) for every parameter that has a main copy."""
        return [(i, p, m) for i, (p, m) in enumerate(zip(self.params, self.stepped)) if m is not p]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model parameters and of the main copies."""
        for tensor in self.params + [m for _, _, m in self._copies()]:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.zero_()

    @torch.no_grad()
    def prepare_grads(self) -> list[torch.Tensor | None]:
        """Copy each parameter's gradient into its main copy (a parameter without a gradient
        leaves its main copy's gradient None); returns the stepped tensors' gradients, in order."""
        for _, param, main in self._copies():
            main.grad = None if param.grad is None else param.grad.to(main.dtype)
        return [t.grad for t in self.stepped]

    @torch.no_grad()
    def step(self) -> None:
        """Step the inner optimizer on the stepped tensors, copy the main copies back into the
        model parameters, then run the step post-hooks. Call :meth:`prepare_grads` first."""
        self.optimizer.step()
        for _, param, main in self._copies():
            param.copy_(main)
        for hook in list(self._post_hooks.values()):
            hook(self, (), {})

    def register_step_post_hook(self, hook: StepPostHook) -> RemovableHandle:
        """``hook(self, args, kwargs)`` after every :meth:`step`, once the model parameters hold
        the new values (torch.optim's post-hook signature)."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"main_params"``: {parameter index: main copy}."""
        state = self.optimizer.state_dict()
        state[MAIN_PARAMS_KEY] = {i: main.detach().clone() for i, _, main in self._copies()}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the inner state and the main copies (in place, so the inner optimizer keeps
        holding them). ValueError naming the parameter index when the main copies do not fit."""
        state = dict(state)
        saved = state.pop(MAIN_PARAMS_KEY, {})
        copies = self._copies()
        wanted = {i for i, _, _ in copies}
        if set(saved) != wanted:
            raise ValueError(f"optimizer state: main_params holds parameter indices {sorted(saved)}, this optimizer "
                             f"keeps main copies of {sorted(wanted)} (main_params_dtype differs?)")
        for i, _, main in copies:
            if saved[i].shape != main.shape or saved[i].dtype != main.dtype:
                raise ValueError(f"optimizer state: main_params[{i}] is {tuple(saved[i].shape)} {saved[i].dtype}, "
                                 f"expected {tuple(main.shape)} {main.dtype}")
            main.copy_(saved[i])
        self.optimizer.load_state_dict(state)

"""The gated shared expert of a Qwen2-MoE block exactly as the vLLM engine runs it.

:class:`VllmSharedExpertKernel` builds vLLM's own ``Qwen2MoeMLP(expert_gate=shared_expert_gate)`` in the
engine's config context and loads the masters through its weight loaders and
``process_weights_after_loading``. All bf16 (u = 2^-8): ``gate_up = gate_up_proj(x)`` [M, 2F],
``act = SiluAndMul(gate_up)`` [M, F], ``down = down_proj(act)`` [M, H], ``gate_logit =
shared_expert_gate(x)`` [M, 1], ``out = sigmoid(gate_logit) * down`` (bf16 sigmoid, then a bf16
product). :meth:`VllmSharedExpertKernel.parts` runs the sub-layers in that order and returns every
intermediate (the backward needs them); ``kernel(x)`` is the layer's own forward (bitwise equal,
tested). Layouts: ``fc1_weight`` [2F, H] = [gate rows; up rows], ``fc2_weight`` [H, F], ``gate_weight``
[1, H]. The block adds it to the routed output in bf16: docs/moe_facts.md#structure-of-the-block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_vllm_align.ops.moe_router.kernel import check_positive_int, check_unquantized
from megatron_vllm_align.ops.vllm_context import VllmContext


@dataclass(frozen=True)
class SharedExpertParts:
    """The intermediates of one shared-expert forward, all in the model dtype (module docstring)."""

    gate_up: torch.Tensor
    act: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor
    out: torch.Tensor


class VllmSharedExpertKernel:
    """A shadow vLLM ``Qwen2MoeMLP`` with its sigmoid ``shared_expert_gate``; call :meth:`load` first."""

    def __init__(self, context: VllmContext, hidden_size: int, ffn_hidden_size: int, prefix: str = "") -> None:
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            check_positive_int(name, value)
        check_unquantized(context, "VllmSharedExpertKernel")
        self.context = context
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.prefix = prefix or "shared_expert"
        self.mlp: Any = None

    def load(self, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, gate_weight: torch.Tensor) -> None:
        """Rebuild the shadow from masters ``fc1_weight`` [2F, H], ``fc2_weight`` [H, F], ``gate_weight`` [1, H]."""
        from vllm.model_executor.layers.linear import ReplicatedLinear
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

        h, f = self.hidden_size, self.ffn_hidden_size
        for name, tensor, shape in (("fc1_weight", fc1_weight, (2 * f, h)), ("fc2_weight", fc2_weight, (h, f)),
                                    ("gate_weight", gate_weight, (1, h))):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must be a tensor of shape {shape}, got {tuple(getattr(tensor, 'shape', ()))}")
        dtype, config = self.context.model_dtype, self.context.vllm_config
        fc1, fc2, gate = (t.detach().to(dtype) for t in (fc1_weight, fc2_weight, gate_weight))
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            expert_gate = ReplicatedLinear(h, 1, bias=False, quant_config=None, prefix=f"{self.prefix}_gate")
            mlp = Qwen2MoeMLP(hidden_size=h, intermediate_size=f, hidden_act="silu", quant_config=None,
                              reduce_results=False, expert_gate=expert_gate, prefix=self.prefix)
            gate_up = mlp.gate_up_proj.weight
            gate_up.weight_loader(gate_up, fc1[:f], 0)
            gate_up.weight_loader(gate_up, fc1[f:], 1)
            mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, fc2)
            expert_gate.weight.weight_loader(expert_gate.weight, gate)
            process_weights_after_loading(mlp, config.model_config, torch.device(config.device_config.device))
        self.mlp = mlp

    def _check_input(self, x: torch.Tensor) -> None:
        if self.mlp is None:
            raise RuntimeError("the shared expert has no deployed weights yet: call load(...)")
        dtype = self.context.model_dtype
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            raise TypeError(f"x must be a {dtype} tensor (the engine's dtype), got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size or x.shape[0] == 0:
            raise ValueError(f"x must be [M >= 1, hidden_size={self.hidden_size}], got {tuple(x.shape)}")

    def parts(self, x: torch.Tensor) -> SharedExpertParts:
        """vLLM's shared-expert forward on ``x`` [M, H], step by step (module docstring)."""
        self._check_input(x)
        mlp = self.mlp
        with torch.no_grad(), self.context.active(parallel_state=True):
            x = x.detach()
            gate_up, _ = mlp.gate_up_proj(x)
            act = mlp.act_fn(gate_up)
            down, _ = mlp.down_proj(act)
            gate_logit = mlp.expert_gate(x)[0]
            return SharedExpertParts(gate_up, act, down, gate_logit, F.sigmoid(gate_logit) * down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """vLLM's ``Qwen2MoeMLP.forward(x)`` [M, H]."""
        self._check_input(x)
        with torch.no_grad(), self.context.active(parallel_state=True):
            return self.mlp(x.detach())


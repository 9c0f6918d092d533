"""The MoE router exactly as the vLLM engine runs it (softmax top-k routing: Qwen3-MoE, Qwen2-MoE,
Mixtral), and its native reference.

:class:`VllmRouterKernel` runs vLLM's own pieces, built in the engine's config context: the gate GEMM
(vLLM's ``GateLinear``, bf16 logits [M, E]; master loaded and processed as vLLM's model loader does,
rebuilt by :meth:`VllmRouterKernel.load`) and the selection of the router ``create_fused_moe_router``
makes for the platform (on CPU ``CPURouter``): top-k of the bf16 logits, then with ``renormalize`` (HF
``norm_topk_prob``) a bf16 softmax of the k selected logits, without it ``exp(selected - logsumexp)`` in
bf16; weights fp32 [M, k] (carrying those bf16 roundings), IDs int32 [M, k].
:meth:`VllmRouterKernel.weights_at` is the same weight formula at given IDs (router replay; with vLLM's
own IDs bitwise vLLM's weights, tested). Native reference :func:`router_native`: top-k of the logits,
weights in fp32. Bound with the same IDs, elementwise (u = 2^-8, first order): with ``renormalize``
``|visible - native| <= u |native|``; without, ``<= u (1 + |lse| + |l - lse|) |native|``. What vLLM
runs on CPU, measured: docs/moe_facts.md#router-cpurouter-made-by-create_fused_moe_router-on-cpu.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.vllm_context import VllmContext


def check_positive_int(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an int >= 1 (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_unquantized(context: VllmContext, what: str) -> None:
    """The MoE kernels here cover unquantized engines only (FP8 experts are another contract)."""
    if context.quant_config is not None:
        raise ValueError(f"{what} supports unquantized engines only; {context.spec} has quantization "
                         f"{context.spec.quantization!r}")


class VllmRouterKernel:
    """vLLM's gate GEMM and CPU router for ``num_experts`` experts, ``top_k`` per token; call
    :meth:`load` first. Tensors never require grad; the kernel is a plain attribute of its owner."""

    def __init__(self, context: VllmContext, hidden_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True, prefix: str = "") -> None:
        from vllm.model_executor.layers.fused_moe.router.router_factory import (
            create_fused_moe_router,
        )

        for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k)):
            check_positive_int(name, value)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must not exceed num_experts={num_experts}")
        check_unquantized(context, "VllmRouterKernel")
        self.context = context
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.renormalize = bool(renormalize)
        self.prefix = prefix
        with context.active(building=True):
            self.router: Any = create_fused_moe_router(top_k=top_k, global_num_experts=num_experts,
                                                       renormalize=self.renormalize, scoring_func="softmax")
        self.gate: Any = None

    def load(self, weight: torch.Tensor) -> None:
        """Rebuild the gate from master ``weight`` [num_experts, hidden_size], cast to the model dtype."""
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        expected = (self.num_experts, self.hidden_size)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != expected:
            raise ValueError(f"router weight must be a tensor of shape {expected}, got "
                             f"{tuple(getattr(weight, 'shape', ()))}")
        config = self.context.vllm_config
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            gate = GateLinear(self.hidden_size, self.num_experts, bias=False, quant_config=None,
                              prefix=f"{self.prefix}.gate" if self.prefix else "gate")
            gate.weight.weight_loader(gate.weight, weight.detach().to(self.context.model_dtype))
            process_weights_after_loading(gate, config.model_config, torch.device(config.device_config.device))
        self.gate = gate

    def _check_input(self, x: torch.Tensor) -> None:
        if self.gate is None:
            raise RuntimeError("the router has no deployed gate weight yet: call load(weight)")
        dtype = self.context.model_dtype
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            raise TypeError(f"x must be a {dtype} tensor (the engine's dtype), got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size or x.shape[0] == 0:
            raise ValueError(f"x must be [M >= 1, hidden_size={self.hidden_size}], got {tuple(x.shape)}")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [M, num_experts] in the model dtype from vLLM's gate GEMM."""
        self._check_input(x)
        with torch.no_grad(), self.context.active(parallel_state=True):
            logits, _ = self.gate(x.detach())
        return logits

    def select(self, x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's choice: ``(topk_weights [M, k] fp32, topk_ids [M, k] int32)``."""
        self._check_input(x)
        with torch.no_grad(), self.context.active(parallel_state=True):
            return self.router.select_experts(hidden_states=x.detach(), router_logits=logits.detach())

    def weights_at(self, logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The weights vLLM's CPU router gives the experts ``topk_ids`` [M, k] (router replay):
        the module docstring's formula on the bf16 logits, cast to fp32, contiguous."""
        with torch.no_grad():
            selected = logits.gather(1, topk_ids.long())
            if self.renormalize:
                weights = torch.softmax(selected, dim=-1)
            else:
                weights = (selected - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
            return weights.to(torch.float32).contiguous()


def router_native(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing in fp32: ``(weights [M, k] fp32, ids [M, k] int32)`` from the top-k of
    ``logits``; softmax over the k selected (``renormalize``) or over all experts, one fp32 pass."""
    values, ids = logits.float().topk(top_k, dim=-1)
    if renormalize:
        weights = torch.softmax(values, dim=-1)
    else:
        weights = (values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp()
    return weights, ids.to(torch.int32)

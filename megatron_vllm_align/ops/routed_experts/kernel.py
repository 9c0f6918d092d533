"""Routed experts exactly as the vLLM engine runs them (unquantized, SwiGLU), and their native reference.

:class:`VllmRoutedExpertsKernel` builds vLLM's own MoE layer with ``FusedMoEFactory`` (what
Qwen3-MoE / Qwen2-MoE / Mixtral build) in the engine's config context, loads the master expert
weights through the layer's weight loader, lets vLLM's ``process_weights_after_loading`` prepare them
and calls ``RoutedExperts.forward_modular(x, topk_weights, topk_ids)``, what the engine's ``MoERunner``
runs after its router. The processed layer is the *deployed value*; :meth:`VllmRoutedExpertsKernel.load`
rebuilds it from a new master (and requests Linux's AMX tile-data permission, which vLLM's kernel does
not). Layouts: ``fc1_weight`` [E, 2F, H] = per expert [gate rows; up rows], ``fc2_weight`` [E, H, F];
``topk_ids`` [M, k] int32 distinct per token, ``topk_weights`` [M, k] fp32; vLLM refuses a hidden size
not a multiple of 32. Native reference :func:`routed_experts_native`: FC1, SiLU-and-mul, FC2 and the
weighted sum in fp32 with the kernel's two roundings (:mod:`megatron_vllm_align.ops.cpu_cast`); bound
(:func:`routed_experts_bound`): ``|visible - native| <= 2u|native| + 2u sum_k w_k (|W2_e| |a_e|)``.
vLLM's backend choice, padding, AMX permission and measured replays:
docs/moe_facts.md#routed-experts-unquantizedfusedmoemethod.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from megatron_vllm_align.ops.cpu_cast import cast_like_cpu_kernel
from megatron_vllm_align.ops.moe_router.kernel import check_positive_int, check_unquantized
from megatron_vllm_align.ops.silu_and_mul.kernel import silu_and_mul_native
from megatron_vllm_align.ops.vllm_context import VllmContext
from megatron_vllm_align.utils.amx import request_amx_permission

_SHADOW_NAMES = itertools.count()


def check_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, tokens: int, top_k: int,
                  num_experts: int) -> None:
    """Raise a clear error unless ``topk_weights`` [tokens, top_k] is floating and ``topk_ids``
    [tokens, top_k] holds integer IDs in [0, num_experts)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {getattr(topk_ids, 'dtype', type(topk_ids))}")
    if tuple(topk_ids.shape) != (tokens, top_k):
        raise ValueError(f"topk_ids must have shape {(tokens, top_k)} (tokens, top_k), got {tuple(topk_ids.shape)}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}); got values in "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point:
        raise TypeError("topk_weights must be a floating tensor, "
                        f"got {getattr(topk_weights, 'dtype', type(topk_weights))}")
    if tuple(topk_weights.shape) != (tokens, top_k):
        raise ValueError(f"topk_weights must have shape {(tokens, top_k)}, got {tuple(topk_weights.shape)}")


class VllmRoutedExpertsKernel:
    """A shadow vLLM MoE layer (``MoERunner``) for ``num_experts`` SwiGLU experts; call :meth:`load`
    first. ``kernel(x [M, H], topk_weights [M, k], topk_ids [M, k]) -> [M, H]`` in the model dtype.

    ``prefix`` names the layer in vLLM's per-config registry of MoE layers; by default a unique
    name is made. ``renormalize`` only labels the routing method vLLM records for the layer.
    """

    def __init__(self, context: VllmContext, hidden_size: int, ffn_hidden_size: int, num_experts: int,
                 top_k: int, renormalize: bool = True, prefix: str = "") -> None:
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            check_positive_int(name, value)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must not exceed num_experts={num_experts}")
        check_unquantized(context, "VllmRoutedExpertsKernel")
        self.context = context
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize = bool(renormalize)
        self.prefix = prefix or f"megatron_vllm_align.moe_shadow_{next(_SHADOW_NAMES)}.experts"
        self.runner: Any = None

    def _release(self) -> None:
        """Drop this kernel's shadow from vLLM's registry of MoE layers (so its name can be reused
        and its prepacked weights freed)."""
        compilation = self.context.vllm_config.compilation_config
        if self.runner is not None and compilation.static_forward_context.get(self.prefix) is self.runner:
            del compilation.static_forward_context[self.prefix]
            compilation.static_all_moe_layers.remove(self.prefix)
        self.runner = None

    def __del__(self) -> None:
        if getattr(self, "runner", None) is not None:
            self._release()

    def load(self, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> None:
        """Rebuild the shadow from master ``fc1_weight`` [E, 2F, H] and ``fc2_weight`` [E, H, F]."""
        from vllm.model_executor.layers.fused_moe import FusedMoEFactory
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        e, h, f = self.num_experts, self.hidden_size, self.ffn_hidden_size
        for name, tensor, shape in (("fc1_weight", fc1_weight, (e, 2 * f, h)), ("fc2_weight", fc2_weight, (e, h, f))):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must be a tensor of shape {shape}, got {tuple(getattr(tensor, 'shape', ()))}")
        self._release()
        if self.prefix in self.context.vllm_config.compilation_config.static_forward_context:
            raise ValueError(f"prefix {self.prefix!r} already names another vLLM layer in this context")
        dtype = self.context.model_dtype
        config = self.context.vllm_config
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            try:
                runner = FusedMoEFactory(num_experts=e, top_k=self.top_k, hidden_size=h, intermediate_size=f,
                                         params_dtype=dtype, renormalize=self.renormalize, prefix=self.prefix)
            except NotImplementedError as exc:
                raise ValueError(f"vLLM has no MoE kernel for hidden_size={h}, ffn_hidden_size={f}, num_experts={e}, "
                                 f"top_k={self.top_k} ({exc}); on CPU its kernels need hidden_size divisible by 32"
                                 ) from exc
            experts = runner.routed_experts
            fc1, fc2 = fc1_weight.detach().to(dtype), fc2_weight.detach().to(dtype)
            for expert in range(e):
                experts.weight_loader(experts.w13_weight, fc1[expert, :f], "w13_weight",
                                      shard_id="w1", expert_id=expert)
                experts.weight_loader(experts.w13_weight, fc1[expert, f:], "w13_weight",
                                      shard_id="w3", expert_id=expert)
                experts.weight_loader(experts.w2_weight, fc2[expert], "w2_weight", shard_id="w2", expert_id=expert)
            process_weights_after_loading(runner, config.model_config, torch.device(config.device_config.device))
        self.runner = runner
        if getattr(self.fused_experts, "isa", None) == "amx":
            request_amx_permission()

    def _check_loaded(self) -> None:
        if self.runner is None:
            raise RuntimeError("the shadow vLLM MoE layer has no deployed value yet: call load(fc1_weight, fc2_weight)")

    @property
    def fused_experts(self) -> Any:
        """vLLM's experts implementation object of the loaded shadow (e.g. X86CPUUnquantizedExperts)."""
        self._check_loaded()
        return self.runner.routed_experts.quant_method.moe_kernel.fused_experts

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        self._check_loaded()
        dtype = self.context.model_dtype
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            raise TypeError(f"x must be a {dtype} tensor (the engine's dtype), got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size or x.shape[0] == 0:
            raise ValueError(f"x must be [M >= 1, hidden_size={self.hidden_size}], got {tuple(x.shape)}")
        check_routing(topk_weights, topk_ids, x.shape[0], self.top_k, self.num_experts)
        # The CPU kernel reads routing tensors as contiguous fp32 / int32 buffers, ignoring strides.
        weights = topk_weights.detach().to(torch.float32).contiguous()
        ids = topk_ids.detach().to(torch.int32).contiguous()
        routed = self.runner.routed_experts
        with torch.no_grad(), self.context.active(parallel_state=True):
            routed._ensure_moe_quant_config_init()
            return routed.forward_modular(x=x.detach().contiguous(), topk_weights=weights, topk_ids=ids)


def _expert_activations(x: torch.Tensor, fc1_weight: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul of FC1 per token and slot: [M, k, F] fp32 values rounded to x's dtype."""
    gate_up = torch.einsum("mh,mkfh->mkf", x.float(), fc1_weight[topk_ids.long()].float())
    return cast_like_cpu_kernel(silu_and_mul_native(gate_up), x.dtype).float()


def routed_experts_native(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference forward (module docstring): [M, H] in x's dtype. Gathers each slot's weights, so
    memory grows as M k 3 F H; meant for test shapes."""
    act = _expert_activations(x, fc1_weight, topk_ids)
    y = torch.einsum("mkf,mkhf->mkh", act, fc2_weight[topk_ids.long()].float())
    return cast_like_cpu_kernel((topk_weights.float().unsqueeze(-1) * y).sum(dim=1), x.dtype)


def routed_experts_bound(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Elementwise ``|visible - native|`` bound [M, H]: ``2u|native| + 2u sum_k w_k (|W2_e| |a_e|)``
    (each side's output rounding; one bf16 flip of any activation element, whose fp32 input
    differs only in accumulation order; fp32 accumulation errors are far below these terms)."""
    u = torch.finfo(x.dtype).eps / 2
    native = routed_experts_native(x, fc1_weight, fc2_weight, topk_weights, topk_ids).float()
    act = _expert_activations(x, fc1_weight, topk_ids)
    spread = torch.einsum("mkf,mkhf->mkh", act.abs(), fc2_weight[topk_ids.long()].float().abs())
    return 2 * u * native.abs() + 2 * u * (topk_weights.float().abs().unsqueeze(-1) * spread).sum(dim=1)

"""The MoE block of a vLLM-forward Megatron layer (the ``mlp`` slot of ``TransformerLayerSubmodules``).

:class:`VllmMoELayer` is vLLM's ``Qwen3MoeSparseMoeBlock`` (with a shared expert
``Qwen2MoeSparseMoeBlock``): the tokens of ``[s, b, H]`` flattened in ``(s, b)`` order (the engine's
order for the packed ``[1, T]`` step), the router (``moe_router``: gate GEMM, top-k, routing weights,
renormalised exactly when ``config.moe_router_pre_softmax`` is False), vLLM's fused routed experts
(``routed_experts``) and, with ``config.moe_shared_expert_intermediate_size`` (needs
``moe_shared_expert_gate``), the gated shared expert (``shared_expert``), added to the routed output in
bf16 as vLLM's ``MoERunner`` does. Parameters under ``decoder.layers.i.mlp``: ``router.weight`` [E, H],
``experts.fc1_weight`` [E, 2F, H] (per expert [gate; up]), ``experts.fc2_weight`` [E, H, F]; shared
``fc1_weight`` [2S, H], ``fc2_weight`` [H, S], ``gate_weight`` [1, H] (:func:`stack_expert_weights`
maps Megatron's local MoE names). Expert parallelism (EP > 1) follows the engine's
``enable_expert_parallel`` layout; a shared expert at EP > 1 is refused:
docs/megatron_facts.md#expert-parallelism-of-the-vllm-moe-block-megatronvllm_moepy. Router replay: each
forward records its expert IDs in ``recorded_ids`` ([s b, k] int32); :func:`router_replay` makes the
next forwards use given IDs, one tensor per MoE layer (:func:`moe_layers` order).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.module import MegatronModule

from megatron_vllm_align.ops.moe_router.module import VllmMoERouter
from megatron_vllm_align.ops.routed_experts.expert_map import local_routing
from megatron_vllm_align.ops.routed_experts.module import VllmRoutedExperts
from megatron_vllm_align.ops.shared_expert.module import VllmSharedExpert
from megatron_vllm_align.ops.vllm_context import VllmContext

_SHARED_EXPERT = re.compile(r"^(?P<mlp>.*\.mlp\.shared_experts)\.linear_fc(?P<fc>[12])\.weight$")
_LOCAL_EXPERT = re.compile(r"^(?P<mlp>.*\.mlp\.experts)\.local_experts\.(?P<e>\d+)\.linear_fc(?P<fc>[12])\.weight$")


class VllmMoELayer(MegatronModule):
    """``forward(hidden_states [s, b, H]) -> (out [s, b, H], None)``: vLLM's MoE block (module docstring).

    Reads ``num_moe_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``, ``moe_router_pre_softmax``,
    ``moe_shared_expert_intermediate_size`` / ``moe_shared_expert_gate`` and ``params_dtype`` from ``config``;
    ``vllm_context`` is the engine's (a spec param). ``replay_ids`` ([s b, k] integer or None) is used instead of the
    router's choice while set.
    """

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None, *,
                 vllm_context: VllmContext, **kwargs: Any) -> None:
        super().__init__(config=config)
        if not config.num_moe_experts:
            raise ValueError("VllmMoELayer needs TransformerConfig.num_moe_experts >= 1")
        if config.moe_shared_expert_intermediate_size and not config.moe_shared_expert_gate:
            raise ValueError("VllmMoELayer: a shared expert without moe_shared_expert_gate is not vLLM's Qwen2-MoE "
                             "block; only the gated shared expert is supported")
        self.expert_parallel = ExpertParallelism.of_config(config)
        renormalize = not config.moe_router_pre_softmax
        common = {"vllm_context": vllm_context, "params_dtype": config.params_dtype}
        self.router = VllmMoERouter(config.hidden_size, config.num_moe_experts, config.moe_router_topk,
                                    renormalize, **common)
        self.experts = VllmRoutedExperts(self.expert_parallel.local_experts, config.hidden_size,
                                         config.moe_ffn_hidden_size, config.moe_router_topk, renormalize, **common)
        self.expert_parallel.mark(self.experts)
        self.shared_experts = (VllmSharedExpert(config.hidden_size, config.moe_shared_expert_intermediate_size,
                                                **common) if config.moe_shared_expert_intermediate_size else None)
        self.layer_number = layer_number
        self.replay_ids: torch.Tensor | None = None
        self.recorded_ids: torch.Tensor | None = None

    def set_layer_number(self, layer_number: int) -> None:
        """Called by ``TransformerLayer`` (1-based layer number, used in error messages)."""
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        hidden = self.config.hidden_size
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden:
            raise ValueError(f"VllmMoELayer (layer {self.layer_number}): hidden_states must be [s, b, {hidden}], "
                             f"got {tuple(hidden_states.shape)}")
        tokens = hidden_states.reshape(-1, hidden)
        try:
            weights, ids, _ = self.router(tokens, replay_ids=self.replay_ids)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"MoE layer {self.layer_number}: {exc}") from exc
        self.recorded_ids = ids
        out = self.expert_parallel.run(self.experts, tokens, weights, ids)
        if self.shared_experts is not None:
            out = self.shared_experts(tokens) + out
        return out.view_as(hidden_states), None


@dataclasses.dataclass(frozen=True)
class ExpertParallelism:
    """The expert-parallel layout of a :class:`VllmMoELayer` (module docstring). ``size`` EP ranks in
    ``group`` (Megatron's expert-model-parallel group; None at EP = 1); ``local_experts`` E / EP;
    ``expert_map`` [E] int32 (vLLM's ``determine_expert_map``: the local index of each global expert, -1 for another
    rank's; None at EP = 1)."""

    size: int
    group: Any
    local_experts: int
    expert_map: torch.Tensor | None

    @classmethod
    def of_config(cls, config: Any) -> ExpertParallelism:
        """The layout ``config`` and Megatron's parallel state give; ValueError for one the engine does not run."""
        tp, ep = config.tensor_model_parallel_size or 1, config.expert_model_parallel_size or 1
        experts = config.num_moe_experts
        if (tp, ep) == (1, 1):
            return cls(1, None, experts, None)
        if ep != tp or (config.expert_tensor_parallel_size or 1) != 1 or config.sequence_parallel:
            raise ValueError(
                f"VllmMoELayer: tensor_model_parallel_size={tp}, expert_model_parallel_size={ep}, "
                f"expert_tensor_parallel_size={config.expert_tensor_parallel_size}, sequence_parallel="
                f"{config.sequence_parallel}: the vLLM expert forward runs the engine's expert-parallel layout only "
                "(enable_expert_parallel=True: expert_model_parallel_size = tensor_model_parallel_size, "
                "expert_tensor_parallel_size=1, no sequence parallel); vLLM's TP-sharded experts are not built")
        if config.moe_shared_expert_intermediate_size:
            raise ValueError("VllmMoELayer: a shared expert at expert_model_parallel_size > 1 is not built (the "
                             "engine runs it as a TP-sharded MLP whose partial output joins the experts' before "
                             "the all-reduce)")
        if experts % ep:
            raise ValueError(f"VllmMoELayer: num_moe_experts={experts} is not divisible by "
                             f"expert_model_parallel_size={ep}")
        group = parallel_state.get_expert_model_parallel_group()
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if torch.distributed.get_process_group_ranks(group) != torch.distributed.get_process_group_ranks(tp_group):
            raise ValueError("VllmMoELayer: the expert-parallel group must be the tensor-parallel group (the "
                             "engine reduces the experts' partial outputs over its TP group)")
        from vllm.model_executor.layers.fused_moe.expert_map_manager import (
            determine_expert_map,
        )

        local, expert_map, _ = determine_expert_map(ep, parallel_state.get_expert_model_parallel_rank(), experts)
        return cls(ep, group, local, expert_map)

    def mark(self, experts: VllmRoutedExperts) -> None:
        """At EP > 1, mark the expert weights expert-parallel (Megatron's ``allreduce = False``)."""
        if self.size > 1:
            for weight in (experts.fc1_weight, experts.fc2_weight):
                weight.allreduce = False

    def run(self, experts: VllmRoutedExperts, tokens: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
        """``experts`` on ``tokens`` routed by the global ``topk_ids``: the full output on every rank."""
        if self.size == 1:
            return experts(tokens, topk_weights, topk_ids)
        tokens = copy_to_tensor_model_parallel_region(tokens, group=self.group)
        topk_weights = copy_to_tensor_model_parallel_region(topk_weights, group=self.group)
        weights, local_ids = local_routing(topk_weights, topk_ids, self.expert_map)
        return reduce_from_tensor_model_parallel_region(experts(tokens, weights, local_ids), group=self.group)


def moe_layers(model: torch.nn.Module) -> list[VllmMoELayer]:
    """The model's :class:`VllmMoELayer` modules in module order (layer order of a GPTModel)."""
    return [module for module in model.modules() if isinstance(module, VllmMoELayer)]


def recorded_routing(model: torch.nn.Module) -> list[torch.Tensor]:
    """The expert IDs [tokens, k] int32 each MoE layer used in the model's last forward."""
    layers = moe_layers(model)
    missing = [layer.layer_number for layer in layers if layer.recorded_ids is None]
    if missing:
        raise RuntimeError(f"recorded_routing: MoE layers {missing} have not run a forward yet")
    return [layer.recorded_ids for layer in layers]


@contextlib.contextmanager
def router_replay(model: torch.nn.Module, topk_ids: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside the block, every forward of ``model`` routes MoE layer j by ``topk_ids[j]``
    ([tokens, k] integer, in :func:`moe_layers` order) instead of its router's choice; the
    layers check shape, range and distinctness when they run. Restores the router's own choice after."""
    layers = moe_layers(model)
    if len(topk_ids) != len(layers):
        raise ValueError(f"router_replay: got {len(topk_ids)} replay_ids tensors for {len(layers)} MoE layers")
    for layer, ids in zip(layers, topk_ids):
        layer.replay_ids = ids
    try:
        yield
    finally:
        for layer in layers:
            layer.replay_ids = None


def stack_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the per-expert weights of Megatron's local MoE spec
    (``...mlp.experts.local_experts.e.linear_fc{1,2}.weight``) stacked into :class:`VllmMoELayer`'s
    ``...mlp.experts.fc1_weight`` [E, 2F, H] / ``fc2_weight`` [E, H, F] and the shared expert's
    ``...mlp.shared_experts.linear_fc{1,2}.weight`` renamed ``...mlp.shared_experts.fc{1,2}_weight``
    (its ``gate_weight`` keeps its name); other entries unchanged.
    ValueError when a layer's expert indices are not 0..E-1."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _LOCAL_EXPERT.match(name)
        shared = _SHARED_EXPERT.match(name)
        if shared is not None:
            out[f"{shared['mlp']}.fc{shared['fc']}_weight"] = tensor
        elif match is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{match['mlp']}.fc{match['fc']}_weight", {})[int(match["e"])] = tensor
    for name, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(
                f"stack_expert_weights: {name} has experts {sorted(by_expert)}, not 0..{len(by_expert) - 1}")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out



_STACKED_EXPERTS = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.fc(?P<fc>[12])_weight$")
_STACKED_SHARED = re.compile(r"^(?P<mlp>.+\.mlp\.shared_experts)\.fc(?P<fc>[12])_weight$")


def unstack_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`stack_expert_weights`: the aligned MoE model's stacked names back to
    Megatron's local MoE spec (one tensor per expert, views of the stacked one); other entries unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        stacked, shared = _STACKED_EXPERTS.match(name), _STACKED_SHARED.match(name)
        if shared is not None:
            out[f"{shared['mlp']}.linear_fc{shared['fc']}.weight"] = tensor
        elif stacked is not None:
            for e, expert in enumerate(tensor):
                out[f"{stacked['mlp']}.experts.local_experts.{e}.linear_fc{stacked['fc']}.weight"] = expert
        else:
            out[name] = tensor
    return out

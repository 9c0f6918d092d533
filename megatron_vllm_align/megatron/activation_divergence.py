"""Where a trainer and a vLLM engine first compute different bits: forward hooks on both sides, op
by op, on one prefill of one sequence.

Tap points, in forward order (:func:`tap_points`): ``embedding``; per decoder layer i
``layer i attention (input_layernorm | qkv_proj | attn | o_proj)`` and ``layer i mlp
(post_attention_layernorm | gate_up_proj | act_fn | down_proj)`` (an MoE layer: ``layer i mlp``
as one block); ``final norm``. Each names the engine module (vLLM's Llama / Qwen module tree under
``LLM.apply_model``) and the Megatron module it corresponds to (the vLLM spec keeps the local spec's
names: ``linear_qkv`` emits vLLM's ``[q; k; v]`` rows, ``linear_fc1`` its ``[gate | up]``). A point
is compared on the first tensor of the module's output as ``[tokens, features]`` fp32 (a norm's
normalised output, a linear's output without its bias slot).

:func:`first_divergence` runs both on the same sequence and returns the first point whose output is
not bitwise equal, or None when every point agrees (then a logprob difference comes from the
output layer or from the engine's batch: a lone prefill matches, a batched decode need not).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

_ATTENTION_OPS = (("input_layernorm", "input_layernorm", "input_layernorm"),
                  ("qkv_proj", "self_attn.qkv_proj", "self_attention.linear_qkv"),
                  ("attn", "self_attn.attn", "self_attention.core_attention"),
                  ("o_proj", "self_attn.o_proj", "self_attention.linear_proj"))
_MLP_OPS = (("post_attention_layernorm", "post_attention_layernorm", "pre_mlp_layernorm"),
            ("gate_up_proj", "mlp.gate_up_proj", "mlp.linear_fc1"),
            ("act_fn", "mlp.act_fn", "mlp.activation_func"),
            ("down_proj", "mlp.down_proj", "mlp.linear_fc2"))


@dataclasses.dataclass(frozen=True)
class TapPoint:
    """One compared op: its ``name`` and the dotted module paths in the engine's model and the trainer's."""

    name: str
    engine: str
    trainer: str

    @property
    def block(self) -> str:
        """The block the op belongs to (``layer 1 attention``): the name without the op in brackets."""
        return self.name.split(" (")[0]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first point that differs, the largest |engine - trainer| there and how many of its
    ``elements`` differ (``differing``)."""

    point: TapPoint
    max_abs_diff: float
    differing: int
    elements: int

    def __str__(self) -> str:
        return (f"{self.point.name}: {self.differing} of {self.elements} values differ, "
                f"max |engine - trainer| {self.max_abs_diff:.3g}")


def tap_points(num_layers: int, moe_layers: Sequence[int] = ()) -> list[TapPoint]:
    """The points of a decoder with ``num_layers`` layers, ``moe_layers`` of them MoE (module docstring)."""
    points = [TapPoint("embedding", "model.embed_tokens", "embedding")]
    for i in range(num_layers):
        engine, trainer = f"model.layers.{i}.", f"decoder.layers.{i}."
        points += [TapPoint(f"layer {i} attention ({op})", engine + e, trainer + t) for op, e, t in _ATTENTION_OPS]
        if i in moe_layers:
            points += [TapPoint(f"layer {i} mlp ({_MLP_OPS[0][0]})", engine + _MLP_OPS[0][1], trainer + _MLP_OPS[0][2]),
                       TapPoint(f"layer {i} mlp", engine + "mlp", trainer + "mlp")]
        else:
            points += [TapPoint(f"layer {i} mlp ({op})", engine + e, trainer + t) for op, e, t in _MLP_OPS]
    return [*points, TapPoint("final norm", "model.norm", "decoder.final_layernorm")]


def _capture(store: dict[str, torch.Tensor], name: str) -> Callable:
    """A forward hook keeping the first tensor of a module's output as [tokens, features] (fp32 copy)."""
    def hook(module: nn.Module, args: tuple, output) -> None:
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        store[name] = tensor.detach().reshape(-1, tensor.shape[-1]).float().clone()
    return hook


def _hooked(root: nn.Module, paths: dict[str, str], store: dict[str, torch.Tensor]) -> list:
    """Hooks on ``root``'s module at each path (name -> dotted path); KeyError naming a missing one."""
    handles = []
    for name, path in paths.items():
        try:
            module = root.get_submodule(path)
        except AttributeError as error:
            for handle in handles:
                handle.remove()
            raise KeyError(f"tap point {name!r}: {type(root).__name__} has no module {path!r}") from error
        handles.append(module.register_forward_hook(_capture(store, name)))
    return handles


def engine_activations(llm, sequence: Sequence[int], points: Sequence[TapPoint]) -> dict[str, torch.Tensor]:
    """Each point's output in one engine prefill of ``sequence`` (prompt logprobs, one request)."""
    from megatron_vllm_align.engine.vllm_reference import prompt_logprobs

    captured: dict[str, torch.Tensor] = {}
    (handles,) = llm.apply_model(lambda model: _hooked(model, {p.name: p.engine for p in points}, captured))
    try:
        prompt_logprobs(llm, [list(sequence)])
    finally:
        for handle in handles:
            handle.remove()
    return captured


def trainer_activations(model: nn.Module, sequence: Sequence[int], points: Sequence[TapPoint],
                        routed_experts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each point's output in the GPTModel's forward of ``sequence`` (its MoE routers replaying
    ``routed_experts``, int [n - 1 or n, moe_layers, top_k], when given)."""
    from megatron_vllm_align.megatron.logprobs import replay_rows, token_logprobs
    from megatron_vllm_align.megatron.vllm_moe import router_replay

    captured: dict[str, torch.Tensor] = {}
    handles = _hooked(model, {p.name: p.trainer for p in points}, captured)
    try:
        with torch.no_grad():
            if routed_experts is None:
                token_logprobs(model, [list(sequence)])
            else:
                with router_replay(model, replay_rows(routed_experts, len(sequence), 0).unbind(1)):
                    token_logprobs(model, [list(sequence)])
    finally:
        for handle in handles:
            handle.remove()
    return captured


def model_tap_points(model: nn.Module) -> list[TapPoint]:
    """:func:`tap_points` of a GPTModel (its MoE layers are those whose ``mlp`` has a router)."""
    layers = model.decoder.layers
    return tap_points(len(layers), [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "router")])


def first_divergence(llm, model: nn.Module, sequence: Sequence[int],
                     routed_experts: torch.Tensor | None = None) -> Divergence | None:
    """The first tap point (forward order) whose output differs between the engine ``llm`` and the
    trainer ``model`` on ``sequence``; None when all agree (module docstring). ValueError when a
    point's module did not run on one side or its outputs have different shapes."""
    points = model_tap_points(model)
    engine = engine_activations(llm, sequence, points)
    return first_differing(points, engine, trainer_activations(model, sequence, points, routed_experts))


def first_differing(points: Sequence[TapPoint], engine: dict[str, torch.Tensor],
                    trainer: dict[str, torch.Tensor]) -> Divergence | None:
    """The first of ``points`` whose captured ``engine`` and ``trainer`` outputs are not bitwise equal
    (None: all equal); ValueError when a point is missing on one side or the shapes differ. For an
    engine in another process: its side captured there, compared here."""
    for point in points:
        ours, theirs = trainer.get(point.name), engine.get(point.name)
        if ours is None or theirs is None or ours.shape != theirs.shape:
            shapes = [None if t is None else tuple(t.shape) for t in (theirs, ours)]
            raise ValueError(f"tap point {point.name!r} cannot be compared: engine output {shapes[0]}, trainer "
                             f"output {shapes[1]} (None: the module did not run)")
        if not torch.equal(ours, theirs):
            diff = (ours.double() - theirs.double()).abs()
            return Divergence(point, float(diff.max()), int((diff > 0).sum()), diff.numel())
    return None

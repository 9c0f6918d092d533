"""Row-invariant fused experts: vLLM's CPU grouped-GEMM experts, measured per shape like the linears.

vLLM's CPU fused experts run one GEMM per expert over the tokens routed to it, so each expert's row
count is set by the whole batch's routing and a token's bits could depend on its neighbours. At the
first call of a shape under ``MVA_INVARIANT=1``, :func:`probe_expert_rule` runs the experts' own
``apply`` on a fixed random batch of tokens with fixed random routing and on slices of it (the probe
calls of :mod:`.row_tiles`): where every slice's tokens equal the batch's bitwise the call runs as it
is; otherwise every token runs in a call of its own (each expert then sees one row whatever the batch),
and where even that differs the kernel is refused, naming it. Wraps ``CPUUnquantizedExperts.apply``
(and so its AMX subclass); rules per (class, weight shapes, dtype, top-k, threads): :func:`measured_rules`.
"""
from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable

import torch

from megatron_vllm_align.invariance import InvarianceUnsupported, requested
from megatron_vllm_align.invariance.row_tiles import cheapest_rule, probe_generator, probe_plan

_WRAPPED = "_mva_expert_rows"
# the apply arguments that hold one row per token
_PER_TOKEN = ("output", "hidden_states", "topk_weights", "topk_ids")


class ExpertRule(enum.Enum):
    """How a call's tokens reach the fused experts, cheapest first."""

    WHOLE = "whole call"
    ALONE = "one token per call"


def run_under_rule(rule: ExpertRule, call: Callable[..., None], arguments: dict) -> None:
    """``call(**arguments)`` (an ``apply`` writing ``arguments["output"]``) with its tokens passed as ``rule``
    says."""
    if rule is ExpertRule.WHOLE:
        call(**arguments)
        return
    for token in range(arguments["hidden_states"].shape[0]):
        call(**{**arguments, **{name: arguments[name][token:token + 1] for name in _PER_TOKEN}})


def probe_expert_rule(call: Callable[..., None], arguments: dict) -> tuple[ExpertRule, dict[ExpertRule, str]]:
    """The cheapest rule under which the experts give every probe token the same bits in every probe call
    as in the probe batch, and what each cheaper rule's probe saw; :class:`InvarianceUnsupported` when none
    holds. ``arguments``: a real call's ``apply`` arguments, whose weights, activation and workspaces the
    probe keeps; its tokens and routing (over the local experts, ``w1.shape[0]``) are the probe's own."""
    hidden, ids, weights = arguments["hidden_states"], arguments["topk_ids"], arguments["topk_weights"]
    experts, top_k = arguments["w1"].shape[0], ids.shape[1]
    plan = probe_plan(hidden.shape[1])
    count = plan[0]
    generator = probe_generator()
    tokens = torch.randn(count, hidden.shape[1], generator=generator).to(hidden.dtype)
    routing = torch.rand(count, experts, generator=generator).argsort(dim=1)[:, :top_k].to(ids.dtype)
    routing_weights = torch.rand(count, top_k, generator=generator).softmax(dim=1).to(weights.dtype)

    def rows(rule, start, stop):
        out = tokens.new_empty(stop - start, tokens.shape[1])
        run_under_rule(rule, call, {**arguments, "output": out, "hidden_states": tokens[start:stop],
                                    "topk_ids": routing[start:stop], "topk_weights": routing_weights[start:stop],
                                    "expert_map": None, "expert_tokens_meta": None})
        return out

    return cheapest_rule(ExpertRule, rows, plan, "these fused experts")


_rules: dict[tuple, ExpertRule] = {}


def measured_rules() -> dict[str, str]:
    """The rules measured in this process: ``"<class> w1 <shape> w2 <shape> <dtype> top-<k> <threads> threads"``
    -> rule."""
    return {f"{name} w1 {list(w1)} w2 {list(w2)} {str(dtype).removeprefix('torch.')} top-{k} {threads} threads":
            rule.value for (name, w1, w2, dtype, k, threads), rule in _rules.items()}


def expert_rows_apply(apply: Callable) -> Callable:
    """Wrap a fused experts' ``apply``: while invariance is requested, run it under its shape's measured
    :class:`ExpertRule`; otherwise call it unchanged."""
    if getattr(apply, _WRAPPED, False):
        return apply
    signature = inspect.signature(apply)

    @functools.wraps(apply)
    def wrapped(*args, **kwargs):
        if not requested():
            return apply(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        experts = arguments["self"]
        key = (type(experts).__name__, tuple(arguments["w1"].shape), tuple(arguments["w2"].shape),
               arguments["hidden_states"].dtype, arguments["topk_ids"].shape[1], torch.get_num_threads())
        rule = _rules.get(key)
        if rule is None:
            try:
                rule, _ = probe_expert_rule(apply, arguments)
            except InvarianceUnsupported as error:
                raise InvarianceUnsupported(f"{key[0]} (w1 {list(key[1])}, {key[3]}, top-{key[4]}) at {key[5]} "
                                            f"threads: {error}") from None
            _rules[key] = rule
        run_under_rule(rule, apply, arguments)

    setattr(wrapped, _WRAPPED, True)
    return wrapped


def install_expert_rows() -> None:
    """Wrap ``CPUUnquantizedExperts.apply`` in place (idempotent)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    CPUUnquantizedExperts.apply = expert_rows_apply(CPUUnquantizedExperts.apply)

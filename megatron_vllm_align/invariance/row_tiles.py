"""Row-invariant linear layers: vLLM's linear ``apply`` under a row rule measured for its kernel.

A GEMM library may pick its blocking, and so the order of the K-reduction, from the row count M; then a
row's bits depend on how many rows share its call (docs/invariance.md#where-the-engine-is-not-invariant).
Which M matter is a property of the kernel vLLM picked on this CPU (oneDNN, sgl, ``F.linear``), the shape
and the thread count, so it is measured, not assumed: at a layer's first call under ``MVA_INVARIANT=1``,
:func:`probe_row_rule` runs the layer's own ``apply`` on a fixed random batch and on slices of it and
picks the cheapest :class:`RowRule` under which every slice's rows equal the batch's rows bitwise. The
rule is kept per (method, K, N, dtype, bias, threads) in this process (:func:`measured_rules`); a kernel
no rule makes invariant is refused, naming it and what each rule's probe saw. Per-token FP8 activation
quantization is row-wise and keeps its bits under every rule.

Wrapped methods (every linear, LM-head and MoE-gate path of the covered models and quantizations):
``UnquantizedLinearMethod``, ``UnquantizedEmbeddingMethod`` (the LM head's GEMM),
``Fp8PtpcOnlineLinearMethod`` (``quantization="fp8_per_channel"``) and
``CompressedTensorsLinearMethod`` (compressed-tensors W8A8 checkpoints).
"""
from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable

import torch

from megatron_vllm_align.invariance import ROW_TILE, InvarianceUnsupported, requested

_WRAPPED = "_mva_row_tiled"

# EVEN_ROWS's least row count: oneDNN's bf16 GEMM without bf16 dot products (AVX512_CORE) computes M = 1, 2, 3
# and every odd M otherwise than even M >= 4 (docs/invariance.md#row-rules-per-isa).
EVEN_ROWS_MIN = 4
# LEAST_ROWS's row count: sgl's weight_packed_linear (AMX CPUs, weights <= 1 MiB) computes M <= 4 on another
# kernel than M >= 5, whose bits differ in about 1e-4 of the outputs (docs/invariance.md#row-rules-per-isa).
LEAST_ROWS_MIN = 5

# The probe: a batch of rows and calls on (rows, first row) slices of it. Row counts on both sides of the
# kernels' blockings (M = 1, 2, 3, 4 | 5, 8 | 9, 16 | 17, 32 | 33, 65), each from a first row that puts a row
# at other positions of a tile than in the batch (calls of one count follow each other from there).
PROBE_FIRST_ROW = {1: 0, 2: 48, 3: 1, 4: 4, 5: 2, 8: 8, 9: 1, 16: 0, 17: 7, 32: 32, 33: 1, 65: 3}
# At least 48 lone rows and 24 pairs: a lone row differs in only some rows where it differs at all.
PROBE_MIN_CALLS = {1: 48, 2: 24}
# Outputs compared per row count, at least (within PROBE_MAX_ROWS rows): two kernel paths can differ in as few
# as 1e-4 of their bf16 outputs, which 2^18 outputs show with probability 1 - e^-26.
PROBE_OUTPUTS = 1 << 18
PROBE_MAX_ROWS = 4096
# Methods probed with the least calls (PROBE_MIN_CALLS, one call of each other count): their CPU GEMM,
# torch._scaled_mm, can run on oneDNN's slow FP8 path, where 2^18 outputs would cost minutes
# (docs/invariance.md#row-rules-per-isa, docs/fp8_facts.md).
LEAST_CALLS_METHODS = ("Fp8PtpcOnlineLinearMethod", "CompressedTensorsLinearMethod")


def probe_generator() -> torch.Generator:
    """The probe's random inputs' generator (fixed seed: every process probes with the same rows)."""
    return torch.Generator().manual_seed(20261204)


@functools.cache
def probe_plan(outputs_per_row: int, outputs: int = PROBE_OUTPUTS) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The probe of a kernel with ``outputs_per_row`` outputs per row: (rows of its batch, its calls as
    (rows, first row)): for each :data:`PROBE_FIRST_ROW` count, consecutive calls enough to compare ``outputs``
    outputs, at least :data:`PROBE_MIN_CALLS`, all within :data:`PROBE_MAX_ROWS` rows."""
    if outputs_per_row < 1:
        raise ValueError(f"outputs_per_row must be >= 1, got {outputs_per_row}")
    calls = []
    for rows, first in PROBE_FIRST_ROW.items():
        wanted = max(PROBE_MIN_CALLS.get(rows, 1), -(-outputs // (rows * outputs_per_row)))
        calls += [(rows, first + i * rows) for i in range(min(wanted, (PROBE_MAX_ROWS - first) // rows))]
    return max(first + rows for rows, first in calls), tuple(calls)


class RowRule(enum.Enum):
    """How a call's rows reach the kernel, cheapest first for the small calls of decode (each rule but TILES
    makes one call, of at most 4 more rows)."""

    WHOLE = "whole call"            # the call as vLLM makes it
    PAIRED_LONE_ROW = "lone row paired"  # a one-row call gets a zero row beside it (M = 1 -> 2)
    EVEN_ROWS = f"even, at least {EVEN_ROWS_MIN} rows"  # zero rows up to an even M >= EVEN_ROWS_MIN (1 -> 4, 5 -> 6)
    LEAST_ROWS = f"at least {LEAST_ROWS_MIN} rows"  # zero rows up to M >= LEAST_ROWS_MIN (1 -> 5, 6 -> 6)
    TILES = f"tiles of {ROW_TILE} rows"  # every call as [ROW_TILE, K] blocks, the last zero-padded


def padded_count(rule: RowRule, count: int) -> int:
    """The row count of the one call a call of ``count`` rows becomes under ``rule`` (any rule but TILES):
    ``count`` plus the zero rows the rule adds."""
    if rule is RowRule.PAIRED_LONE_ROW and count == 1:
        return 2
    if rule is RowRule.EVEN_ROWS and count:
        return max(EVEN_ROWS_MIN, count + count % 2)
    if rule is RowRule.LEAST_ROWS and count:
        return max(LEAST_ROWS_MIN, count)
    return count


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 1:
        raise ValueError(f"x must have a row dimension, got a scalar of shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1])


def run_in_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     tile: int = ROW_TILE) -> torch.Tensor:
    """``fn`` applied to ``x [..., K]`` as calls on ``[tile, K]`` row blocks; returns ``[..., N]``.

    ``fn`` must map ``[tile, K] -> [tile, N]`` row by row. The last block is padded with zero rows,
    whose outputs are discarded. An empty ``x`` is passed through as one call."""
    rows = _as_rows(x)
    count = rows.shape[0]
    if count == 0:
        out = fn(rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    padding = (-count) % tile
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    outputs = [fn(rows[start:start + tile]) for start in range(0, rows.shape[0], tile)]
    out = torch.cat(outputs)[:count]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def run_under_rule(rule: RowRule, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for ``x [..., K] -> [..., N]`` with its rows passed to ``fn`` as ``rule`` says."""
    if rule is RowRule.TILES:
        return run_in_row_tiles(fn, x)
    rows = _as_rows(x)
    count = rows.shape[0]
    padding = padded_count(rule, count) - count
    if not padding:
        return fn(x)
    out = fn(torch.cat([rows, rows.new_zeros(padding, rows.shape[1])]))[:count]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def first_difference(call: Callable[[int, int], torch.Tensor], plan: tuple[int, tuple[tuple[int, int], ...]]
                     ) -> str | None:
    """Where ``call(start, stop)`` (the outputs of probe-batch rows ``start..stop-1`` computed in one call)
    first gives rows other bits than the whole batch in one call, ``plan`` a :func:`probe_plan`, in words; None
    when no probe call does."""
    batch, calls = plan
    reference = call(0, batch)
    for rows, start in calls:
        if not torch.equal(call(start, start + rows), reference[start:start + rows]):
            return f"a call of {rows} rows from row {start} gave them other bits than the batch"
    return None


def cheapest_rule(rules: type[enum.Enum], rows_under_rule: Callable[[enum.Enum, int, int], torch.Tensor],
                  plan: tuple[int, tuple[tuple[int, int], ...]], what: str) -> tuple[enum.Enum, dict[enum.Enum, str]]:
    """The first of ``rules`` under which ``rows_under_rule(rule, start, stop)`` (probe-batch rows
    ``start..stop-1`` computed in one call under ``rule``) passes :func:`first_difference`, and for each rule
    before it the call that differed. Raises :class:`InvarianceUnsupported` naming ``what`` and every rule's
    failing call when none passes."""
    failures = {}
    with torch.no_grad():
        for rule in rules:
            failure = first_difference(lambda start, stop: rows_under_rule(rule, start, stop), plan)
            if failure is None:
                return rule, failures
            failures[rule] = failure
    raise InvarianceUnsupported(f"no rule makes {what} row-invariant: " + "; ".join(
        f"{rule.value}: {failure}" for rule, failure in failures.items()))


def probe_row_rule(fn: Callable[[torch.Tensor], torch.Tensor], in_features: int, out_features: int,
                   dtype: torch.dtype, device: torch.device | str = "cpu", outputs: int = PROBE_OUTPUTS
                   ) -> tuple[RowRule, dict[RowRule, str]]:
    """The cheapest :class:`RowRule` under which ``fn``'s rows have the same bits in every probe call as in
    the probe batch (``probe_plan(out_features, outputs)``), and for each cheaper rule the first call that
    differed (:func:`cheapest_rule`)."""
    plan = probe_plan(out_features, outputs)
    batch = torch.randn(plan[0], in_features, generator=probe_generator()).to(dtype=dtype, device=device)
    return cheapest_rule(RowRule, lambda rule, start, stop: run_under_rule(rule, fn, batch[start:stop]), plan,
                         "this linear kernel")


# rule per (method class, K, N, dtype, bias, threads); per layer for layers that do not state N
_rules_by_shape: dict[tuple, RowRule] = {}
_rules_by_layer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measured_rules() -> dict[str, str]:
    """The rules measured in this process: ``"<method> K -> N <dtype> [bias] <threads> threads"`` -> rule."""
    return {f"{name} {k} -> {n} {str(dtype).removeprefix('torch.')}{' bias' if bias else ''} {threads} threads":
            rule.value for (name, k, n, dtype, bias, threads), rule in _rules_by_shape.items()}


def rule_for(method: object, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
             fn: Callable[[torch.Tensor], torch.Tensor]) -> RowRule:
    """The measured rule of ``layer``'s kernel for inputs like ``x`` (probed on the first call)."""
    threads = torch.get_num_threads()
    known = _rules_by_layer.get(layer)
    if known is not None and known[0] == threads:
        return known[1]
    out_features = getattr(layer, "output_size_per_partition", None) or getattr(layer, "output_size", None)
    key = (type(method).__name__, x.shape[-1], out_features, x.dtype, bias is not None, threads)
    rule = _rules_by_shape.get(key) if out_features is not None else None
    if rule is None:
        try:
            outputs = out_features or fn(x.new_zeros(1, x.shape[-1])).shape[-1]
            rule, _ = probe_row_rule(fn, x.shape[-1], outputs, x.dtype, x.device,
                                     0 if key[0] in LEAST_CALLS_METHODS else PROBE_OUTPUTS)
        except InvarianceUnsupported as error:
            raise InvarianceUnsupported(f"{type(method).__name__} [{x.shape[-1]} -> {out_features}] "
                                        f"{x.dtype} at {threads} threads: {error}") from None
        if out_features is not None:
            _rules_by_shape[key] = rule
    _rules_by_layer[layer] = (threads, rule)
    return rule


def row_tiled_apply(apply: Callable) -> Callable:
    """Wrap a vLLM quant method's ``apply(self, layer, x, bias=None)``: while invariance is requested,
    run it under the layer's measured :class:`RowRule`; otherwise call it unchanged."""
    if getattr(apply, _WRAPPED, False):
        return apply

    @functools.wraps(apply)
    def tiled(self, layer, x, bias=None):
        if not requested():
            return apply(self, layer, x, bias)

        def fn(rows):
            return apply(self, layer, rows, bias)

        return run_under_rule(rule_for(self, layer, x, bias, fn), fn, x)

    setattr(tiled, _WRAPPED, True)
    return tiled


def linear_method_classes() -> list[type]:
    """The vLLM quant-method classes whose ``apply`` is wrapped (module docstring)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod,
    )
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return [UnquantizedLinearMethod, UnquantizedEmbeddingMethod, Fp8PtpcOnlineLinearMethod,
            CompressedTensorsLinearMethod]


def install_row_tiles() -> None:
    """Wrap each class's ``apply`` in place (idempotent)."""
    for cls in linear_method_classes():
        cls.apply = row_tiled_apply(cls.apply)

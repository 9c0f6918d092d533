"""Gradient contracts rendered as Markdown for reports: one contract table, or a summary."""

from __future__ import annotations

from collections.abc import Iterable

from megatron_vllm_align.contracts.schema import STE, GradientContract, QuantizePosition

#: Row headers of the contract table (docs/method.md#gradient-contract), in order.
ROW_HEADERS = ("Visible forward", "Trainable variables", "Surrogate function", "Discrete state",
               "Backward", "Save/recompute", "Reference and acceptance")


def _cell(text: str) -> str:
    """One table cell: whitespace collapsed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _names(values: Iterable[str]) -> str:
    return ", ".join(values) or "none"


def _ste(ste: STE) -> str:
    if ste.kind != "clipped":
        return ste.kind
    return f"clipped at {ste.threshold:g} (derivative {ste.value_at_threshold:g} at the threshold)"


def _position(p: QuantizePosition, *, detail: bool) -> str:
    text = f"{p.tensor} {p.format} {p.scale_granularity}"
    if not detail:
        return text
    global_scale = ", fp32 per-tensor global scale" if p.global_scale != "none" else ""
    return (f"{text} ({p.role}; {p.scale_dtype} scale{global_scale}; {p.rounding}; "
            f"clamp {p.clamp}; {p.scale_rule})")


def _tolerances(contract: GradientContract, field: str | None = None) -> str:
    entries = contract.reference.tolerances.items()
    if field:
        return ", ".join(f"{name} {getattr(t, field):.10g}" for name, t in entries)
    return "; ".join(f"{name}: atol {t.atol:.10g}, rtol {t.rtol:.10g}, rel_l2 {t.rel_l2:.10g}"
                     for name, t in entries)


def _rows(c: GradientContract) -> tuple[str, ...]:
    vf, tr, su, ds, bw, sr, rf = (c.visible_forward, c.trainable, c.surrogate, c.discrete_state,
                                  c.backward, c.save_recompute, c.reference)
    quantize = "; ".join(_position(p, detail=True) for p in vf.quantize_positions) or "none"
    scales = ", ".join(f"{k} {v}" for k, v in tr.scales.items()) or "none (nothing quantized)"
    return (
        f"`{vf.kernel}`; {vf.input_dtype} -> {vf.output_dtype}; layout: {vf.layout}; "
        f"quantize: {quantize}; dequantize: {'; '.join(vf.dequantize_positions) or 'none'}; "
        f"accumulation {vf.accumulation}; output rounding {vf.output_rounding}",
        f"{_names(tr.variables)}; scales: {scales}",
        f"dX uses weight: {su.dx_weight}; X_ref for dW: {su.activation_ref}; "
        f"weight STE: {_ste(su.weight_ste)}; activation STE: {_ste(su.activation_ste)}",
        f"fixed: {_names(ds.fixed)}; continuous with gradient: "
        f"{_names(ds.continuous_with_gradient)}",
        f"{bw.kind}: {', else '.join(f'`{i}`' for i in bw.implementations)}; cast: {bw.cast}; "
        f"accumulation {bw.accumulation}; communication: {bw.communication}; "
        f"normalization: {bw.normalization}",
        f"save: {_names(sr.save)}; recompute: {sr.recompute}; memory: {sr.memory}",
        f"reference: {rf.implementation}; coverage: {'; '.join(rf.coverage)}; "
        f"metrics: {', '.join(rf.metrics)}; tolerances: {_tolerances(c)}; "
        f"reasoning: {rf.reasoning}",
    )


def contract_to_markdown(contract: GradientContract) -> str:
    """The contract as the seven-row table of docs/method.md#gradient-contract, under a heading with its case."""
    lines = [f"### `{contract.module_class}` (case {contract.case})", "",
             "| Item | Decision |", "|---|---|"]
    lines += [f"| {header} | {_cell(text)} |" for header, text in zip(ROW_HEADERS, _rows(contract))]
    if contract.notes.strip():
        lines += ["", f"Notes: {' '.join(contract.notes.split())}"]
    return "\n".join(lines) + "\n"


def contracts_table_markdown(contracts: Iterable[GradientContract]) -> str:
    """One summary row per module class with its key choices, for a report."""
    lines = ["| Module class | Case | Visible kernel | Quantized | dX weight | X_ref | "
             "Weight STE | Activation STE | Backward | rel_l2 bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in contracts:
        positions = c.visible_forward.quantize_positions
        quantized = "; ".join(_position(p, detail=False) for p in positions) or "none"
        cells = (f"`{c.module_class}`", c.case, f"`{c.visible_forward.kernel}`", quantized,
                 c.surrogate.dx_weight, c.surrogate.activation_ref, _ste(c.surrogate.weight_ste),
                 _ste(c.surrogate.activation_ste),
                 f"{c.backward.kind}: {', else '.join(c.backward.implementations)}",
                 _tolerances(c, "rel_l2"))
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"

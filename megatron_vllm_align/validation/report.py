"""Comparison reports: item-by-item checks that render to Markdown and to a dict."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_vllm_align.contracts import Tolerance

from .grad_metrics import GradMetrics

# Passing check statuses; every other status (missing, unexpected, unused, shape, non_finite,
# zero, tolerance, contract) is a failure.
OK = "ok"
DECLARED_UNUSED = "declared_unused"


@dataclass(frozen=True)
class Check:
    """One gradient (or update) of one item under one upstream-gradient kind."""

    item: str
    dy_kind: str
    status: str
    message: str = ""
    metrics: GradMetrics | None = None
    tolerance: Tolerance | None = None

    @property
    def passed(self) -> bool:
        return self.status in (OK, DECLARED_UNUSED)

    def line(self) -> str:
        return f"[{self.dy_kind}] {self.item}: {self.status}" + (f" - {self.message}" if self.message else "")

    def to_dict(self) -> dict:
        return {
            "item": self.item, "dy_kind": self.dy_kind, "status": self.status,
            "passed": self.passed, "message": self.message,
            "metrics": self.metrics.to_dict() if self.metrics else None,
            "tolerance": ({"atol": self.tolerance.atol, "rtol": self.tolerance.rtol,
                           "rel_l2": self.tolerance.rel_l2} if self.tolerance else None),
        }


@dataclass
class ComparisonReport:
    """All checks of one comparison (``kind`` is "vjp" or "one_step_update")."""

    name: str
    kind: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tolerance_reasoning: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[str]:
        return [f"{self.name}: {c.line()}" for c in self.checks if not c.passed]

    def raise_if_failed(self) -> "ComparisonReport":
        if not self.passed:
            detail = "\n".join(self.failures) or f"{self.name}: no checks ran"
            raise AssertionError(f"{self.kind} comparison failed:\n{detail}")
        return self

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "passed": self.passed,
                "failures": self.failures, "notes": list(self.notes),
                "tolerance_reasoning": self.tolerance_reasoning,
                "checks": [c.to_dict() for c in self.checks]}

    def to_markdown(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"### {self.name} ({self.kind}): {verdict}", "",
                 "| dY | item | status | max abs err | rel L2 | norm ratio | cosine | rel L2 tol |",
                 "|---|---|---|---|---|---|---|---|"]
        for c in self.checks:
            m, t = c.metrics, c.tolerance
            cells = [c.dy_kind, f"`{c.item}`", c.status,
                     _fmt(m.max_abs_err if m else None), _fmt(m.rel_l2 if m else None),
                     _fmt(m.norm_ratio if m else None), _fmt(m.cosine if m else None),
                     _fmt(t.rel_l2 if t else None)]
            lines.append("| " + " | ".join(cells) + " |")
        failing = [c for c in self.checks if not c.passed]
        if failing:
            lines += ["", "Failures:"] + [f"- {c.line()}" for c in failing]
        if self.tolerance_reasoning:
            lines += ["", f"Tolerance reasoning: {self.tolerance_reasoning}"]
        if self.notes:
            lines += ["", "Notes:"] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"

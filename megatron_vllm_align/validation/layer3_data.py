"""The layer-3 (proxy SFT, three arms) results the trainer writes as JSON, as typed data.

JSON layout (one object)::

    {"arms": {"under_test": [STEP, ...], "gradient_reference": [...], "native_baseline": [...]},
     "verdict": "pass" | "fail" | "inconclusive", "verdict_detail": "...",
     "window": {"first_step": 0, "last_step": 19, "acceptable_deviation": "..."},      # optional
     "localisation": {"first_divergent_step": 3 | null, "stage": "initial_loss" |
                      "one_step_update" | "later" | null, "checkpoint": "path" | null,
                      "detail": "..."},                                               # optional
     "arm_configs": {"under_test": {"setting": value, ...}, ...},                     # optional
     "comparison": [{"step": 1, ...}, ...]}                                           # optional

STEP: ``{"train_loss", "val_nll", "grad_norm", "update_rms", "clip_ratio", "non_finite",
"tokens_per_s"}`` plus optional ``"step"`` (optimizer step, default: list position) and
``"tokens"`` (cumulative effective tokens). Units: train_loss and val_nll in nats per token;
grad_norm the global L2 norm of the gradient before clipping; update_rms the RMS of the master
parameter change of the step; clip_ratio the factor gradient clipping multiplied the gradient
by (dimensionless, 1 = not clipped); non_finite a count of non-finite gradient elements (plus
one for a non-finite loss; the step is then skipped); tokens_per_s training throughput.
``comparison``: per-step figures of the under-test arm against the gradient reference (loss
difference, gradient / update relative L2 and cosine, per-parameter gradient relative L2), each
object with an integer ``"step"``. Unknown keys are errors (a typo must not silently drop a curve).
:func:`layer3_to_dict` is the inverse of :func:`layer3_from_dict` (the trainer writes its output).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ARMS: tuple[str, ...] = ("under_test", "gradient_reference", "native_baseline")
STEP_METRICS: tuple[str, ...] = ("train_loss", "val_nll", "grad_norm", "update_rms", "clip_ratio", "non_finite",
                                 "tokens_per_s")
VERDICTS: tuple[str, ...] = ("pass", "fail", "inconclusive")
STAGES: tuple[str, ...] = ("initial_loss", "one_step_update", "later")
TOP_LEVEL_KEYS: tuple[str, ...] = ("arms", "verdict", "verdict_detail", "window", "localisation", "arm_configs",
                                   "comparison")


class Layer3DataError(ValueError):
    """Bad layer-3 JSON; the message names the field."""


@dataclass(frozen=True)
class ArmStep:
    step: int
    train_loss: float
    val_nll: float
    grad_norm: float
    update_rms: float
    clip_ratio: float
    non_finite: int
    tokens_per_s: float
    tokens: int | None = None

    def metric(self, name: str) -> float:
        return float(getattr(self, name))


@dataclass(frozen=True)
class Localisation:
    first_divergent_step: int | None = None
    stage: str | None = None
    checkpoint: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class Layer3Run:
    arms: dict[str, tuple[ArmStep, ...]]
    verdict: str
    verdict_detail: str = ""
    window: dict[str, Any] = field(default_factory=dict)
    localisation: Localisation = Localisation()
    arm_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    comparison: tuple[dict[str, Any], ...] = ()

    def config_diff(self) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
        """(settings whose values differ across arms, with each arm's value; settings equal in all)."""
        keys = sorted({k for config in self.arm_configs.values() for k in config})
        differing, same = [], []
        for key in keys:
            values = {arm: self.arm_configs.get(arm, {}).get(key, "(absent)") for arm in ARMS}
            if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) == 1:
                same.append(key)
            else:
                differing.append((key, values))
        return differing, same


def _number(value: Any, where: str, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise Layer3DataError(f"{where} must be {'an integer' if integer else 'a number'}, got {value!r}")
    return value


def _step(raw: Any, where: str, position: int) -> ArmStep:
    if not isinstance(raw, Mapping):
        raise Layer3DataError(f"{where} must be an object, got {type(raw).__name__}")
    allowed = set(STEP_METRICS) | {"step", "tokens"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise Layer3DataError(f"{where}: unknown keys {unknown}; allowed {sorted(allowed)}")
    missing = [k for k in STEP_METRICS if k not in raw]
    if missing:
        raise Layer3DataError(f"{where}: missing keys {missing}")
    values = {k: _number(raw[k], f"{where}.{k}", integer=k == "non_finite") for k in STEP_METRICS}
    for k in ("train_loss", "val_nll", "grad_norm", "update_rms"):
        if not (math.isfinite(values[k]) or values["non_finite"] > 0):  # NaN/inf only with non-finite counted
            raise Layer3DataError(f"{where}.{k} is {values[k]} but non_finite is 0")
    step = _number(raw.get("step", position), f"{where}.step", integer=True)
    tokens = raw.get("tokens")
    if tokens is not None:
        tokens = _number(tokens, f"{where}.tokens", integer=True)
    return ArmStep(step=step, tokens=tokens, **values)


def layer3_from_dict(data: Any) -> Layer3Run:
    """``Layer3Run`` from the parsed JSON (module docstring); ``Layer3DataError`` names a bad field."""
    if not isinstance(data, Mapping):
        raise Layer3DataError(f"layer-3 data must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise Layer3DataError(f"layer-3 data: unknown keys {unknown}")
    arms_raw = data.get("arms")
    if not isinstance(arms_raw, Mapping) or sorted(arms_raw) != sorted(ARMS):
        raise Layer3DataError(f"arms must be an object with exactly the keys {list(ARMS)}, got "
                              f"{sorted(arms_raw) if isinstance(arms_raw, Mapping) else arms_raw!r}")
    arms = {}
    for arm in ARMS:
        steps = arms_raw[arm]
        if not isinstance(steps, list) or not steps:
            raise Layer3DataError(f"arms.{arm} must be a non-empty list of steps")
        arms[arm] = tuple(_step(s, f"arms.{arm}[{i}]", i) for i, s in enumerate(steps))
        numbers = [s.step for s in arms[arm]]
        if numbers != sorted(set(numbers)):
            raise Layer3DataError(f"arms.{arm}: steps must be strictly increasing, got {numbers}")
    verdict = data.get("verdict")
    if verdict not in VERDICTS:
        raise Layer3DataError(f"verdict must be one of {list(VERDICTS)}, got {verdict!r}")
    loc_raw = data.get("localisation") or {}
    if not isinstance(loc_raw, Mapping) or set(loc_raw) - {"first_divergent_step", "stage", "checkpoint", "detail"}:
        raise Layer3DataError(f"localisation: expected keys first_divergent_step, stage, checkpoint, detail; "
                              f"got {loc_raw!r}")
    if loc_raw.get("stage") not in (None, *STAGES):
        raise Layer3DataError(f"localisation.stage must be one of {list(STAGES)} or null, got {loc_raw['stage']!r}")
    configs = data.get("arm_configs") or {}
    if not isinstance(configs, Mapping) or set(configs) - set(ARMS) or \
            not all(isinstance(c, Mapping) for c in configs.values()):
        raise Layer3DataError(f"arm_configs must map arms {list(ARMS)} to objects")
    window = data.get("window") or {}
    if not isinstance(window, Mapping):
        raise Layer3DataError(f"window must be an object, got {window!r}")
    comparison = data.get("comparison") or []
    if not isinstance(comparison, list) or not all(
            isinstance(c, Mapping) and isinstance(c.get("step"), int) for c in comparison):
        raise Layer3DataError("comparison must be a list of objects, each with an integer step")
    return Layer3Run(arms=arms, verdict=verdict, verdict_detail=str(data.get("verdict_detail", "")),
                     window=dict(window), localisation=Localisation(**loc_raw),
                     arm_configs={k: dict(v) for k, v in configs.items()},
                     comparison=tuple(dict(c) for c in comparison))


def layer3_to_dict(run: Layer3Run) -> dict[str, Any]:
    """The JSON object of ``run`` (module docstring); ``layer3_from_dict`` of it equals ``run``."""
    return {"arms": {arm: [dataclasses.asdict(s) for s in run.arms[arm]] for arm in ARMS}, "verdict": run.verdict,
            "verdict_detail": run.verdict_detail, "window": dict(run.window),
            "localisation": dataclasses.asdict(run.localisation), "arm_configs": run.arm_configs,
            "comparison": list(run.comparison)}


def load_layer3(path: str | os.PathLike) -> Layer3Run:
    """``layer3_from_dict`` of the JSON file at ``path``."""
    with open(path, encoding="utf-8") as stream:
        try:
            data = json.load(stream)
        except json.JSONDecodeError as error:
            raise Layer3DataError(f"{path}: not valid JSON ({error})") from None
    return layer3_from_dict(data)

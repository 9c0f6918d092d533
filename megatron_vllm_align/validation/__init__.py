"""Backward validation. Layer 1: module VJP against an independent reference (``compare_vjp``),
one-step update comparison, finite-difference cross-check; bridges that build references. The data
models of layer 2 (:mod:`.layer2`) and layer 3 (:mod:`.layer3_data`, written by ``train.layer3``)."""
from megatron_vllm_align.ops.reference_bridge import VisibleWithSurrogate, visible_forward, visible_with_surrogate

from .grad_metrics import GradMetrics, grad_metrics
from .gradcheck import gradcheck_module
from .one_step import compare_one_step_update, default_optimizer
from .report import Check, ComparisonReport
from .tolerances import contract_tolerances, derive_tolerance, unit_roundoff
from .vjp import DY_KINDS, compare_vjp, make_dy

__all__ = [
    "Check", "ComparisonReport", "DY_KINDS", "GradMetrics", "VisibleWithSurrogate",
    "compare_one_step_update", "contract_tolerances", "compare_vjp", "default_optimizer", "derive_tolerance",
    "grad_metrics", "gradcheck_module", "make_dy", "unit_roundoff", "visible_forward",
    "visible_with_surrogate",
]

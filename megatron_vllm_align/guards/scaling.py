"""The factors applied to gradients before the optimizer uses them, recorded with every dump.

Megatron-Core (0.16.1) multiplies each gradient by a factor before its data-parallel
collective: with ``average_in_collective`` dense gradients by 1 and expert gradients by
``expert_dp_size / dp_size`` (then averaged over their groups); otherwise both by ``1 / dp_size``
(then summed). Its optimizer then divides by the loss scale and multiplies by the clip
coefficient ``min(1, clip_grad / (total_norm + 1e-6))``. A dump compared with another must
say which of these were already in the gradient; ``None`` means "not known".

Where the factors come from (see :func:`scaling_source`): an explicit :class:`GradientScaling`
(or a callable returning one), else the optimizer's own ``gradient_scaling()`` method, else, for
a Megatron-Core optimizer, a :class:`MegatronScalingProbe` that watches its ``step()``.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

MEGATRON_CLIP_EPS = 1.0e-6  # megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32


@dataclass(frozen=True)
class GradientScaling:
    """Factors already applied to the dumped gradients (None: unknown).

    dp_size / expert_dp_size: sizes of the data-parallel and expert-data-parallel groups.
    dense_grad_factor / expert_grad_factor: multiplied into the local gradient before its DP /
        expert-DP collective (Megatron's ``gradient_scaling_factor``).
    reduce_op: the collective's reduction, "avg" or "sum".
    loss_scale: the loss was multiplied by it; the gradient has been divided by it again.
    clip_coefficient: the gradient was multiplied by it (1.0: not clipped); grad_norm is the
        total norm it was computed from.
    source: where the figures came from ("explicit", "optimizer", "megatron", "unknown").
    """

    dp_size: int | None = None
    expert_dp_size: int | None = None
    dense_grad_factor: float | None = None
    expert_grad_factor: float | None = None
    reduce_op: str | None = None
    loss_scale: float | None = None
    clip_coefficient: float | None = None
    grad_norm: float | None = None
    source: str = "explicit"

    def factor_for(self, is_expert: bool) -> float | None:
        """The pre-collective factor applied to a dense or an expert gradient."""
        return self.expert_grad_factor if is_expert else self.dense_grad_factor

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradientScaling:
        """Inverse of :meth:`to_dict`; raises ValueError naming an unknown field."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"GradientScaling: unknown fields {unknown}")
        return cls(**data)


def megatron_clip_coefficient(clip_grad: float, grad_norm: float | None) -> float | None:
    """The factor Megatron's clipping multiplied into the gradients (1.0 when it did not clip)."""
    if clip_grad <= 0.0:
        return 1.0
    if grad_norm is None:
        return None
    return min(1.0, clip_grad / (grad_norm + MEGATRON_CLIP_EPS))


class MegatronScalingProbe:
    """Records the loss scale and grad norm of a Megatron-Core optimizer's ``step()`` as it runs.

    It wraps, on the optimizer instance, ``prepare_grads`` (the loss scale is read before it
    unscales and updates the scaler), ``clip_grad_norm`` and ``get_grad_norm`` (the total norm the
    clipping used). DP / expert-DP factors are read from the DDP model chunks the optimizer
    knows (``optimizer.model_chunks``: ``buffers`` / ``expert_parallel_buffers``). Written
    against megatron-core 0.16.1; needs CUDA, so it is not exercised on CPU.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._loss_scale: float | None = None
        self._grad_norm: float | None = None
        self._wrap("prepare_grads", self._before_prepare, None)
        self._wrap("clip_grad_norm", None, self._record_norm)
        self._wrap("get_grad_norm", None, self._record_norm)

    def _wrap(self, method_name: str, before: Callable[[], None] | None,
              after: Callable[[Any], None] | None) -> None:
        original = getattr(self.optimizer, method_name, None)
        if original is None:
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            result = original(*args, **kwargs)
            if after is not None:
                after(result)
            return result

        setattr(self.optimizer, method_name, wrapped)

    def _before_prepare(self) -> None:
        self._loss_scale = float(self.optimizer.get_loss_scale())
        self._grad_norm = None

    def _record_norm(self, norm: Any) -> None:
        self._grad_norm = None if norm is None else float(norm)

    def _ddp_factors(self) -> dict[str, Any]:
        chunks = getattr(self.optimizer, "model_chunks", None) or []
        for chunk in chunks:
            dense, expert = getattr(chunk, "buffers", None), getattr(chunk, "expert_parallel_buffers", None)
            if dense is None:
                continue
            config = getattr(chunk, "ddp_config", None)
            return {
                "dp_size": chunk.dp_cp_group.size(),
                "expert_dp_size": chunk.expt_dp_group.size() if expert else None,
                "dense_grad_factor": dense[0].gradient_scaling_factor if dense else None,
                "expert_grad_factor": expert[0].gradient_scaling_factor if expert else None,
                "reduce_op": None if config is None else ("avg" if config.average_in_collective else "sum"),
            }
        return {}

    def gradient_scaling(self) -> GradientScaling:
        config = getattr(self.optimizer, "config", None)
        clip_grad = getattr(config, "clip_grad", 0.0) or 0.0
        return GradientScaling(**self._ddp_factors(), loss_scale=self._loss_scale,
                               clip_coefficient=megatron_clip_coefficient(clip_grad, self._grad_norm),
                               grad_norm=self._grad_norm, source="megatron")


def _is_megatron_optimizer(optimizer: object) -> bool:
    """True for megatron-core's optimizers (never imports megatron: one in use is imported already)."""
    module = sys.modules.get("megatron.core.optimizer")
    return module is not None and isinstance(optimizer, (module.MegatronOptimizer, module.ChainedOptimizer))


ScalingArg = GradientScaling | Callable[[], GradientScaling] | None


def scaling_source(optimizer: object, scaling: ScalingArg = None) -> Callable[[], GradientScaling]:
    """A zero-argument function returning the :class:`GradientScaling` of the step being taken."""
    if isinstance(scaling, GradientScaling):
        return lambda: scaling
    if callable(scaling):
        return scaling
    if scaling is not None:
        raise TypeError(f"scaling must be a GradientScaling, a callable returning one, or None; "
                        f"got {type(scaling).__name__}")
    own = getattr(optimizer, "gradient_scaling", None)
    if callable(own):
        return own
    if _is_megatron_optimizer(optimizer):
        return MegatronScalingProbe(optimizer).gradient_scaling
    return lambda: GradientScaling(source="unknown")

"""TensorBoard gradient-contract panels: every tag comes from one pattern of ``PANELS``, which
``docs/panels.md`` lists (``panels_markdown()`` renders it; a test keeps the two equal).

TensorBoard groups scalars by the tag's first path component, so each layer-2 module class gets
its own panel group ``layer2.<module_class>``, with the layer index as the step. The three-arm
layer-3 curves share one chart per metric through the custom-scalars layout (``Multiline``
charts in category ``LAYER3_CATEGORY``). ``PanelWriter.written`` records every scalar as
``{tag: [(step, value), ...]}`` so callers can show the same numbers elsewhere.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from megatron_vllm_align.validation.layer2 import Layer2Result
from megatron_vllm_align.validation.layer3_data import ARMS, STEP_METRICS, Layer3Run
from megatron_vllm_align.validation.logprob_mismatch import LogprobMismatch

LAYER2_METRICS: tuple[str, ...] = ("cosine", "norm_ratio", "rel_l2", "feature_cosine", "sigma_ratio", "bc")
MISMATCH_METRICS: tuple[str, ...] = ("max_abs_delta_logprob", "mean_abs_delta_logprob", "token_mult_prob_error",
                                     "gen_kl_error", "k3_kl")
LAYER3_CATEGORY = "layer3: three arms"
RL_CATEGORY = "rl: on-policy"
RL_METRICS: tuple[str, ...] = ("reward_mean", "objective", "ratio_min", "ratio_mean", "ratio_max", "clipped_fraction")


@dataclass(frozen=True)
class Panel:
    """One tag pattern: ``{placeholders}`` are filled per run; ``step`` says what the x axis is."""

    pattern: str
    kind: str  # scalar | histogram | image
    step: str
    unit: str
    meaning: str
    written_by: str = "main job"  # which run writes it: "main job", "GRPO run" or both


PANELS: tuple[Panel, ...] = (
    Panel("layer2.{module_class}/{precision}/{gradient}/cosine", "scalar", "layer index", "1",
          "cos(alternative, default convention) of the whole gradient; gradient dX: dx_weight master vs "
          "dequantized, dW: activation_ref original vs quantized"),
    Panel("layer2.{module_class}/{precision}/{gradient}/norm_ratio", "scalar", "layer index", "1",
          "||alternative|| / ||default||"),
    Panel("layer2.{module_class}/{precision}/{gradient}/rel_l2", "scalar", "layer index", "1",
          "||alternative - default|| / ||default||"),
    Panel("layer2.{module_class}/{precision}/{gradient}/feature_cosine", "scalar", "layer index", "1",
          "median over input features of the per-feature cosine"),
    Panel("layer2.{module_class}/{precision}/{gradient}/sigma_ratio", "scalar", "layer index", "1",
          "RMS(alternative error) / RMS(default-convention bf16 error), both vs the float64 exact derivative"),
    Panel("layer2.{module_class}/{precision}/{gradient}/bc", "scalar", "layer index", "1 (0..1)",
          "Bhattacharyya coefficient of the two error distributions"),
    Panel("layer2.{module_class}/{precision}/{gradient}/flagged", "scalar", "layer index", "0/1",
          "1 where the outlier rule flagged the projection"),
    Panel("layer2.errors/{precision}/{gradient}/reference_error", "histogram", "0", "gradient units",
          "default convention minus the float64 exact derivative (bf16 noise floor), pooled over projections"),
    Panel("layer2.errors/{precision}/{gradient}/alternative_error", "histogram", "0", "gradient units",
          "alternative convention minus the float64 exact derivative, pooled over projections"),
    Panel("layer2.plots/{precision}/{gradient}/{plot}", "image", "0", "PNG",
          "plot = histogram | qq | scatter (the report's PNGs)"),
    Panel("mismatch/{trainer}/max_abs_delta_logprob", "scalar", "given step", "nats",
          "max |logprob trainer - logprob engine|",
          written_by="main job, GRPO run"),
    Panel("mismatch/{trainer}/mean_abs_delta_logprob", "scalar", "given step", "nats",
          "mean |logprob trainer - logprob engine|",
          written_by="main job, GRPO run"),
    Panel("mismatch/{trainer}/token_mult_prob_error", "scalar", "given step", "1",
          "mean exp(|delta logprob|); 1 when identical",
          written_by="main job, GRPO run"),
    Panel("mismatch/{trainer}/gen_kl_error", "scalar", "given step", "nats", "mean(logprob engine - logprob trainer)",
          written_by="main job, GRPO run"),
    Panel("mismatch/{trainer}/k3_kl", "scalar", "given step", "nats", "mean(exp(d) - d - 1), d = trainer - engine",
          written_by="main job, GRPO run"),
    Panel("rl/reward_mean", "scalar", "optimizer step", "reward", "mean reward of the step's rollouts",
          written_by="GRPO run"),
    Panel("rl/objective", "scalar", "optimizer step", "1", "the GRPO objective (clipped-ratio loss per sampled token)",
          written_by="GRPO run"),
    Panel("rl/ratio_min", "scalar", "optimizer step", "1", "min over sampled tokens of exp(lp trainer - lp engine)",
          written_by="GRPO run"),
    Panel("rl/ratio_mean", "scalar", "optimizer step", "1", "mean importance ratio over sampled tokens",
          written_by="GRPO run"),
    Panel("rl/ratio_max", "scalar", "optimizer step", "1", "max importance ratio over sampled tokens",
          written_by="GRPO run"),
    Panel("rl/clipped_fraction", "scalar", "optimizer step", "1", "share of sampled tokens where the clip is active",
          written_by="GRPO run"),
    Panel("layer3/train_loss/{arm}", "scalar", "optimizer step", "nats/token", "training loss"),
    Panel("layer3/val_nll/{arm}", "scalar", "optimizer step", "nats/token", "fixed validation set NLL"),
    Panel("layer3/grad_norm/{arm}", "scalar", "optimizer step", "gradient L2 norm", "global norm before clipping"),
    Panel("layer3/update_rms/{arm}", "scalar", "optimizer step", "parameter units", "RMS of the master update"),
    Panel("layer3/clip_ratio/{arm}", "scalar", "optimizer step", "1", "the trainer's clipping ratio"),
    Panel("layer3/non_finite/{arm}", "scalar", "optimizer step", "count", "non-finite gradient elements"),
    Panel("layer3/tokens_per_s/{arm}", "scalar", "optimizer step", "tokens/s", "training throughput"),
)


def panels_markdown() -> str:
    """docs/panels.md: every tag pattern, its kind, x axis, unit and meaning."""
    lines = ["# TensorBoard panels", "",
             "Written by `megatron_vllm_align.logging.PanelWriter`; generated from `PANELS` "
             "(`panels_markdown()`), and a test keeps this file equal to it.", "",
             "Placeholders: `{module_class}` = a quantized projection (`self_attn.q_proj` ... `mlp.down_proj`); "
             "`{precision}` = `fp8_per_channel`, `fp8_per_tensor`, `fp8_block128`; `{gradient}` = `dX` or `dW`; "
             "`{trainer}` = a trainer name of the forward comparison (prompt logprobs), with the suffix `_sampled` for sampled-token logprobs (decode), or `rl_aligned` / `rl_native` for a GRPO run's sampled tokens, per optimizer step; `{arm}` = `under_test`, "
             "`gradient_reference`, `native_baseline`; `{plot}` = `histogram`, `qq`, `scatter`.", "",
             f"Custom-scalars layout: category `{LAYER3_CATEGORY}`, one multiline chart per layer-3 metric "
             f"with the three arms; category `{RL_CATEGORY}` (GRPO runs): reward, objective, importance ratios "
             "(min / mean / max in one chart), clipped fraction, |delta logprob| (max and mean), KL (k1 and k3) "
             "and token_mult_prob_error.", "",
             "| tag | kind | x axis | unit | meaning | written by |", "|---|---|---|---|---|---|"]
    lines += [f"| `{p.pattern}` | {p.kind} | {p.step} | {p.unit} | {p.meaning} | {p.written_by} |" for p in PANELS]
    return "\n".join(lines) + "\n"


def _png_array(path: str | os.PathLike) -> np.ndarray:
    """A PNG as uint8 [H, W, 3]."""
    from matplotlib.image import imread

    image = imread(os.fspath(path))
    if image.dtype != np.uint8:
        image = (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)
    return image[..., :3]


class PanelWriter:
    """Writes the panels with ``torch.utils.tensorboard.SummaryWriter`` into ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=os.fspath(self.log_dir))
        self.written: dict[str, list[tuple[int, float]]] = {}
        self._layout: dict[str, dict] = {}

    def _add_layout(self, categories: dict[str, dict]) -> None:
        """Merge ``categories`` into the run's custom-scalars layout and write the whole layout (the
        last one written is the one TensorBoard shows)."""
        self._layout.update(categories)
        self._writer.add_custom_scalars(self._layout)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        value = float(value)
        self._writer.add_scalar(tag, value, global_step=step)
        self.written.setdefault(tag, []).append((step, value))

    def write_layer2(self, result: Layer2Result,
                     plots: Mapping[tuple[str, str, str], str | os.PathLike] | None = None) -> None:
        """Per-layer scalars per module class, error histograms, and the given PNG plots as images."""
        for r in result.rows:
            prefix = f"layer2.{r.module_class}/{r.precision}/{r.gradient}"
            values = {"cosine": r.cosine, "norm_ratio": r.norm_ratio, "rel_l2": r.rel_l2,
                      "feature_cosine": r.feature_cosine_median, "sigma_ratio": r.sigma_ratio, "bc": r.bc,
                      "flagged": float(r.flagged)}
            for metric, value in values.items():
                self._scalar(f"{prefix}/{metric}", math.nan if value is None else value, r.layer)
        for (precision, gradient), s in result.samples.items():
            for which, errors in (("reference_error", s.reference_error), ("alternative_error", s.alternative_error)):
                self._writer.add_histogram(f"layer2.errors/{precision}/{gradient}/{which}", errors.numpy(), 0)
        for (precision, gradient, plot), path in (plots or {}).items():
            self._writer.add_image(f"layer2.plots/{precision}/{gradient}/{plot}", _png_array(path), 0,
                                   dataformats="HWC")

    def write_mismatch(self, mismatch: Mapping[str, LogprobMismatch | Mapping[str, Any]], step: int = 0) -> None:
        """The RL mismatch figures of every trainer (``LogprobMismatch`` or its ``to_dict()``)."""
        for trainer, figures in mismatch.items():
            data = figures.to_dict() if isinstance(figures, LogprobMismatch) else figures
            for metric in MISMATCH_METRICS:
                self._scalar(f"mismatch/{trainer}/{metric}", data[metric], step)

    def write_layer3(self, run: Layer3Run) -> None:
        """Every arm's per-step metrics, and the custom-scalars layout that overlays the arms."""
        for arm in ARMS:
            for s in run.arms[arm]:
                for metric in STEP_METRICS:
                    self._scalar(f"layer3/{metric}/{arm}", s.metric(metric), s.step)
        self._add_layout(layer3_layout())

    def write_rl_step(self, figures: Mapping[str, Any], arm: str) -> None:
        """One GRPO step's figures (``rl.run``): the ``rl/`` scalars, the sampled-token mismatch under
        ``mismatch/rl_<arm>/`` and the custom-scalars layout of :func:`rl_layout`."""
        step = int(figures["step"])
        for metric in RL_METRICS:
            self._scalar(f"rl/{metric}", figures[metric], step)
        self.write_mismatch({f"rl_{arm}": figures}, step)
        self._add_layout(rl_layout(arm))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()

    def __enter__(self) -> "PanelWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def layer3_layout() -> dict:
    """Custom-scalars layout: one multiline chart per layer-3 metric with the three arms' tags."""
    return {LAYER3_CATEGORY: {metric: ["Multiline", [f"layer3/{metric}/{arm}" for arm in ARMS]]
                              for metric in STEP_METRICS}}


def rl_layout(arm: str) -> dict:
    """Custom-scalars layout of a GRPO run of ``arm`` (``aligned`` / ``native``)."""
    mismatch = f"mismatch/rl_{arm}"
    return {RL_CATEGORY: {
        "reward": ["Multiline", ["rl/reward_mean"]],
        "objective": ["Multiline", ["rl/objective"]],
        "importance ratio": ["Multiline", ["rl/ratio_min", "rl/ratio_mean", "rl/ratio_max"]],
        "clipped fraction": ["Multiline", ["rl/clipped_fraction"]],
        "|delta logprob|": ["Multiline", [f"{mismatch}/max_abs_delta_logprob", f"{mismatch}/mean_abs_delta_logprob"]],
        "KL": ["Multiline", [f"{mismatch}/gen_kl_error", f"{mismatch}/k3_kl"]],
        "token_mult_prob_error": ["Multiline", [f"{mismatch}/token_mult_prob_error"]],
    }}

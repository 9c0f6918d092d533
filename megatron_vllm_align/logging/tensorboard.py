"""TensorBoard gradient-contract panels: every tag comes from one pattern of ``PANELS``, which
``docs/panels.md`` lists (``panels_markdown()`` renders it; a test keeps the two equal).

TensorBoard groups scalars by the tag's first path component, so each layer-2 module class gets
its own panel group ``layer2.<module_class>``, with the layer index as the step. The three-arm
layer-3 curves share one chart per metric through the custom-scalars layout (``Multiline``
charts in category ``LAYER3_CATEGORY``). ``PanelWriter.written`` records every scalar as
``{tag: [(step, value), ...]}`` (``texts`` every text) so callers can show the same numbers elsewhere.

Training runs (``train.run``, ``rl.run``) write the ``train/`` scalars, gradient norms per module
and layer, the contracts as text and the guards' findings per optimizer step; with a recipe
``layer2`` section also ``layer2_train.<linear>`` panels, the optimizer step on the x axis and one
line per layer in the custom-scalars layout.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from megatron_vllm_align.contracts import GradientContract
from megatron_vllm_align.validation.layer2 import Layer2Result
from megatron_vllm_align.validation.layer3_data import ARMS, STEP_METRICS, Layer3Run
from megatron_vllm_align.validation.logprob_mismatch import LogprobMismatch

LAYER2_METRICS: tuple[str, ...] = ("cosine", "norm_ratio", "rel_l2", "feature_cosine", "sigma_ratio", "bc")
MISMATCH_METRICS: tuple[str, ...] = ("max_abs_delta_logprob", "mean_abs_delta_logprob", "token_mult_prob_error",
                                     "gen_kl_error", "k3_kl")
LAYER3_CATEGORY = "layer3: three arms"
LAYER3_WRITERS = "main job, layer-3 run"
RL_CATEGORY = "rl: on-policy"
RL_METRICS: tuple[str, ...] = ("reward_mean", "objective", "ratio_min", "ratio_mean", "ratio_max", "clipped_fraction")
TRAIN_CATEGORY = "train: optimizer steps"
GRAD_NORM_CATEGORY = "train: gradient norm per module and layer"
GUARDS_CATEGORY = "train: guards"
LAYER2_TRAIN_CATEGORY = "layer2 during training: {linear}"
#: tag -> the trainer's per-step metric it shows (``train.trainer``); a None metric is not written
TRAIN_SCALARS: dict[str, str] = {"train/loss": "train_loss", "train/val_nll": "val_nll", "train/lr": "lr",
                                 "train/grad_norm": "grad_norm", "train/grad_norm_clipped": "grad_norm_clipped",
                                 "train/update_rms": "update_rms", "train/tokens_per_s": "tokens_per_s"}
#: the layer-2 figures per row (``validation.layer2.Layer2Row`` attribute or flagged as 0/1)
LAYER2_ROW_METRICS: dict[str, str] = {"cosine": "cosine", "norm_ratio": "norm_ratio", "rel_l2": "rel_l2",
                                      "feature_cosine": "feature_cosine_median", "sigma_ratio": "sigma_ratio",
                                      "bc": "bc", "flagged": "flagged"}


@dataclass(frozen=True)
class Panel:
    """One tag pattern: ``{placeholders}`` are filled per run; ``step`` says what the x axis is."""

    pattern: str
    kind: str  # scalar | histogram | image | text
    step: str
    unit: str
    meaning: str
    written_by: str = "main job"  # which runs write it: "main job", "GRPO run", "SFT run", "SFT run with layer2"


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
    Panel("train/loss", "scalar", "optimizer step", "nats/token",
          "training loss at the parameters before the step (SFT: masked next-token NLL of the global batch; GRPO: "
          "the objective)", written_by="SFT run, GRPO run"),
    Panel("train/val_nll", "scalar", "optimizer step", "nats/token",
          "masked NLL of the fixed validation split after the step (steps evaluated by train.eval_every)",
          written_by="SFT run"),
    Panel("train/lr", "scalar", "optimizer step", "1", "learning rate of the step", written_by="SFT run, GRPO run"),
    Panel("train/grad_norm", "scalar", "optimizer step", "gradient L2 norm",
          "global norm of the reduced gradients AdamW steps with, before clipping", written_by="SFT run, GRPO run"),
    Panel("train/grad_norm_clipped", "scalar", "optimizer step", "gradient L2 norm",
          "the same norm measured after clipping (equal to grad_norm when not clipped)",
          written_by="SFT run, GRPO run"),
    Panel("train/update_rms", "scalar", "optimizer step", "parameter units",
          "RMS of the parameters' change over the step", written_by="SFT run, GRPO run"),
    Panel("train/tokens_per_s", "scalar", "optimizer step", "tokens/s", "global batch tokens / step wall time",
          written_by="SFT run, GRPO run"),
    Panel("grad_norm/{module}/layer_{layer}", "scalar", "optimizer step", "gradient L2 norm",
          "norm of the reduced gradient before clipping of every parameter of that module in decoder layer {layer}",
          written_by="SFT run, GRPO run"),
    Panel("grad_norm/{outer_module}", "scalar", "optimizer step", "gradient L2 norm",
          "the same for a module outside the decoder layers", written_by="SFT run, GRPO run"),
    Panel("contracts/table", "text", "0", "Markdown",
          "the gradient contracts of the trained model's module classes, one row each (a native model: a sentence "
          "saying it has none)", written_by="SFT run, GRPO run"),
    Panel("contracts/{contract}", "text", "0", "Markdown", "that contract's seven-row table",
          written_by="SFT run, GRPO run"),
    Panel("guards/summary", "text", "0", "Markdown", "which guards run (guards section) and what they found",
          written_by="SFT run"),
    Panel("guards/optimizer_identity_findings", "scalar", "0", "count",
          "findings of the optimizer identity check before the first step (any finding stops the run)",
          written_by="SFT run"),
    Panel("guards/frozen_unchanged", "scalar", "optimizer step", "count",
          "frozen parameters verified bitwise unchanged over the step (a violation stops the run)",
          written_by="SFT run"),
    Panel("guards/gradient_dump", "scalar", "optimizer step", "0/1",
          "1 when the step's gradients were dumped where the optimizer sees them", written_by="SFT run"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/cosine/layer_{layer}", "scalar", "optimizer step", "1",
          "cos(alternative, default convention) from the step's own dY; gradient dX: dx_weight master vs "
          "dequantized, dW: activation_ref original vs quantized", written_by="SFT run with layer2"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/norm_ratio/layer_{layer}", "scalar", "optimizer step", "1",
          "||alternative|| / ||default||", written_by="SFT run with layer2"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/rel_l2/layer_{layer}", "scalar", "optimizer step", "1",
          "||alternative - default|| / ||default||", written_by="SFT run with layer2"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/feature_cosine/layer_{layer}", "scalar", "optimizer step",
          "1", "median over input features of the per-feature cosine", written_by="SFT run with layer2"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/sigma_ratio/layer_{layer}", "scalar", "optimizer step", "1",
          "RMS(alternative error) / RMS(default-convention error), both vs the exact derivative (a float32 GEMM "
          "on the step's dY and dequantized values; within 6e-6 relative of the float64 figure: train.layer2)",
          written_by="SFT run with layer2"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/bc/layer_{layer}", "scalar", "optimizer step", "1 (0..1)",
          "Bhattacharyya coefficient of the two error distributions", written_by="SFT run with layer2"),
    Panel("layer2_train.{linear}/{precision}/{gradient}/flagged/layer_{layer}", "scalar", "optimizer step", "0/1",
          "1 where the recipe's outlier rule flagged the layer", written_by="SFT run with layer2"),
    Panel("layer2_train.summary/flagged", "scalar", "optimizer step", "count", "flagged rows of the step",
          written_by="SFT run with layer2"),
    Panel("layer2_train.summary/table", "text", "optimizer step", "Markdown",
          "the step's layer-2 tables (as in layer2.md)", written_by="SFT run with layer2"),
    Panel("layer3/train_loss/{arm}", "scalar", "optimizer step", "nats/token", "training loss",
          written_by=LAYER3_WRITERS),
    Panel("layer3/val_nll/{arm}", "scalar", "optimizer step", "nats/token", "fixed validation set NLL",
          written_by=LAYER3_WRITERS),
    Panel("layer3/grad_norm/{arm}", "scalar", "optimizer step", "gradient L2 norm", "global norm before clipping",
          written_by=LAYER3_WRITERS),
    Panel("layer3/update_rms/{arm}", "scalar", "optimizer step", "parameter units", "RMS of the master update",
          written_by=LAYER3_WRITERS),
    Panel("layer3/clip_ratio/{arm}", "scalar", "optimizer step", "1", "the trainer's clipping ratio",
          written_by=LAYER3_WRITERS),
    Panel("layer3/non_finite/{arm}", "scalar", "optimizer step", "count", "non-finite gradient elements",
          written_by=LAYER3_WRITERS),
    Panel("layer3/tokens_per_s/{arm}", "scalar", "optimizer step", "tokens/s", "training throughput",
          written_by=LAYER3_WRITERS),
)


def panels_markdown() -> str:
    """docs/panels.md: every tag pattern, its kind, x axis, unit and meaning."""
    lines = ["# TensorBoard panels", "",
             "Written by `megatron_vllm_align.logging.PanelWriter`; generated from `PANELS` "
             "(`panels_markdown()`), and a test keeps this file equal to it.", "",
             "Placeholders: `{module_class}` = a quantized projection (`self_attn.q_proj` ... `mlp.down_proj`); "
             "`{precision}` = `fp8_per_channel`, `fp8_per_tensor`, `fp8_block128`; `{gradient}` = `dX` or `dW`; "
             "`{trainer}` = a trainer name of the forward comparison (prompt logprobs), with the suffix `_sampled` "
             "for sampled-token logprobs (decode), or `rl_aligned` / `rl_native` for a GRPO run's sampled tokens "
             "(their processed logprobs, under `rl.sampling`) and `rl_aligned_raw` / `rl_native_raw` for the raw "
             "logprobs of the same tokens, per optimizer step; `{arm}` = `under_test`, "
             "`gradient_reference`, `native_baseline`; `{plot}` = `histogram`, `qq`, `scatter`.", "",
             "Training runs (`python -m megatron_vllm_align.train`, rank 0) write `<run_dir>/tensorboard`: "
             "`{module}` = a module path under a decoder layer with expert indices dropped "
             "(`self_attention.linear_qkv`, "
             "`mlp.linear_fc1`, `input_layernorm`, ...), `{layer}` = the decoder layer index, `{outer_module}` = "
             "`embedding.word_embeddings`, `decoder.final_layernorm`, `output_layer`; `{contract}` = a contract name "
             "(`fp8_linear_per_channel`, ...); `{linear}` = an FP8 linear of the trained model (`linear_qkv`, "
             "`linear_proj`, `linear_fc1`, `linear_fc2`). Text panels: torch's `add_text` stores `<tag>` as "
             "`<tag>/text_summary`.", "",
             f"Custom-scalars layout: category `{TRAIN_CATEGORY}` (loss with validation NLL, gradient norm before "
             f"and after clipping, learning rate, update RMS, tokens/s), `{GRAD_NORM_CATEGORY}` (one chart per "
             f"module, a line per layer), `{GUARDS_CATEGORY}`, and per FP8 linear "
             f"`{LAYER2_TRAIN_CATEGORY}` (one chart per precision, gradient and metric, a line per layer); "
             f"category `{LAYER3_CATEGORY}`, one multiline chart per layer-3 metric "
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
        # max_queue: the event writer's thread takes a whole measured step's scalars (layer 2: 7 per
        # linear and gradient) without the caller blocking on a full queue at every 10th event.
        self._writer = SummaryWriter(log_dir=os.fspath(self.log_dir), max_queue=1024)
        self.written: dict[str, list[tuple[int, float]]] = {}
        self.texts: dict[str, list[tuple[int, str]]] = {}
        self._layout: dict[str, dict] = {}
        self._layout_written = False

    def _add_layout(self, categories: dict[str, dict]) -> None:
        """Merge ``categories`` into the run's custom-scalars layout and, if that changed it, write the
        whole layout (the last one written is the one TensorBoard shows)."""
        merged = {**self._layout, **categories}
        if merged != self._layout or not self._layout_written:
            self._layout = merged
            self._writer.add_custom_scalars(self._layout)
            self._layout_written = True

    def _text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, global_step=step)
        self.texts.setdefault(tag, []).append((step, text))

    def write_training_step(self, metrics: Mapping[str, Any]) -> None:
        """One optimizer step's :data:`TRAIN_SCALARS` from the trainer's per-step metrics (``train.trainer``;
        a GRPO run passes ``train_loss`` = its objective), at ``metrics["step"]``, and their layout."""
        step = int(metrics["step"])
        for tag, key in TRAIN_SCALARS.items():
            if metrics.get(key) is not None:
                self._scalar(tag, metrics[key], step)
        self._add_layout(train_layout())

    def write_grad_norms(self, norms: Mapping[tuple[str, int | None], float], step: int) -> None:
        """``{(module, layer or None): norm}`` as ``grad_norm/<module>/layer_<layer>`` (or
        ``grad_norm/<module>``), and one chart per module with a line per layer."""
        charts: dict[str, list[str]] = {}
        for (module, layer), norm in norms.items():
            tag = f"grad_norm/{module}" if layer is None else f"grad_norm/{module}/layer_{layer}"
            self._scalar(tag, norm, step)
            charts.setdefault(module, []).append(tag)
        self._add_layout({GRAD_NORM_CATEGORY: {m: ["Multiline", tags] for m, tags in charts.items()}})

    def write_contracts(self, contracts: Sequence[GradientContract], native_note: str = "") -> None:
        """The contract table (``contracts/table``) and each contract's own table, at step 0."""
        from megatron_vllm_align.contracts import contract_to_markdown, contracts_table_markdown

        self._text("contracts/table", contracts_table_markdown(contracts) if contracts else native_note, 0)
        for contract in contracts:
            self._text(f"contracts/{contract.module_class}", contract_to_markdown(contract), 0)

    def write_guards(self, step: int, *, summary: str | None = None, identity_findings: int | None = None,
                     frozen_unchanged: int | None = None, gradient_dump: bool | None = None) -> None:
        """The guards' findings (``guards/*``): whatever is given, at ``step``."""
        if summary is not None:
            self._text("guards/summary", summary, step)
        for tag, value in (("guards/optimizer_identity_findings", identity_findings),
                           ("guards/frozen_unchanged", frozen_unchanged), ("guards/gradient_dump", gradient_dump)):
            if value is not None:
                self._scalar(tag, float(value), step)
        charts = {"identity findings": ["guards/optimizer_identity_findings"],
                  "frozen parameters unchanged": ["guards/frozen_unchanged"],
                  "gradient dumps": ["guards/gradient_dump"]}
        self._add_layout({GUARDS_CATEGORY: {title: ["Multiline", tags] for title, tags in charts.items()}})

    def write_layer2_step(self, result: Layer2Result, step: int, markdown: str | None = None) -> None:
        """One measured training step's layer-2 rows (``layer2_train.*``) at ``step``, the flagged count,
        the step's Markdown tables (``markdown``, default ``result.to_markdown()``), and per linear a
        category with a line per layer."""
        categories: dict[str, dict] = {}
        scalars: dict[str, float] = {}
        for r in result.rows:
            prefix = f"layer2_train.{r.module_class}/{r.precision}/{r.gradient}"
            category = categories.setdefault(LAYER2_TRAIN_CATEGORY.format(linear=r.module_class), {})
            for metric, attribute in LAYER2_ROW_METRICS.items():
                value = getattr(r, attribute)
                tag = f"{prefix}/{metric}/layer_{r.layer}"
                scalars[tag] = math.nan if value is None else float(value)
                chart = category.setdefault(f"{r.precision} {r.gradient} {metric}", ["Multiline", []])
                chart[1].append(tag)
        scalars["layer2_train.summary/flagged"] = len(result.outliers)
        self._scalars(scalars, step)
        self._text("layer2_train.summary/table", result.to_markdown() if markdown is None else markdown, step)
        self._add_layout(categories)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        value = float(value)
        self._writer.add_scalar(tag, value, global_step=step)
        self.written.setdefault(tag, []).append((step, value))

    def _scalars(self, values: Mapping[str, float], step: int) -> None:
        """``values`` (tag -> scalar) at ``step`` as ONE event: the same scalars when read back (a
        Summary holds any number of values), but one record to serialise and checksum instead of one
        per tag (TensorBoard's writer checksums in pure Python: ~100 records cost ~10 ms)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = {tag: float(value) for tag, value in values.items()}
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._writer._get_file_writer().add_summary(summary, global_step=step)
        for tag, value in values.items():
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
        ``mismatch/rl_<arm>/`` (processed logprobs) and ``mismatch/rl_<arm>_raw/`` (``figures["raw"]``: raw
        logprobs) and the custom-scalars layout of :func:`rl_layout`."""
        step = int(figures["step"])
        for metric in RL_METRICS:
            self._scalar(f"rl/{metric}", figures[metric], step)
        self.write_mismatch({f"rl_{arm}": figures, f"rl_{arm}_raw": figures["raw"]}, step)
        self._add_layout(rl_layout(arm))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()

    def __enter__(self) -> "PanelWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def train_layout() -> dict:
    """Custom-scalars layout of a training run's :data:`TRAIN_SCALARS`."""
    return {TRAIN_CATEGORY: {
        "loss": ["Multiline", ["train/loss", "train/val_nll"]],
        "gradient norm": ["Multiline", ["train/grad_norm", "train/grad_norm_clipped"]],
        "learning rate": ["Multiline", ["train/lr"]],
        "update RMS": ["Multiline", ["train/update_rms"]],
        "tokens/s": ["Multiline", ["train/tokens_per_s"]],
    }}


def layer3_layout() -> dict:
    """Custom-scalars layout: one multiline chart per layer-3 metric with the three arms' tags."""
    return {LAYER3_CATEGORY: {metric: ["Multiline", [f"layer3/{metric}/{arm}" for arm in ARMS]]
                              for metric in STEP_METRICS}}


def rl_layout(arm: str) -> dict:
    """Custom-scalars layout of a GRPO run of ``arm`` (``aligned`` / ``native``)."""
    mismatch, raw = f"mismatch/rl_{arm}", f"mismatch/rl_{arm}_raw"
    return {RL_CATEGORY: {
        "reward": ["Multiline", ["rl/reward_mean"]],
        "objective": ["Multiline", ["rl/objective"]],
        "importance ratio": ["Multiline", ["rl/ratio_min", "rl/ratio_mean", "rl/ratio_max"]],
        "clipped fraction": ["Multiline", ["rl/clipped_fraction"]],
        "|delta logprob|": ["Multiline", [f"{tags}/{metric}" for tags in (mismatch, raw)
                                          for metric in ("max_abs_delta_logprob", "mean_abs_delta_logprob")]],
        "KL": ["Multiline", [f"{tags}/{metric}" for tags in (mismatch, raw) for metric in ("gen_kl_error", "k3_kl")]],
        "token_mult_prob_error": ["Multiline", [f"{mismatch}/token_mult_prob_error", f"{raw}/token_mult_prob_error"]],
    }}

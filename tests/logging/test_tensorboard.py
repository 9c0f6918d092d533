"""TensorBoard panels read back with TensorBoard's own event reader: every documented tag, the
values written, the custom-scalars layout, and the same numbers as the report."""
from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.logging import PANELS, PanelWriter, panels_markdown
from megatron_vllm_align.logging.tensorboard import LAYER3_CATEGORY, RL_CATEGORY
from megatron_vllm_align.report import ARMS, STEP_METRICS, RunReportInputs, layer3_from_dict, write_run_report
from megatron_vllm_align.report.plots import LAYER2_PLOT_KINDS, layer2_plots
from megatron_vllm_align.validation.layer2 import PROJECTIONS, fixed_batch, load_checkpoint_model, run_layer2
from megatron_vllm_align.validation.logprob_mismatch import LogprobMismatch

TINY = TinyModelConfig(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
                       head_dim=64, vocab_size=256)
PRECISIONS = ("fp8_per_channel", "fp8_block128")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "panels.md"


def layer3_data() -> dict:
    def arm(off):
        return [{"train_loss": 4.0 - 0.2 * s + off, "val_nll": 4.2 - 0.1 * s + off, "grad_norm": 0.7 + s,
                 "update_rms": 1e-3 * (s + 1), "clip_ratio": 0.5 * s, "non_finite": s % 2,
                 "tokens_per_s": 900.0 + 10 * s} for s in range(3)]

    return {"arms": {a: arm(0.01 * i) for i, a in enumerate(ARMS)}, "verdict": "inconclusive"}


def rl_figures(step: int) -> dict:
    """A GRPO step's figures as ``rl.run`` records them."""
    return {"step": step, "reward_mean": 0.1 * step, "objective": -0.01 * step, "ratio_min": 1.0 - 0.01 * step,
            "ratio_mean": 1.0, "ratio_max": 1.0 + 0.02 * step, "clipped_fraction": 0.05 * step,
            **LogprobMismatch(0.0, 0.0, 1.0, 0.0, 0.0, 64).to_dict(),
            "raw": LogprobMismatch(0.0, 0.0, 1.0, 0.0, 0.0, 64).to_dict()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    model = load_checkpoint_model(build_tiny_hf_model(root / "tiny", TINY))
    layer2 = run_layer2(model, fixed_batch(TINY.vocab_size, 2, 8), precisions=PRECISIONS, native_forward=True)
    layer3 = layer3_from_dict(layer3_data())
    mismatch = {"megatron_vllm_spec": LogprobMismatch(0.0, 0.0, 1.0, 0.0, 0.0, 31),
                "hf_bf16": LogprobMismatch(2.9e-3, 4e-4, 1.0004, -1e-5, 1e-7, 31).to_dict()}
    plots = layer2_plots(layer2, root / "report" / "plots")
    with PanelWriter(root / "tb") as writer:
        writer.write_layer2(layer2, plots)
        writer.write_mismatch(mismatch, step=0)
        writer.write_layer3(layer3)
        for step in (1, 2):
            writer.write_rl_step(rl_figures(step), "aligned")
    report = write_run_report(RunReportInputs(forward=mismatch, layer2=layer2, layer3=layer3), root / "report")
    events = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0, "histograms": 0, "images": 0,
                                                               "tensors": 0})
    events.Reload()
    return {"layer2": layer2, "layer3": layer3, "mismatch": mismatch, "writer": writer, "events": events,
            "report": report.read_text()}


def expand(pattern: str) -> list[str]:
    values = {"module_class": [p for p in PROJECTIONS], "precision": list(PRECISIONS), "gradient": ["dX", "dW"],
              "trainer": ["megatron_vllm_spec", "hf_bf16", "rl_aligned", "rl_aligned_raw"], "arm": list(ARMS),
              "plot": list(LAYER2_PLOT_KINDS)}
    names = re.findall(r"{(\w+)}", pattern)
    return [pattern.format(**dict(zip(names, combo))) for combo in itertools.product(*(values[n] for n in names))]


def test_docs_list_every_panel():
    assert DOCS.read_text() == panels_markdown()
    for panel in PANELS:
        assert f"`{panel.pattern}`" in DOCS.read_text()


def test_every_documented_tag_present_with_its_values(run):
    """The demo's and the GRPO panels; those of training runs are read back from a real SFT run in
    tests/train/test_train_tensorboard.py."""
    events = run["events"]
    tags = events.Tags()
    present = {"scalar": set(tags["scalars"]), "histogram": set(tags["histograms"]), "image": set(tags["images"])}
    for panel in (p for p in PANELS if "SFT run" not in p.written_by):
        for tag in expand(panel.pattern):
            assert tag in present[panel.kind], f"{tag} ({panel.kind}) missing"
    for tag, written in run["writer"].written.items():
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [s for s, _ in written]
        for (_, got), (_, want) in zip(read, written):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-30) or (math.isnan(got) and math.isnan(want))
    image = events.Images("layer2.plots/fp8_block128/dX/qq")[0]
    assert image.encoded_image_string.startswith(b"\x89PNG") and image.width > 100


def test_layer2_panels_per_module_class_and_layer(run):
    events = run["events"]
    for r in run["layer2"].rows:
        scalars = {e.step: e.value
                   for e in events.Scalars(f"layer2.{r.module_class}/{r.precision}/{r.gradient}/cosine")}
        assert scalars[r.layer] == pytest.approx(r.cosine, rel=1e-6)
        bc = {e.step: e.value for e in events.Scalars(f"layer2.{r.module_class}/{r.precision}/{r.gradient}/bc")}
        assert bc[r.layer] == pytest.approx(r.bc, rel=1e-6)
    hist = events.Histograms("layer2.errors/fp8_per_channel/dX/alternative_error")[0].histogram_value
    samples = run["layer2"].samples[("fp8_per_channel", "dX")]
    assert hist.num == samples.alternative.numel()
    assert hist.max == pytest.approx(float(samples.alternative_error.max()), rel=1e-6)


def _layout(run):
    """The custom-scalars layout TensorBoard shows: the last one written."""
    (tag,) = run["events"].PluginTagToContent("custom_scalars")   # the layout plugin's tag
    return layout_pb2.Layout.FromString(run["events"].Tensors(tag)[-1].tensor_proto.string_val[0])


def test_custom_scalars_layout_overlays_the_three_arms(run):
    (category,) = [c for c in _layout(run).category if c.title == LAYER3_CATEGORY]
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert charts == {m: [f"layer3/{m}/{arm}" for arm in ARMS] for m in STEP_METRICS}


def test_rl_panels_hold_each_step_and_share_the_layout(run):
    events = run["events"]
    assert [(e.step, e.value) for e in events.Scalars("rl/reward_mean")] == [(1, pytest.approx(0.1)),
                                                                            (2, pytest.approx(0.2))]
    assert [e.value for e in events.Scalars("mismatch/rl_aligned/max_abs_delta_logprob")] == [0.0, 0.0]
    (category,) = [c for c in _layout(run).category if c.title == RL_CATEGORY]
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert charts["importance ratio"] == ["rl/ratio_min", "rl/ratio_mean", "rl/ratio_max"]
    assert charts["|delta logprob|"] == ["mismatch/rl_aligned/max_abs_delta_logprob",
                                         "mismatch/rl_aligned/mean_abs_delta_logprob",
                                         "mismatch/rl_aligned_raw/max_abs_delta_logprob",
                                         "mismatch/rl_aligned_raw/mean_abs_delta_logprob"]
    assert {c.title for c in _layout(run).category} == {LAYER3_CATEGORY, RL_CATEGORY}


def test_panels_show_the_numbers_the_report_shows(run):
    events, report = run["events"], run["report"]
    for arm in ARMS:
        last = run["layer3"].arms[arm][-1]
        logged = {m: events.Scalars(f"layer3/{m}/{arm}")[-1].value for m in STEP_METRICS}
        assert f"| {arm} | {last.step} | " + " | ".join(f"{logged[m]:.6g}" for m in STEP_METRICS) + " |" in report
    logged = events.Scalars("mismatch/hf_bf16/max_abs_delta_logprob")[0].value
    assert f"| hf_bf16 | {logged:.6g} |" in report
    row = run["layer2"].select(precision="fp8_block128", gradient="dW", module_class="mlp.gate_proj")[1]
    assert row.layer == 1
    logged = {e.step: e.value for e in events.Scalars("layer2.mlp.gate_proj/fp8_block128/dW/cosine")}[1]
    assert logged == pytest.approx(row.cosine, rel=1e-6)
    assert f"| fp8_block128 | dW | layers.1.mlp.gate_proj | {logged:.6f} |" in report

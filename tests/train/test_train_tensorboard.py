"""A real SFT run's TensorBoard read back with TensorBoard's own reader: the training scalars equal
metrics.json, gradient norms per module and layer add up to the global norm, the contracts as text,
the guards' findings, the custom-scalars layout, and every documented training-run tag present."""
from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from megatron_vllm_align.logging import PANELS
from megatron_vllm_align.logging.tensorboard import GRAD_NORM_CATEGORY, GUARDS_CATEGORY, TRAIN_CATEGORY, TRAIN_SCALARS
from megatron_vllm_align.train.config import load_recipe
from megatron_vllm_align.train.run import run_sft

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FROZEN = "decoder.final_layernorm.weight"
LAYER_MODULES = ("input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj", "pre_mlp_layernorm",
                 "mlp.linear_fc1", "mlp.linear_fc2")
# the aligned tiny Llama's module classes (unquantized), in model order
ALIGNED_CONTRACTS = ["rms_norm", "attention", "dense_linear", "rotary_embedding", "silu_and_mul", "output_layer",
                     "selected_logprob"]


def f32(value: float) -> float:
    """What a TensorBoard scalar holds for ``value`` (stored as float32)."""
    return float(np.float32(value))


def read_events(run_dir) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def text_of(events: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]


def layout(events: EventAccumulator) -> dict[str, dict[str, list[str]]]:
    (tag,) = events.PluginTagToContent("custom_scalars")
    proto = layout_pb2.Layout.FromString(events.Tensors(tag)[-1].tensor_proto.string_val[0])
    return {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in proto.category}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft_tb") / "run"
    recipe = load_recipe(RECIPES / "tiny_llama_sft.yaml", [
        "data.num_train=32", "data.num_validation=4", "train.global_batch_size=4", "train.progress_bar=false",
        f"train.run_dir={run_dir}", "train.steps=3", "train.save_every=0", "train.eval_every=2",
        "guards.gradient_dump_every=2", f"guards.freeze=[{FROZEN}]"])
    result = run_sft(recipe)
    return {"result": result, "steps": result["arms"]["aligned"], "events": read_events(run_dir), "run_dir": run_dir}


def test_training_scalars_equal_metrics_json(sft):
    events, steps = sft["events"], sft["steps"]
    on_disk = json.loads((sft["run_dir"] / "metrics.json").read_text())["arms"]["aligned"]
    assert on_disk == json.loads(json.dumps(steps))
    for tag, key in TRAIN_SCALARS.items():
        want = [(m["step"], f32(m[key])) for m in on_disk if m[key] is not None]
        assert [(e.step, e.value) for e in events.Scalars(tag)] == want, tag
    # evaluated at step 2 (eval_every) and the last step only
    assert [e.step for e in events.Scalars("train/val_nll")] == [2, 3]
    # clipped steps: the measured norm after clipping is the clip threshold
    for m in on_disk:
        if m["clipped"]:
            assert m["grad_norm_clipped"] == pytest.approx(1.0, rel=1e-5) and m["grad_norm"] > 1.0
        else:
            assert m["grad_norm_clipped"] == m["grad_norm"]


def test_gradient_norms_per_module_and_layer_make_the_global_norm(sft):
    events, steps = sft["events"], sft["steps"]
    scalars = events.Tags()["scalars"]
    expected = {f"grad_norm/{m}/layer_{i}" for m, i in itertools.product(LAYER_MODULES, range(2))}
    expected |= {"grad_norm/embedding.word_embeddings", "grad_norm/output_layer"}
    assert {t for t in scalars if t.startswith("grad_norm/")} == expected   # the frozen final norm has none
    for index, metrics in enumerate(steps):
        total = math.sqrt(sum(events.Scalars(tag)[index].value ** 2 for tag in expected))
        assert events.Scalars("grad_norm/output_layer")[index].step == metrics["step"]
        assert total == pytest.approx(metrics["grad_norm"], rel=1e-5)
    charts = layout(events)[GRAD_NORM_CATEGORY]
    assert charts["mlp.linear_fc1"] == ["grad_norm/mlp.linear_fc1/layer_0", "grad_norm/mlp.linear_fc1/layer_1"]


def test_contracts_and_guards_panels(sft):
    events, run_dir = sft["events"], sft["run_dir"]
    ((step, table),) = text_of(events, "contracts/table")
    assert step == 0
    assert re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE) == ALIGNED_CONTRACTS
    ((_, fp_table),) = text_of(events, "contracts/dense_linear")
    assert fp_table.startswith("### `dense_linear`") and "Surrogate function" in fp_table
    ((_, summary),) = text_of(events, "guards/summary")
    assert "checked before the first step: 0 findings" in summary and f"`{FROZEN}`" in summary
    assert [(e.step, e.value) for e in events.Scalars("guards/optimizer_identity_findings")] == [(0, 0.0)]
    assert [(e.step, e.value) for e in events.Scalars("guards/frozen_unchanged")] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    # the dumper dumps 0-based optimizer steps 0, 2: optimizer steps 1 and 3
    assert [(e.step, e.value) for e in events.Scalars("guards/gradient_dump")] == [(1, 1.0), (2, 0.0), (3, 1.0)]
    assert sorted(p.name for p in (run_dir / "gradient_dumps").iterdir()) == ["step_00000000", "step_00000002"]


def test_layout_and_every_documented_training_tag(sft):
    events = sft["events"]
    categories = layout(events)
    assert categories[TRAIN_CATEGORY]["loss"] == ["train/loss", "train/val_nll"]
    assert categories[TRAIN_CATEGORY]["gradient norm"] == ["train/grad_norm", "train/grad_norm_clipped"]
    assert set(categories[GUARDS_CATEGORY]) == {"identity findings", "frozen parameters unchanged", "gradient dumps"}
    tags = events.Tags()
    present = {"scalar": set(tags["scalars"]),
               "text": {t.removesuffix("/text_summary") for t in tags["tensors"] if t.endswith("/text_summary")}}
    values = {"module": [m for m in LAYER_MODULES], "layer": ["0", "1"],
              "outer_module": ["embedding.word_embeddings", "output_layer"], "contract": ALIGNED_CONTRACTS}
    sft_panels = [p for p in PANELS if "SFT run" in p.written_by and "layer2" not in p.written_by]
    assert len(sft_panels) == 15   # train/ 7, grad_norm/ 2, contracts/ 2, guards/ 4
    for panel in sft_panels:
        names = re.findall(r"{(\w+)}", panel.pattern)
        for combo in itertools.product(*(values[n] for n in names)):
            tag = panel.pattern.format(**dict(zip(names, combo)))
            assert tag in present[panel.kind], f"{tag} ({panel.kind}) missing"


def test_native_run_says_it_has_no_contracts(small_recipe, tmp_path):
    run_sft(small_recipe("tiny_llama_sft.yaml", "align.enabled=false", "train.steps=1", "train.save_every=0"))
    events = read_events(tmp_path / "run")
    ((_, table),) = text_of(events, "contracts/table")
    assert "no gradient contract" in table and "contracts/dense_linear/text_summary" not in events.Tags()["tensors"]
    assert [e.step for e in events.Scalars("train/loss")] == [1]
    assert "grad_norm/mlp.linear_fc2/layer_1" in events.Tags()["scalars"]

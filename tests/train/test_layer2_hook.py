"""The recipe's layer-2 hook on the trained Megatron model (FP8 per-channel linears, real batch): its
default convention is bitwise the production backward, a planted outlier is flagged by name and
nothing else is, a run with the hook trains bitwise like one without, the panels and the Markdown
hold the measured figures, and recipes it cannot measure are refused naming the key."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_vllm_align.logging import PanelWriter
from megatron_vllm_align.logging.tensorboard import LAYER2_ROW_METRICS, LAYER2_TRAIN_CATEGORY
from megatron_vllm_align.ops.fp8_linear.kernel import FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME
from megatron_vllm_align.train.config import RecipeError, load_recipe
from megatron_vllm_align.train.distributed import init_distributed
from megatron_vllm_align.train.layer2 import Layer2Hook
from megatron_vllm_align.train.run import run_sft
from megatron_vllm_align.train.run_setup import (
    build_model,
    initial_checkpoint,
    model_logprobs,
    prepare_run_dir,
    recipe_splits,
    step_batch,
)
from megatron_vllm_align.train.trainer import Trainer
from megatron_vllm_align.validation.layer2 import convention_gradients

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_llama_fp8_layer2.yaml"
CLASSES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
FAST = ("data.num_train=32", "data.num_validation=4", "train.global_batch_size=4", "train.progress_bar=false")
PLANTED = ("linear_fc1", 1)


def _recipe(run_dir: Path, *overrides: str):
    return load_recipe(RECIPE, [*FAST, f"train.run_dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def step_one(tmp_path_factory):
    """One real training step of the recipe's model with the hook capturing, before the update."""
    run_dir = tmp_path_factory.mktemp("layer2_hook") / "run"
    recipe = _recipe(run_dir, "layer2.every=1", "train.steps=1")
    env = init_distributed(recipe.train.seed)
    run_dir = prepare_run_dir(recipe, env, "metrics.json")
    checkpoint = initial_checkpoint(recipe, run_dir, env)
    model = build_model(recipe, checkpoint, True)
    trainer = Trainer(model, model_logprobs(model), recipe.optimizer, total_steps=1)
    examples, _, loss_tokens = step_batch(recipe_splits(recipe, checkpoint, model.vocab_size), 1, recipe, env)
    lines: list[str] = []
    hook = Layer2Hook(model, recipe.layer2, run_dir, console=lines.append)
    with hook.capture(1):
        trainer.forward_backward(examples, loss_tokens)
    grads = {name: linear.module.weight.grad.clone() for name, linear in hook.linears.items()}
    rows = {name: getattr(linear.module, "vllm_rows", None) for name, linear in hook.linears.items()}
    captures = hook.take_captures()
    return {"hook": hook, "captures": captures, "grads": grads, "rows": rows, "lines": lines, "run_dir": run_dir}


def test_hook_finds_every_fp8_linear_of_the_trained_model(step_one):
    captures = step_one["captures"]
    assert [(c.module_class, c.layer) for c in captures] == [
        (cls, layer) for layer in range(2) for cls in ("linear_proj", "linear_qkv", "linear_fc1", "linear_fc2")]
    tokens = {c.dy.shape[0] for c in captures}
    assert len(tokens) == 1 and tokens.pop() == captures[0].saved["input"].shape[0] > 0


def test_default_convention_is_the_production_backward_bitwise(step_one):
    """The hook takes the default convention's dX and dW from the step's own backward (its autograd
    node's outputs); recomputing them from the captured X, dY, FP8 weight and the kernel's own
    activation quantizer gives the same bits, and dW is what the real backward put into each master
    weight (QKV: through its row permutation)."""
    for c in step_one["captures"]:
        assert set(c.production) == {"dX", "dW"}, c.name
        recomputed = convention_gradients(c.dy, c.saved, FP8_WEIGHT_SCHEME, FP8_ACTIVATION_SCHEME,
                                          exact_dtype=torch.float32)
        hooked = convention_gradients(c.dy, c.saved, FP8_WEIGHT_SCHEME, FP8_ACTIVATION_SCHEME,
                                      production=c.production, exact_dtype=torch.float32)
        for gradient in ("dX", "dW"):
            default, alternative, exact = recomputed[gradient]
            assert hooked[gradient][0] is c.production[gradient], c.name
            assert torch.equal(c.production[gradient], default), (c.name, gradient)
            assert torch.equal(hooked[gradient][2], exact), (c.name, gradient)
            assert torch.equal(hooked[gradient][1], alternative), (c.name, gradient)
            assert not torch.equal(alternative, default), (c.name, gradient)  # the alternative differs
        grad = step_one["grads"][c.name]
        rows = step_one["rows"][c.name]
        assert torch.equal(c.production["dW"], grad if rows is None else grad[rows]), c.name


def test_hook_figures_are_the_float64_figures(step_one):
    """The hook's exact derivative is a float32 GEMM and its errors are float32:
    its figures against those from a recomputed default and a float64 exact. Cosines, norm ratios,
    rel L2 and feature cosines do not use the exact (equal); sigma ratio and BC move by the float32
    accumulation only (measured: 6e-6 relative, 7e-4; BC's step-to-step spread is ~0.02)."""
    from megatron_vllm_align.validation.layer2 import convention_row

    hooked = {(r.module_class, r.layer, r.gradient): r for r in step_one["hook"].measure(1, step_one["captures"]).rows}
    for c in step_one["captures"]:
        for gradient, (default, alternative, exact) in convention_gradients(
                c.dy, c.saved, FP8_WEIGHT_SCHEME, FP8_ACTIVATION_SCHEME).items():
            assert exact.dtype == torch.float64
            want = convention_row("fp8_per_channel", gradient, c.module_class, c.layer, default, alternative, exact)
            got = hooked[(c.module_class, c.layer, gradient)]
            for figure in ("cosine", "norm_ratio", "rel_l2", "max_abs_err", "feature_cosine_median"):
                assert getattr(got, figure) == getattr(want, figure), (c.name, gradient, figure)
            assert got.sigma_ratio == pytest.approx(want.sigma_ratio, rel=1e-4), (c.name, gradient)
            assert got.bc == pytest.approx(want.bc, abs=2e-3), (c.name, gradient)


def test_clean_step_flags_nothing_and_stays_within_the_fp8_bounds(step_one):
    result = step_one["hook"].measure(1, step_one["captures"])
    assert len(result.rows) == 8 * 2 and result.outliers == []
    for r in result.rows:
        # FP8 e4m3 relative rounding RMS 2^-4 / sqrt(3) = 0.036 bounds rel L2 (tests/validation/test_layer2.py)
        assert r.cosine > 0.9993 and abs(r.norm_ratio - 1) < 0.01 and 1e-3 < r.rel_l2 < 0.036, r
        assert r.sigma_ratio > 2.0, r   # the convention's bias is above the default's bf16 noise floor


def test_planted_outlier_flagged_by_layer_and_class_only(step_one, tmp_path):
    """The alternative of one layer corrupted by a power of two (its master weight doubled: what dX
    from a weight whose FP8 scale is off by 2 would give); the default convention is untouched."""
    hook, captures = step_one["hook"], step_one["captures"]
    planted = next(c for c in captures if (c.module_class, c.layer) == PLANTED)
    planted.saved["master_weight"] = planted.saved["master_weight"] * 2
    try:
        result = hook.measure(7, captures)
    finally:
        planted.saved["master_weight"] = planted.saved["master_weight"] / 2
    assert [(r.module_class, r.layer, r.gradient) for r in result.outliers] == [(*PLANTED, "dX")]
    (row,) = result.outliers
    assert row.norm_ratio == pytest.approx(2.0, rel=2e-3) and any("norm ratio" in why for why in row.reasons)
    with PanelWriter(tmp_path / "tb") as writer:
        hook.publish(7, result, writer)
    assert step_one["lines"] == [f"layer2 WARNING: step 7: linear_fc1 layer 1 flagged [fp8_per_channel dX]: "
                                 f"{row.reasons[0]}"]
    step_one["lines"].clear()
    markdown = (step_one["run_dir"] / "layer2.md").read_text()
    assert "## Step 7" in markdown and f"- layers.1.linear_fc1 [fp8_per_channel dX]: {row.reasons[0]}" in markdown
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for r in result.rows:
        flagged = events.Scalars(f"layer2_train.{r.module_class}/fp8_per_channel/{r.gradient}/flagged/layer_{r.layer}")
        assert [(e.step, e.value) for e in flagged] == [(7, 1.0 if (r.module_class, r.layer, r.gradient) ==
                                                          (*PLANTED, "dX") else 0.0)]
    assert [(e.step, e.value) for e in events.Scalars("layer2_train.summary/flagged")] == [(7, 1.0)]


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def test_hook_leaves_training_bitwise_unchanged(tmp_path):
    """Same recipe with the hook measuring every step and without it: same metrics, and the final
    parameters, AdamW state (with the fp32 main copies) and RNG states bitwise equal."""
    common = ("train.steps=3", "train.save_every=3", "train.eval_every=3")
    hooked = run_sft(_recipe(tmp_path / "hooked", *common, "layer2.every=1"))
    plain = run_sft(_recipe(tmp_path / "plain", *common, "layer2=null"))
    assert [s["step"] for s in hooked["layer2"]] == [1, 2, 3] and "layer2" not in plain
    def strip(steps):
        return [{k: v for k, v in s.items() if k != "tokens_per_s"} for s in steps]

    assert strip(hooked["arms"]["aligned"]) == strip(plain["arms"]["aligned"])
    a, b = (torch.load(tmp_path / arm / "checkpoints" / "step_000003" / "state.pt", weights_only=True)
            for arm in ("hooked", "plain"))
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) == 15
    for name in a["model"]:
        x, y = a["model"][name], b["model"][name]
        assert x.dtype == y.dtype == torch.bfloat16 and torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    for part in ("optimizer", "rng"):
        x, y = _tensors(a[part]), _tensors(b[part])
        assert len(x) == len(y) > 0 and all(torch.equal(u, v) for u, v in zip(x, y)), part


def test_layer2_run_writes_panels_markdown_and_metrics(tmp_path):
    result = run_sft(_recipe(tmp_path / "run", "train.steps=4", "train.eval_every=4"))
    measured = result["layer2"]
    assert [m["step"] for m in measured] == [2, 4]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for entry in measured:
        assert entry["outliers"] == [] and len(entry["rows"]) == 16
        assert {(r["module_class"], r["layer"], r["gradient"]) for r in entry["rows"]} == {
            (c, layer, g) for c in CLASSES for layer in (0, 1) for g in ("dX", "dW")}
    for row in measured[0]["rows"]:
        prefix = f"layer2_train.{row['module_class']}/fp8_per_channel/{row['gradient']}"
        for metric, key in LAYER2_ROW_METRICS.items():
            logged = events.Scalars(f"{prefix}/{metric}/layer_{row['layer']}")
            want = [float(np.float32(float(m_row[key])))
                    for m in measured for m_row in m["rows"] if m_row["name"] == row["name"]
                    and m_row["gradient"] == row["gradient"]]
            assert [e.step for e in logged] == [2, 4] and [e.value for e in logged] == want
    assert [e.step for e in events.Tensors("layer2_train.summary/table/text_summary")] == [2, 4]
    markdown = (tmp_path / "run" / "layer2.md").read_text()
    assert markdown.count("## Step ") == 2 and "| fp8_per_channel | dW | layers.1.linear_fc2 |" in markdown
    first = next(r for r in measured[1]["rows"] if r["name"] == "layers.0.linear_qkv" and r["gradient"] == "dX")
    assert f"| fp8_per_channel | dX | layers.0.linear_qkv | {first['cosine']:.6f} |" in markdown
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["layer2"] == json.loads(json.dumps(measured))
    (tag,) = events.PluginTagToContent("custom_scalars")
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout.FromString(events.Tensors(tag)[-1].tensor_proto.string_val[0])
    titles = {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in layout.category}
    fc2 = titles[LAYER2_TRAIN_CATEGORY.format(linear="linear_fc2")]
    assert fc2["fp8_per_channel dX cosine"] == [f"layer2_train.linear_fc2/fp8_per_channel/dX/cosine/layer_{i}"
                                                 for i in (0, 1)]
    assert len(fc2) == 2 * len(LAYER2_ROW_METRICS)


@pytest.mark.parametrize(("overrides", "message"), [
    (("align.quantization=null",), r"align\.quantization: layer 2 needs FP8 linears .* got None"),
    (("align.enabled=false",), r"align\.enabled: layer 2 compares .* must be true"),
    (("layer2.conventions=[ste]",), r"layer2\.conventions: 'ste' .* allows only the identity STE"),
    (("layer2.conventions=[]",), r"layer2\.conventions: name at least one of \['dx_weight', 'activation_ref'\]"),
    (("layer2.conventions=[dx_weight, dx_weight]",), r"layer2\.conventions: duplicate"),
    (("layer2.every=0",), r"layer2\.every: must be >= 1"),
    (("layer2.cosine_floor=1.5",), r"layer2\.cosine_floor: must be in \(0, 1\]"),
    (("layer2.min_factor=0.5",), r"layer2\.min_factor: must be >= 1"),
    (("layer3.window_steps=2",), r"layer2: the layer-2 hook runs in plain SFT runs"),
])
def test_recipes_layer2_cannot_measure_are_refused(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPE, list(overrides))


def test_shipped_recipe_measures_every_two_steps():
    recipe = load_recipe(RECIPE)
    assert recipe.layer2.every == 2 and recipe.layer2.conventions == ["dx_weight", "activation_ref"]
    assert recipe.align.enabled and recipe.align.quantization == "fp8_per_channel"


def test_flagged_layers_warn_on_the_console(tmp_path, capsys):
    """A rule stricter than FP8 can meet (cosine floor 1 - 1e-7) flags every row of the measured step:
    one console line each, naming the step, class and layer."""
    result = run_sft(_recipe(tmp_path / "run", "train.steps=2", "layer2.cosine_floor=0.9999999"))
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("layer2 WARNING")]
    assert len(result["layer2"][0]["outliers"]) == 16 and len(warnings) == 16
    for cls in CLASSES:
        for layer in (0, 1):
            for gradient in ("dX", "dW"):
                assert sum(line.startswith(f"layer2 WARNING: step 2: {cls} layer {layer} flagged "
                                           f"[fp8_per_channel {gradient}]: cosine ") for line in warnings) == 1

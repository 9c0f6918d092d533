"""The run report: sections and numbers, valid PNGs, layer-3 JSON checks, no complete-looking
report after a failure midway."""
from __future__ import annotations

import json

import pytest
import torch
from matplotlib.image import imread

from megatron_vllm_align.contracts import Tolerance, default_contracts
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.report import (
    INCOMPLETE_MARKER,
    Layer3DataError,
    RunReportInputs,
    layer3_from_dict,
    load_layer3,
    start_run_report,
    write_run_report,
)
from megatron_vllm_align.report import run_report as run_report_module
from megatron_vllm_align.validation import Check, ComparisonReport, grad_metrics
from megatron_vllm_align.validation.layer2 import (
    fixed_batch,
    load_checkpoint_model,
    run_layer2,
)
from megatron_vllm_align.validation.layer3_data import layer3_to_dict
from megatron_vllm_align.validation.logprob_mismatch import LogprobMismatch

TINY = TinyModelConfig(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
                       head_dim=64, vocab_size=256)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def layer3_data(steps: int = 4) -> dict:
    def arm(offset):
        return [{"step": s, "train_loss": 5.0 - 0.1 * s + offset, "val_nll": 5.1 - 0.1 * s + offset,
                 "grad_norm": 1.0 + 0.01 * s, "update_rms": 1e-3, "clip_ratio": 0.0, "non_finite": 0,
                 "tokens_per_s": 1000.0 + s, "tokens": 64 * (s + 1)} for s in range(steps)]
    return {"arms": {"under_test": arm(0.0), "gradient_reference": arm(0.001), "native_baseline": arm(0.01)},
            "verdict": "pass", "verdict_detail": "max |loss diff| 0.001 <= 0.02 over steps 0-3",
            "window": {"first_step": 0, "last_step": steps - 1, "acceptable_deviation": 0.02},
            "localisation": {"first_divergent_step": None, "stage": None, "checkpoint": None, "detail": ""},
            "arm_configs": {"under_test": {"align.enabled": True, "lr": 1e-4, "seed": 0},
                            "gradient_reference": {"align.enabled": True, "lr": 1e-4, "seed": 0,
                                                   "backward": "reference"},
                            "native_baseline": {"align.enabled": False, "lr": 1e-4, "seed": 0}},
            "comparison": [{"step": s, "loss_diff_vs_reference": 0.001} for s in range(steps)]}


@pytest.fixture(scope="module")
def layer2(tmp_path_factory):
    model = load_checkpoint_model(build_tiny_hf_model(tmp_path_factory.mktemp("ck") / "tiny", TINY))
    return run_layer2(model, fixed_batch(TINY.vocab_size, 2, 8), precisions=["fp8_per_channel"], native_forward=True)


def layer1_reports() -> list[ComparisonReport]:
    ref = torch.ones(8)
    tol = Tolerance(atol=0.0, rtol=0.01, rel_l2=0.01)
    good = ComparisonReport("fp8_linear M=37 seed=0", "vjp", [Check("input[0]", "random", "ok",
                            metrics=grad_metrics(ref * 1.001, ref), tolerance=tol)], tolerance_reasoning="u = 2^-8; 3u")
    bad = ComparisonReport("rms_norm M=1 seed=0", "vjp", [Check("weight", "random", "tolerance", "rel L2 too big",
                           metrics=grad_metrics(ref * 1.5, ref), tolerance=tol)], tolerance_reasoning="fp32 stats")
    return [good, bad]


def inputs(layer2_result, **overrides) -> RunReportInputs:
    values = dict(contracts=default_contracts().values(),
                  forward={"megatron_vllm_spec": LogprobMismatch(0.0, 0.0, 1.0, 0.0, 0.0, 31)},
                  layer1=layer1_reports(), layer2=layer2_result, layer3=layer3_from_dict(layer3_data()),
                  missing_coverage=["MoE layers are not part of the default model."])
    values.update(overrides)
    return RunReportInputs(**values)


def test_report_sections_numbers_and_plots(tmp_path, layer2):
    path = write_run_report(inputs(layer2), tmp_path)
    text = path.read_text()
    assert INCOMPLETE_MARKER not in text
    for heading in ("## Gradient contracts", "## Forward: trainer vs inference engine", "## Layer 1",
                    "## Layer 2", "## Layer 3", "## Missing coverage"):
        assert heading in text
    assert "| fp8_per_channel | dX | self_attn.q_proj |" in text            # layer-2 class table
    assert "| fp8_linear | 1/1 | 0.001 | 0.01 |" in text                      # layer-1 row with bound
    assert "| rms_norm | 0/1 | 0.5 | 0.01 |" in text and "rel L2 too big" in text
    assert "**fp8_linear**: u = 2^-8; 3u" in text                            # tolerance reasoning
    assert "Verdict within the window: **PASS**" in text
    assert "| backward | `(absent)` | `reference` | `(absent)` |" in text       # config diff
    assert "| align.enabled | `True` | `True` | `False` |" in text
    assert "Identical in all arms (controlled): `lr`, `seed`" in text
    assert "- MoE layers are not part of the default model." in text
    assert "- Layer 2: NVFP4" in text
    row = layer2.select(gradient="dX", module_class="mlp.down_proj")[0]
    assert f"| layers.0.mlp.down_proj | {row.cosine:.6f} |" in text
    images = [line.split("](")[1].rstrip(")") for line in text.splitlines() if "](plots/" in line]
    assert len(images) == 2 * 3 + 1
    for image in images:
        data = (tmp_path / image).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert imread(tmp_path / image).shape[0] > 100


def test_sections_not_run_are_listed_as_missing(tmp_path, layer2):
    text = write_run_report(inputs(layer2, layer2=None, layer3=None, forward=None), tmp_path).read_text()
    assert text.count("NOT RUN.") == 4
    for section in ("Forward diff against the engine (prompt logprobs (prefill))",
                    "Forward diff against the engine (sampled-token logprobs (decode, MVA_INVARIANT=1))",
                    "Layer 2", "Layer 3"):
        assert f"- {section}: NOT RUN in this run." in text


def test_failure_midway_leaves_only_the_incomplete_placeholder(tmp_path, layer2, monkeypatch):
    write_run_report(inputs(layer2), tmp_path)                 # an earlier complete report in the same place
    start_run_report(tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("disk full while plotting")
    monkeypatch.setattr(run_report_module, "plot_three_arm_curves", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_run_report(inputs(layer2), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert text.startswith(f"# {INCOMPLETE_MARKER}")
    assert "## Layer" not in text and "Verdict" not in text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["arms"].pop("native_baseline"), "arms must be an object with exactly"),
    (lambda d: d["arms"]["under_test"][1].update(trian_loss=1.0),
     r"arms.under_test\[1\]: unknown keys \['trian_loss'\]"),
    (lambda d: d["arms"]["gradient_reference"][0].pop("val_nll"), r"missing keys \['val_nll'\]"),
    (lambda d: d["arms"]["under_test"][0].update(non_finite=0.5), "non_finite must be an integer"),
    (lambda d: d["arms"]["under_test"][0].update(train_loss=float("nan")), "train_loss is nan but non_finite is 0"),
    (lambda d: d["arms"]["under_test"][2].update(step=0), "strictly increasing"),
    (lambda d: d.update(verdict="ok"), "verdict must be one of"),
    (lambda d: d["localisation"].update(stage="backward"), "localisation.stage"),
    (lambda d: d.update(status="complete"), r"unknown keys \['status'\]"),
    (lambda d: d["comparison"][1].pop("step"), "comparison must be a list of objects, each with an integer step"),
])
def test_layer3_json_errors_name_the_field(tmp_path, mutate, message):
    data = layer3_data()
    mutate(data)
    path = tmp_path / "layer3.json"
    path.write_text(json.dumps(data))
    with pytest.raises(Layer3DataError, match=message):
        load_layer3(path)


def test_layer3_json_round_trip(tmp_path):
    path = tmp_path / "layer3.json"
    path.write_text(json.dumps(layer3_data(steps=3)))
    run = load_layer3(path)
    assert [s.step for s in run.arms["native_baseline"]] == [0, 1, 2]
    assert run.arms["gradient_reference"][2].train_loss == pytest.approx(4.801)
    assert run.localisation.first_divergent_step is None


def test_layer3_to_dict_is_the_inverse_of_layer3_from_dict():
    run = layer3_from_dict(layer3_data(steps=3))
    data = layer3_to_dict(run)
    assert layer3_from_dict(json.loads(json.dumps(data))) == run
    assert data["arms"]["under_test"][1] == {"step": 1, "train_loss": 4.9, "val_nll": 5.0, "grad_norm": 1.01,
                                             "update_rms": 1e-3, "clip_ratio": 0.0, "non_finite": 0,
                                             "tokens_per_s": 1001.0, "tokens": 128}
    assert data["comparison"][2] == {"step": 2, "loss_diff_vs_reference": 0.001}

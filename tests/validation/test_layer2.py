"""Layer 2 on a tiny Llama checkpoint with FP8 projections: values, a planted outlier layer, the rule."""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model
from megatron_vllm_align.validation.layer2 import (
    PRECISIONS,
    Layer2Row,
    OutlierRule,
    apply_outlier_rule,
    feature_cosine_median,
    fixed_batch,
    load_checkpoint_model,
    run_layer2,
)

TINY = TinyModelConfig(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
                       head_dim=64, vocab_size=256)
PLANTED = "layers.1.mlp.up_proj"
# FP8 e4m3 keeps 3 mantissa bits: relative rounding error uniform in +-2^-4, RMS 2^-4/sqrt(3) = 0.036.
# dX(master) - dX(dequantized) = dY (W - W_deq) is a sum of such errors, so rel L2 <= ~0.036,
# cosine >= 1 - 0.036^2 / 2 = 0.99935 and |norm ratio - 1| of the order of rel_l2^2 + noise.
# Seed 000 reports cosine ~0.99 / norm ratio ~1.00 for FP8; these bounds are tighter and derived.
REL_L2_BOUND, COSINE_BOUND, NORM_RATIO_BOUND = 0.036, 0.9993, 0.01


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("layer2") / "tiny", TINY)


@pytest.fixture(scope="module")
def clean(checkpoint):
    model = load_checkpoint_model(checkpoint)
    return run_layer2(model, fixed_batch(TINY.vocab_size, 2, 16), native_forward=True)


@pytest.fixture(scope="module")
def planted(checkpoint):
    """Two input features (in different 128-blocks) of one projection scaled by 1e6."""
    model = load_checkpoint_model(checkpoint)
    with torch.no_grad():
        weight = model.model.layers[1].mlp.up_proj.weight
        weight[:, 5] = weight[:, 5].abs() * 1e6
        weight[:, 100] = -weight[:, 100].abs() * 1e6
    return run_layer2(model, fixed_batch(TINY.vocab_size, 2, 16), native_forward=True)


def test_every_projection_precision_and_gradient_measured(clean):
    assert len(clean.rows) == len(PRECISIONS) * 2 * TINY.num_layers * 7
    assert {(r.precision, r.gradient) for r in clean.rows} == {(p, g) for p in PRECISIONS for g in ("dX", "dW")}
    assert set(clean.samples) == {(p, g) for p in PRECISIONS for g in ("dX", "dW")}
    assert any("NVFP4" in note for note in clean.notes)


def test_fp8_master_vs_dequantized_within_derived_bounds(clean):
    for r in clean.rows:
        assert r.cosine > COSINE_BOUND, r
        assert r.rel_l2 < REL_L2_BOUND, r
        assert abs(r.norm_ratio - 1.0) < NORM_RATIO_BOUND, r
        assert r.feature_cosine_median > COSINE_BOUND, r
        # the contract's bias is far above the bf16 noise floor of the default convention
        assert r.sigma_ratio > 3.0, r
        assert 0.0 <= r.bc < 0.95, r
        # the difference is real: the two conventions are not the same numbers
        assert r.rel_l2 > 1e-3, r
    assert clean.outliers == []


def test_planted_outlier_layer_flagged_in_every_precision(planted):
    flagged = {(r.precision, r.name) for r in planted.outliers if r.gradient == "dX"}
    assert flagged == {(p, PLANTED) for p in PRECISIONS}
    for r in planted.select(gradient="dX"):
        if r.name == PLANTED:
            # the whole-tensor cosine is blind: the exactly represented outlier columns dominate the norm
            assert r.cosine > OutlierRule().cosine_floor
            assert r.feature_cosine_median < 0.9
            assert any("feature cosine" in why for why in r.reasons)


def test_markdown_lists_rule_classes_and_outliers(planted):
    text = planted.to_markdown()
    assert "Outlier rule (fixed in advance)" in text
    assert f"- {PLANTED} [fp8_per_tensor dX]" in text
    assert "| fp8_block128 | dX | mlp.up_proj | 2 |" in text
    summary = {(s["precision"], s["gradient"], s["module_class"]): s for s in planted.class_summary()}
    assert summary[("fp8_per_channel", "dX", "mlp.up_proj")]["flagged"] == 1
    assert summary[("fp8_per_channel", "dX", "mlp.gate_proj")]["flagged"] == 0


def _row(layer: int, cosine: float, norm_ratio: float = 1.0) -> Layer2Row:
    return Layer2Row(precision="p", gradient="dX", module_class="c", layer=layer, cosine=cosine,
                     norm_ratio=norm_ratio, rel_l2=0.02, max_abs_err=0.0, feature_cosine_median=cosine,
                     sigma_ratio=10.0, bc=0.5)


def test_outlier_rule_mad_floor_and_norm_ratio():
    rows = [_row(i, 0.99965 + 1e-6 * (i % 3)) for i in range(10)]
    rows.append(_row(10, 0.9985))          # 4x the group's direction error: MAD rule
    rows.append(_row(11, 0.99966, 1.08))   # norm ratio
    flagged = {r.layer: r.reasons for r in apply_outlier_rule(rows, OutlierRule()) if r.flagged}
    assert set(flagged) == {10, 11}
    assert "MAD" in flagged[10][0] and "norm ratio" in flagged[11][0]
    # a tight group: 1.5x the median error is not flagged (min_factor 2), however small the MAD
    calm = apply_outlier_rule([_row(i, 0.9996) for i in range(5)] + [_row(5, 0.9994)], OutlierRule())
    assert not any(r.flagged for r in calm)
    assert apply_outlier_rule([_row(0, 0.98)], OutlierRule())[0].reasons[0].startswith("cosine 0.980000 < floor")


def test_feature_cosine_counts_one_sided_zero_columns():
    ref = torch.ones(4, 3)
    grad = ref.clone()
    grad[:, 0] = 0
    grad[:, 1] = 0
    assert feature_cosine_median(grad, ref) == 0.0
    assert feature_cosine_median(ref, ref) == pytest.approx(1.0)


@pytest.mark.parametrize("exact_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(7,), (300, 40), (5000, 64)])   # 1-D, one chunk, three chunks
def test_row_figures_are_the_reference_definitions(shape, exact_dtype):
    """convention_row's chunked pass gives grad_metrics' cosine, norm ratio, rel L2 and max abs
    error, the feature cosine's definition, and accuracy's sigma ratio and BC of the float64 errors:
    to rounding with a float64 exact; with a float32 exact (the training hook's: the production
    backward's float32 GEMM result, the default being its bf16 rounding) the errors are formed and
    summed in float32, within 1e-6 of the float64 figures."""
    from megatron_vllm_align.accuracy import bhattacharyya_coefficient, sigma_ratio
    from megatron_vllm_align.validation.grad_metrics import grad_metrics
    from megatron_vllm_align.validation.layer2 import CHUNK_ELEMENTS, convention_row

    gen = torch.Generator().manual_seed(1)
    exact = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) ** 3
    ref, alt = exact.bfloat16(), (exact * (1 + 0.02 * torch.randn(shape, generator=gen))).bfloat16()
    if len(shape) == 2:
        alt[:, 3] = 0   # a column zero on one side
        ref[:, 5] = alt[:, 5] = 0   # and one zero on both
    exact = exact.to(exact_dtype)
    row = convention_row("p", "dX", "c", 0, ref, alt, exact)
    m = grad_metrics(alt, ref)
    assert row.cosine == pytest.approx(m.cosine, rel=1e-12) and row.norm_ratio == pytest.approx(m.norm_ratio, rel=1e-12)
    assert row.rel_l2 == pytest.approx(m.rel_l2, rel=1e-12) and row.max_abs_err == m.max_abs_err
    columns = shape[-1] if len(shape) == 2 else 1
    g, r = alt.double().reshape(-1, columns), ref.double().reshape(-1, columns)
    g_norm, r_norm = g.norm(dim=0), r.norm(dim=0)
    cos = torch.where((g_norm > 0) & (r_norm > 0), (g * r).sum(dim=0) / (g_norm * r_norm), 0.0)
    assert row.feature_cosine_median == pytest.approx(float(cos[(g_norm > 0) | (r_norm > 0)].median()), rel=1e-12)
    ref_err, alt_err = ref.double() - exact.double(), alt.double() - exact.double()
    tolerance = 1e-12 if exact_dtype == torch.float64 else 1e-6
    assert row.sigma_ratio == pytest.approx(sigma_ratio(ref_err, alt_err), rel=tolerance)
    assert row.bc == pytest.approx(bhattacharyya_coefficient(ref_err, alt_err), abs=tolerance)
    assert (ref.numel() > CHUNK_ELEMENTS) == (shape == (5000, 64))


def test_bad_input_named(checkpoint):
    model = load_checkpoint_model(checkpoint)
    with pytest.raises(ValueError, match="input_ids"):
        run_layer2(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="precision"):
        run_layer2(model, fixed_batch(TINY.vocab_size, 1, 4), precisions=["nvfp4"])

"""Three-way metrics on inputs with closed-form answers, and the pass rule at its boundaries."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from megatron_vllm_align.accuracy import (
    ThreeWayResult,
    assert_close_three_way,
    bhattacharyya_coefficient,
    compare_three_way,
    error_tensors,
    per_input_ratios,
    sigma_ratio,
    three_way_failures,
)


def _f64(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------- metric functions


def test_error_tensors_are_float64_differences_from_the_baseline():
    baseline = torch.tensor([1.0, 2.0, 3.0])
    expected = torch.tensor([1.0, 2.5, 3.0], dtype=torch.bfloat16)
    actual = torch.tensor([0.5, 2.0, 3.5], dtype=torch.bfloat16)
    ref, tgt = error_tensors(baseline, expected, actual)
    assert ref.dtype == tgt.dtype == torch.float64
    assert ref.tolist() == [0.0, 0.5, 0.0] and tgt.tolist() == [-0.5, 0.0, 0.5]
    refs, tgts = error_tensors([baseline, baseline], [expected, expected], [actual, expected])
    assert isinstance(refs, list) and len(refs) == 2 and tgts[1].tolist() == [0.0, 0.5, 0.0]


def test_target_errors_twice_reference_give_ratios_of_two():
    ref = [_f64([0.1, -0.3, 0.2, 0.05]), _f64([[1e-3, -2e-3], [4e-3, 0.0]])]
    tgt = [2 * r for r in ref]
    assert sigma_ratio(ref, tgt) == 2.0
    ratios = per_input_ratios(ref, tgt)
    assert ratios.linf_ratios == (2.0, 2.0) and ratios.l2_ratios == (2.0, 2.0)
    assert ratios.worst_linf == 2.0 and ratios.worst_l2 == 2.0


def test_sigma_ratio_is_pooled_not_averaged():
    ref = [_f64([1.0] * 4), _f64([10.0] * 4)]
    tgt = [_f64([3.0] * 4), _f64([1.0] * 4)]
    assert sigma_ratio(ref, tgt) == pytest.approx(math.sqrt((4 * 9 + 4 * 1) / (4 * 1 + 4 * 100)), rel=1e-15)
    assert per_input_ratios(ref, tgt).l2_ratios == pytest.approx((3.0, 0.1), rel=1e-15)


def test_zero_reference_error_conventions():
    zeros = _f64([0.0, 0.0])
    assert sigma_ratio(zeros, zeros) == 1.0
    assert sigma_ratio(zeros, _f64([0.0, 1e-9])) == math.inf
    ratios = per_input_ratios([zeros, zeros], [zeros, _f64([1e-9, 0.0])])
    assert ratios.linf_ratios == (1.0, math.inf) and ratios.l2_ratios == (1.0, math.inf)


def test_identical_error_sets_have_bc_one():
    errors = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert bhattacharyya_coefficient(errors, errors.clone()) == pytest.approx(1.0, abs=1e-12)


def test_disjoint_histograms_have_bc_zero():
    ref = torch.linspace(0.0, 0.1, 500, dtype=torch.float64)
    assert bhattacharyya_coefficient(ref, ref + 0.9) == 0.0


def test_two_bin_bc_by_hand():
    # Shared range [0, 1] in 2 bins: p = (3/4, 1/4), q = (1/4, 3/4);
    # BC = sqrt(3/16) + sqrt(3/16) = sqrt(3) / 2.
    ref, tgt = _f64([0.0, 0.0, 0.0, 1.0]), _f64([0.0, 1.0, 1.0, 1.0])
    assert bhattacharyya_coefficient(ref, tgt, bins=2) == pytest.approx(math.sqrt(3) / 2, rel=1e-15)


def test_bc_histogram_range_is_shared():
    # Uniform on [0, 1) and on [0.5, 1.5): per-set ranges would give identical histograms
    # (BC 1). On the shared range [0, 1.5) in 3 bins, p = (1/2, 1/2, 0), q = (0, 1/2, 1/2): BC 1/2.
    ref = torch.linspace(0.0, 1.0, 1001, dtype=torch.float64)[:-1]
    assert bhattacharyya_coefficient(ref, ref + 0.5, bins=3) == pytest.approx(0.5, rel=1e-12)
    assert bhattacharyya_coefficient(ref + 0.5, ref, bins=3) == pytest.approx(0.5, rel=1e-12)


def test_bc_degenerate_cases():
    assert bhattacharyya_coefficient(_f64([0.25] * 5), _f64([0.25] * 3)) == 1.0
    assert bhattacharyya_coefficient(_f64([0.0] * 5), _f64([0.25] * 5)) == 0.0


def test_bc_pools_lists():
    a, b = _f64([0.0, 0.1, 0.2]), _f64([0.3, 0.9])
    c, d = _f64([0.0, 0.5]), _f64([0.6, 0.7, 0.9])
    assert bhattacharyya_coefficient([a, b], [c, d], bins=4) == bhattacharyya_coefficient(
        torch.cat([a, b]), torch.cat([c, d]), bins=4
    )


@pytest.mark.parametrize("seed", range(12))
def test_histogram_counts_are_torch_histc_counts(seed):
    """The bincount histogram behind BC gives torch.histc's counts, values on bin edges and at the
    range's ends included (a grid, a bf16-rounded set, a normal set; float64 and float32), one set
    or several at once."""
    from megatron_vllm_align.accuracy.three_way import histogram, histograms

    gen = torch.Generator().manual_seed(seed)
    chosen = [torch.linspace(-3, 5, 1001, dtype=torch.float64),
              torch.randint(-50, 51, (4000,), generator=gen).double() / 7,
              torch.randn(4000, generator=gen).bfloat16().double() - torch.randn(4000, generator=gen).double(),
              torch.randn(3000, generator=gen, dtype=torch.float64)][seed % 4]
    bins = (100, 7, 1)[seed % 3]
    for values in (chosen, chosen.float()):   # float32: the bin positions in float32, as histc's
        low, high = float(values.min()), float(values.max())
        assert torch.equal(histogram(values, bins, low, high), torch.histc(values, bins, low, high).double())
        halves = [values[: len(values) // 2].clone(), values[len(values) // 2:].clone()]
        both = histograms(halves * 2, bins, low, high)   # 4 sets: int64 positions beyond 256 slots at bins=100
        for i, part in enumerate(halves * 2):
            assert torch.equal(both[i], torch.histc(part, bins, low, high).double()), i


@pytest.mark.parametrize("bins", [0, -3, 2.5, True])
def test_bc_rejects_bad_bins(bins):
    with pytest.raises(ValueError, match="bins must be an int >= 1"):
        bhattacharyya_coefficient(_f64([0.0, 1.0]), _f64([0.0, 1.0]), bins=bins)


# ---------------------------------------------------------------- pass rule at its boundaries


@pytest.mark.parametrize(
    ("sigma", "bc", "linf", "l2", "failed"),
    [
        (7.0, 0.99, 1.0, 1.0, ()),                                    # BC exactly at threshold passes
        (7.0, math.nextafter(0.99, 0.0), 1.0, 1.0, ("statistical",)),
        (1.0, 0.0, 1.0, 1.0, ()),                                     # sigma exactly 1.0 passes
        (math.nextafter(1.0, 2.0), 0.0, 1.0, 1.0, ("statistical",)),
        (1.0, 1.0, 5.0, 1.0, ("L-inf",)),                             # L-inf exactly 5.0 fails
        (1.0, 1.0, math.nextafter(5.0, 0.0), 1.0, ()),
        (1.0, 1.0, 1.0, 3.0, ("L2",)),                                # L2 exactly 3.0 fails
        (1.0, 1.0, 1.0, math.nextafter(3.0, 0.0), ()),
        (2.0, 0.5, 6.0, 4.0, ("statistical", "L-inf", "L2")),
    ],
)
def test_pass_rule_boundaries(sigma, bc, linf, l2, failed):
    failures = three_way_failures(sigma, bc, linf, l2)
    assert len(failures) == len(failed)
    for failure, label in zip(failures, failed):
        assert label in failure


def _zero_baselines(*expected):
    return [torch.zeros_like(e) for e in expected]


def test_linf_ratio_of_exactly_five_fails_from_data():
    expected = _f64([1.0] * 100)
    actual = _f64([1.0] * 99 + [5.0])
    result = compare_three_way(torch.zeros(100, dtype=torch.float64), expected, actual)
    assert result.worst_linf_ratio == 5.0 and result.worst_l2_ratio < 3.0
    assert result.bc == pytest.approx(math.sqrt(0.99), rel=1e-12) and result.bc >= 0.99
    assert not result.passed
    actual[-1] = 4.99
    assert compare_three_way(torch.zeros(100, dtype=torch.float64), expected, actual).passed


def _one_outlier_input(outlier_scale: float):
    """Input 0: target errors `outlier_scale` x reference; input 1 (100x larger): target 10x better."""
    expected = [_f64([1.0] * 4), _f64([10.0] * 400)]
    actual = [_f64([outlier_scale] * 4), _f64([1.0] * 400)]
    return _zero_baselines(*expected), expected, actual


def test_pooled_sigma_passes_while_one_input_l2_ratio_fails():
    baselines, expected, actual = _one_outlier_input(3.0)
    result = compare_three_way(baselines, expected, actual, name="multi")
    assert result.sigma_ratio < 1.0
    assert result.l2_ratios == (3.0, 0.1) and result.worst_l2_ratio == 3.0  # exactly the guard: fails
    assert result.worst_linf_ratio == 3.0
    assert not result.passed
    assert compare_three_way(*_one_outlier_input(2.5)).passed
    # Judged alone, the outlier input fails the statistical gate too: aggregation changed the verdict.
    alone = compare_three_way(baselines[0], expected[0], actual[0])
    assert alone.sigma_ratio == 3.0 and alone.bc == 0.0


def test_sigma_exactly_one_passes_from_data():
    ref = torch.rand(4000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) ** 3
    baseline = torch.zeros_like(ref)
    result = compare_three_way(baseline, ref, -ref)  # mirror image: same RMS, other distribution
    assert result.sigma_ratio == 1.0 and result.bc < 0.99 and result.passed
    worse = compare_three_way(baseline, ref, -ref * (1 + 2.0**-20))
    assert worse.sigma_ratio > 1.0 and not worse.passed


def test_bc_threshold_is_inclusive_from_data():
    generator = torch.Generator().manual_seed(2)
    expected = torch.randn(5000, generator=generator, dtype=torch.float64)
    actual = expected * 1.05 + 0.01
    baseline = torch.zeros_like(expected)
    bc = compare_three_way(baseline, expected, actual).bc
    assert 0.9 < bc < 1.0
    assert compare_three_way(baseline, expected, actual, bc_threshold=bc).passed
    assert not compare_three_way(baseline, expected, actual, bc_threshold=math.nextafter(bc, 1.0)).passed


# ---------------------------------------------------------------- result and messages


def test_result_is_frozen_and_serialisable():
    result = compare_three_way(*_one_outlier_input(2.5), name="r")
    assert isinstance(result, ThreeWayResult) and (result.n_inputs, result.n_elements) == (2, 404)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.passed = False  # type: ignore[misc]
    as_dict = json.loads(json.dumps(result.to_dict()))
    assert set(as_dict) == {f.name for f in dataclasses.fields(ThreeWayResult)}
    assert as_dict["l2_ratios"] == [2.5, 0.1] and as_dict["passed"] is True


def test_assert_message_gives_all_four_figures_and_the_failed_condition():
    with pytest.raises(AssertionError) as excinfo:
        assert_close_three_way(*_one_outlier_input(3.0), name="mlp/layer0")
    message = str(excinfo.value)
    assert message.startswith("three-way comparison FAILED: mlp/layer0:")
    for figure in ("sigma_ratio=", "BC=", "worst L-inf ratio=3 (input 0)", "worst L2 ratio=3 (input 0)"):
        assert figure in message
    assert "failed: worst L2 ratio 3 >= 3" in message
    assert "statistical" not in message and "L-inf ratio 3 >=" not in message


def test_assert_returns_the_result_when_passing():
    result = assert_close_three_way(*_one_outlier_input(2.0))
    assert result.passed and result.worst_l2_ratio == 2.0


# ---------------------------------------------------------------- bad inputs


def test_list_length_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"^attn: input lists differ in length: baseline_fp32 2, expected 2, actual 1"):
        compare_three_way([torch.ones(2)] * 2, [torch.ones(2)] * 2, [torch.ones(2)], name="attn")


def test_shape_mismatch_names_the_input_index():
    baselines = [torch.ones(2, 3), torch.ones(4)]
    with pytest.raises(ValueError,
                       match=r"^attn: actual\[1\] has shape \(5,\) but baseline_fp32\[1\] has shape \(4,\)"):
        compare_three_way(baselines, [torch.ones(2, 3), torch.ones(4)], [torch.ones(2, 3), torch.ones(5)], name="attn")


def test_nan_names_the_input_and_element():
    actual = [torch.ones(3), torch.tensor([1.0, 1.0, float("nan")])]
    with pytest.raises(ValueError, match=r"^attn: actual\[1\] contains 1 NaN .* at index \(2,\)"):
        compare_three_way([torch.ones(3)] * 2, [torch.ones(3)] * 2, actual, name="attn")


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((torch.ones(2), [torch.ones(2)], [torch.ones(2)]), TypeError, "all tensors or all lists"),
        (([], [], []), ValueError, "baseline_fp32 is an empty list"),
        ((torch.ones(2), torch.ones(2, dtype=torch.float64).int(), torch.ones(2)), TypeError,
         "expected has dtype torch.int32"),
        (("x", "y", "z"), TypeError, "must be a tensor or a list of tensors"),
    ],
)
def test_other_bad_inputs(args, error, pattern):
    with pytest.raises(error, match=pattern):
        compare_three_way(*args, name="n")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"bc_threshold": 1.5}, "bc_threshold"), ({"max_linf_ratio": 0.0}, "max_linf_ratio"),
     ({"max_l2_ratio": -1.0}, "max_l2_ratio")],
)
def test_bad_thresholds(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compare_three_way(torch.zeros(2), torch.ones(2), torch.ones(2), **kwargs)


def test_rms_pools_all_inputs():
    from megatron_vllm_align.accuracy import rms

    assert rms([_f64([3.0, 4.0]), _f64([[0.0, 0.0]])]) == pytest.approx(math.sqrt(25 / 4), rel=1e-15)


def test_metric_errors_say_which_error_set():
    with pytest.raises(ValueError, match=r"^sigma_ratio: tgt_errors\[1\] contains 1 NaN"):
        sigma_ratio([_f64([1.0])] * 2, [_f64([1.0]), _f64([math.nan])])

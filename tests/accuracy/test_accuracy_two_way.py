"""Two-way assert_close: the global-max rule, its defaults, its messages and its input errors."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_vllm_align.accuracy import assert_close, compare_two_way, default_tolerances


def _f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_rule_is_exact_at_its_boundary():
    # max|expected| = 4, atol = 0.5, rtol = 0.25: an element may differ by 0.5 + 0.25 * 4 = 1.5.
    expected = _f64(4.0, 1.0, 0.0)
    at_limit = _f64(4.0, 2.5, 0.0)
    assert compare_two_way(at_limit, expected, rtol=0.25, atol=0.5).passed
    beyond = _f64(4.0, math.nextafter(2.5, math.inf), 0.0)
    result = compare_two_way(beyond, expected, rtol=0.25, atol=0.5)
    assert not result.passed and result.mismatches == 1


def test_near_zero_element_rejected_by_allclose_accepted_by_global_max():
    expected = torch.tensor([100.0, 1e-3])
    actual = torch.tensor([100.0, 2e-3])  # the small element is off by 100 % of itself
    assert not torch.allclose(actual, expected, rtol=1e-2, atol=0.0)
    result = assert_close(actual, expected, rtol=1e-2, atol=0.0, name="near_zero")
    assert result.max_rel_error == pytest.approx(1e-3 / 100.0)


def test_with_each_default_global_max_rejects_what_allclose_accepts():
    # With EQUAL tolerances the global rule is never stricter (max|e| >= |e_i|), so the
    # opposite case exists only between the two defaults: allclose's rtol=1e-5 vs fp32's 2*eps.
    expected = torch.ones(8)
    actual = expected * (1 + 1e-6)
    assert torch.allclose(actual, expected)
    with pytest.raises(AssertionError, match="8/8 elements fail"):
        assert_close(actual, expected)


def test_global_max_is_never_stricter_than_allclose_at_equal_tolerances():
    generator = torch.Generator().manual_seed(0)
    disagreements = 0
    for _ in range(200):
        scale = 10.0 ** torch.randint(-3, 3, (16,), generator=generator)
        expected = torch.randn(16, generator=generator, dtype=torch.float64) * scale
        actual = expected + torch.randn(16, generator=generator, dtype=torch.float64) * 1e-3
        ours = compare_two_way(actual, expected, rtol=1e-3, atol=1e-6).passed
        theirs = torch.allclose(actual, expected, rtol=1e-3, atol=1e-6)
        assert ours or not theirs
        disagreements += ours != theirs
    assert disagreements > 0  # the two rules do differ on this data


def test_all_zero_expected_is_compared_absolutely():
    expected = torch.zeros(3, dtype=torch.float64)
    result = compare_two_way(_f64(0.0, 0.01, -0.02), expected, rtol=0.02, atol=0.0)
    assert result.scale == 1.0 and result.passed
    assert not compare_two_way(_f64(0.0, 0.01, -0.03), expected, rtol=0.02, atol=0.0).passed


@pytest.mark.parametrize(
    ("dtypes", "rtol", "atol"),
    [
        ((torch.float32,), 2 * 2.0**-23, torch.finfo(torch.float32).smallest_normal),
        ((torch.bfloat16,), 2 * 2.0**-7, torch.finfo(torch.bfloat16).smallest_normal),
        ((torch.float16,), 2 * 2.0**-10, 2.0**-14),
        ((torch.float8_e4m3fn,), 0.25, 2.0**-6),
        ((torch.float8_e5m2,), 0.5, 2.0**-14),
        ((torch.float32, torch.bfloat16), 2 * 2.0**-7, torch.finfo(torch.bfloat16).smallest_normal),
        ((torch.float16, torch.bfloat16), 2 * 2.0**-7, torch.finfo(torch.bfloat16).smallest_normal),
    ],
)
def test_default_tolerances_follow_the_least_precise_dtype(dtypes, rtol, atol):
    assert default_tolerances(*dtypes) == (rtol, atol)


def test_defaults_used_when_tolerances_are_none():
    expected = torch.tensor([1.0, 2.0, 4.0])
    result = compare_two_way(expected.bfloat16(), expected)
    assert (result.rtol, result.atol) == default_tolerances(torch.bfloat16)
    # 4 + 2 bf16 ulps at the top (ulp 2**-5) = 0.0625 / 4 = 2 * eps: exactly at the limit.
    nudged = torch.tensor([1.0, 2.0, 4.0 + 2 * 2.0**-5], dtype=torch.bfloat16)
    assert compare_two_way(nudged, expected).passed
    pushed = torch.tensor([1.0, 2.0, 4.0 + 4 * 2.0**-5], dtype=torch.bfloat16)
    assert not compare_two_way(pushed, expected).passed


def test_message_names_tensor_counts_and_indices():
    expected = torch.zeros(3, 4, dtype=torch.float64)
    expected[0, 0] = 10.0
    actual = expected.clone()
    actual[2, 3] = 0.5   # relative 0.05: the worst
    actual[1, 1] = -0.2  # relative 0.02
    with pytest.raises(AssertionError) as excinfo:
        assert_close(actual, expected, rtol=0.01, atol=0.0, name="attn_prefill")
    message = str(excinfo.value)
    assert message.startswith("attn_prefill:")
    assert "2/12 elements fail" in message
    assert "max relative error 0.05 at index (2, 3)" in message
    assert "max absolute error 0.5 at index (2, 3)" in message


def test_result_fields_and_index_types():
    expected = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    actual = expected.clone()
    actual[1, 0] += 0.5
    result = compare_two_way(actual, expected, rtol=0.01, atol=0.0)
    assert (result.mismatches, result.total, result.passed) == (1, 6, False)
    assert result.max_abs_index == (1, 0) and all(type(i) is int for i in result.max_abs_index)
    assert result.max_rel_index == (1, 0)
    assert result.max_abs_error == 0.5 and result.max_rel_error == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("actual", "expected", "error", "pattern"),
    [
        (torch.zeros(2, 3), torch.zeros(3, 2), ValueError,
         r"^w1: expected has shape \(3, 2\) but actual has shape \(2, 3\)"),
        (torch.zeros(2), torch.zeros(2, device="meta"), ValueError, r"^w1: expected is on meta but actual is on cpu"),
        (torch.zeros(2, dtype=torch.int32), torch.zeros(2), TypeError, r"^w1: actual has dtype torch.int32"),
        ([0.0, 1.0], torch.zeros(2), TypeError, r"^w1: actual must be a torch.Tensor"),
        (torch.zeros(0), torch.zeros(0), ValueError, r"^w1: actual is empty"),
        (torch.tensor([[0.0, 1.0], [float("nan"), 2.0]]), torch.zeros(2, 2), ValueError,
         r"^w1: actual contains 1 NaN and 0 Inf value\(s\); first is NaN at index \(1, 0\)"),
        (torch.zeros(3), torch.tensor([0.0, 1.0, -float("inf")]), ValueError,
         r"^w1: expected contains 0 NaN and 1 Inf value\(s\); first is Inf at index \(2,\)"),
        (torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn), torch.zeros(2), ValueError,
         r"^w1: actual contains 1 NaN"),
    ],
)
def test_bad_inputs_raise_clear_errors(actual, expected, error, pattern):
    with pytest.raises(error, match=pattern):
        assert_close(actual, expected, name="w1")


@pytest.mark.parametrize(("rtol", "atol"), [(-1e-3, None), (float("nan"), None), (None, float("inf"))])
def test_bad_tolerances_are_rejected(rtol, atol):
    with pytest.raises(ValueError, match=re.compile(r"^w2: (rtol|atol) must be a finite number >= 0")):
        compare_two_way(torch.ones(2), torch.ones(2), rtol=rtol, atol=atol, name="w2")

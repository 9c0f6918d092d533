"""Realistic check: a bf16 matmul judged against torch's bf16 matmul and an FP32 baseline.

Ten seeded inputs. baseline_fp32: the product in fp32 of the bf16 operands. expected (dtype
reference): torch's bf16 matmul. The clean target is a second bf16 implementation (fp32
accumulation in two K halves, then one bf16 output cast), as another correct kernel would be;
the planted bug adds 8 bf16 ulps to every 8th output row of that target.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.accuracy import assert_close, assert_close_three_way, compare_two_way

N_INPUTS, ROWS, K, COLS = 10, 32, 512, 256


def _ulps_up(values: torch.Tensor, count: int) -> torch.Tensor:
    """`values` moved `count` representable steps towards +inf in their own dtype."""
    towards = torch.full_like(values, float("inf"))
    for _ in range(count):
        values = torch.nextafter(values, towards)
    return values


def _split_k_bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    half = x.shape[1] // 2
    partial = x[:, :half].float() @ w[:half].float() + x[:, half:].float() @ w[half:].float()
    return partial.bfloat16()


@pytest.fixture(scope="module")
def matmul_outputs():
    baselines, expected, clean = [], [], []
    for seed in range(N_INPUTS):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(ROWS, K, generator=generator).bfloat16()
        w = (torch.randn(K, COLS, generator=generator) * 0.05).bfloat16()
        baselines.append(x.float() @ w.float())
        expected.append(x @ w)
        clean.append(_split_k_bf16_matmul(x, w))
    return baselines, expected, clean


def _biased(outputs: list[torch.Tensor], ulps: int = 8) -> list[torch.Tensor]:
    planted = []
    for out in outputs:
        out = out.clone()
        out[::8] = _ulps_up(out[::8], ulps)
        planted.append(out)
    return planted


def test_clean_bf16_target_passes(matmul_outputs):
    baselines, expected, clean = matmul_outputs
    result = assert_close_three_way(baselines, expected, clean, name="bf16_matmul/clean")
    assert result.n_inputs == N_INPUTS and result.n_elements == N_INPUTS * ROWS * COLS
    assert result.sigma_ratio == pytest.approx(1.0, abs=1e-3) and result.bc >= 0.99
    for baseline, out in zip(baselines, clean):
        assert_close(out, baseline, name="bf16_matmul/clean")  # bf16 defaults: rtol = 2 * 2**-7


def test_eight_ulp_bias_on_some_rows_fails(matmul_outputs):
    baselines, expected, clean = matmul_outputs
    with pytest.raises(AssertionError) as excinfo:
        assert_close_three_way(baselines, expected, _biased(clean), name="bf16_matmul/biased")
    message = str(excinfo.value)
    assert "statistical gate" in message and "worst L-inf ratio" in message and "worst L2 ratio" in message
    # The two-way diagnostic sees it too, on the biased rows only.
    for baseline, out in zip(baselines, _biased(clean)):
        result = compare_two_way(out, baseline)
        assert not result.passed and result.max_abs_index[0] % 8 == 0


def test_bias_on_a_single_input_is_caught_by_the_per_input_guards(matmul_outputs):
    baselines, expected, clean = matmul_outputs
    target = list(clean)
    target[7] = _biased([clean[7]])[0]
    with pytest.raises(AssertionError, match=r"worst L-inf ratio=[0-9.]+ \(input 7\)") as excinfo:
        assert_close_three_way(baselines, expected, target, name="bf16_matmul/one_input")
    # Pooled over ten inputs the error distributions still overlap (BC >= 0.99): only the guards fail.
    assert "statistical gate" not in str(excinfo.value)

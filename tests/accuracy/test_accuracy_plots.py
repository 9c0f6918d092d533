"""Plots: valid PNG files, written atomically, on demand and on three-way failure."""

from __future__ import annotations

import os

import matplotlib.image
import numpy as np
import pytest
import torch

from megatron_vllm_align.accuracy import assert_close_three_way
from megatron_vllm_align.accuracy.plots import (
    MAX_POINTS,
    plot_error_distributions,
    plot_error_qqplot,
    plot_file_stem,
    plot_scatter,
    plot_three_way,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: str) -> None:
    with open(path, "rb") as stream:
        assert stream.read(8) == PNG_SIGNATURE
    assert os.path.getsize(path) > 10_000
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] >= 400 and image.shape[1] >= 400
    assert float(np.std(image[..., :3])) > 0.01  # something was drawn


def _three_way_case(seed: int = 0, target_scale: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    baseline = torch.randn(64, 64, generator=generator)
    expected = (baseline + 1e-2 * torch.randn(64, 64, generator=generator)).bfloat16()
    actual = (baseline + target_scale * 1e-2 * torch.randn(64, 64, generator=generator)).bfloat16()
    return baseline, expected, actual


def _no_leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".partial-")]


def test_each_plot_is_a_valid_png(tmp_path):
    baseline, expected, actual = _three_way_case()
    ref, tgt = expected.double() - baseline.double(), actual.double() - baseline.double()
    paths = [
        plot_error_distributions(ref, tgt, "mlp/layer0", tmp_path / "hist.png"),
        plot_error_qqplot([ref, ref], [tgt, tgt], "mlp/layer0", tmp_path / "qq.png"),
        plot_scatter(actual, baseline, "mlp/layer0", tmp_path / "nested" / "scatter.png"),
    ]
    assert paths == [str(tmp_path / "hist.png"), str(tmp_path / "qq.png"), str(tmp_path / "nested" / "scatter.png")]
    for path in paths:
        assert_valid_png(path)
    assert not _no_leftovers(tmp_path)


def test_plot_three_way_writes_histogram_and_qq(tmp_path):
    paths = plot_three_way(*_three_way_case(), name="attn/prefill seq128", output_dir=tmp_path)
    assert [os.path.basename(p) for p in paths] == [
        "attn_prefill_seq128_error_hist.png",
        "attn_prefill_seq128_error_qq.png",
    ]
    for path in paths:
        assert_valid_png(path)


def test_more_points_than_the_sampling_limit(tmp_path):
    n = MAX_POINTS + 50_000
    generator = torch.Generator().manual_seed(3)
    expected = torch.randn(n, generator=generator)
    assert_valid_png(plot_scatter(expected + 1e-3, expected, "big", tmp_path / "big.png"))


def test_existing_file_is_replaced(tmp_path):
    target = tmp_path / "scatter.png"
    target.write_bytes(b"old")
    baseline, _, actual = _three_way_case()
    plot_scatter(actual, baseline, "s", target)
    assert_valid_png(str(target))


def test_unwritable_directory_raises_naming_the_path(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    target = blocker / "sub" / "plot.png"
    baseline, _, actual = _three_way_case()
    with pytest.raises(OSError, match=f"cannot write plot '{target}'"):
        plot_scatter(actual, baseline, "s", target)
    assert sorted(os.listdir(tmp_path)) == ["not_a_dir"]


def test_failed_move_leaves_no_partial_file(tmp_path):
    occupied = tmp_path / "plot.png"
    occupied.mkdir()  # os.replace cannot put a file over a directory
    baseline, _, actual = _three_way_case()
    with pytest.raises(OSError, match="cannot write plot"):
        plot_scatter(actual, baseline, "s", occupied)
    assert not _no_leftovers(tmp_path) and os.listdir(occupied) == []


def test_plot_three_way_removes_first_plot_when_second_fails(tmp_path):
    (tmp_path / "t_error_qq.png").mkdir()
    with pytest.raises(OSError):
        plot_three_way(*_three_way_case(), name="t", output_dir=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["t_error_qq.png"]


def test_plots_written_on_three_way_failure_when_asked(tmp_path):
    output_dir = tmp_path / "debug"
    with pytest.raises(AssertionError) as excinfo:
        assert_close_three_way(*_three_way_case(), name="mlp/l0", plot_on_failure=True, output_dir=str(output_dir))
    message = str(excinfo.value)
    written = sorted(os.listdir(output_dir))
    assert written == ["mlp_l0_error_hist.png", "mlp_l0_error_qq.png"]
    for name in written:
        assert str(output_dir / name) in message
        assert_valid_png(str(output_dir / name))


def test_no_plots_unless_asked_or_failing(tmp_path):
    with pytest.raises(AssertionError):
        assert_close_three_way(*_three_way_case(), plot_on_failure=False, output_dir=str(tmp_path / "a"))
    assert_close_three_way(*_three_way_case(target_scale=1.0), plot_on_failure=True, output_dir=str(tmp_path / "b"))
    assert os.listdir(tmp_path) == []


def test_plot_error_during_failure_still_raises_the_accuracy_failure(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(AssertionError,
                       match=r"three-way comparison FAILED: .*plots NOT written: .*cannot write plot .*debug"):
        assert_close_three_way(*_three_way_case(), plot_on_failure=True, output_dir=str(blocker / "debug"))


@pytest.mark.parametrize(("name", "stem"), [("a/b c:d", "a_b_c_d"), ("../..", "tensor"), ("ok-1.x", "ok-1.x")])
def test_file_stems_are_safe(name, stem):
    assert plot_file_stem(name) == stem

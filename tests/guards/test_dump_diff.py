"""The dump diff (library and CLI) on two real dumps with a planted difference."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_vllm_align.guards import GradientDumper, GradientScaling, diff_gradient_dumps, format_diff

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gradient_dump_diff.py"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def _dump(directory: Path, scale_linear_weight: float, loss_scale: float) -> None:
    torch.manual_seed(0)
    model = _Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    GradientDumper(optimizer, directory, model=model, scaling=GradientScaling(loss_scale=loss_scale))
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    model.linear.weight.grad.mul_(scale_linear_weight)  # the planted difference
    optimizer.step()


@pytest.fixture
def dumps(tmp_path) -> tuple[Path, Path]:
    _dump(tmp_path / "a", 2.0, loss_scale=1.0)
    _dump(tmp_path / "b", 1.0, loss_scale=1024.0)
    return tmp_path / "a", tmp_path / "b"


def test_diff_finds_the_planted_factor_per_parameter_and_class(dumps):
    diff = diff_gradient_dumps(dumps[0], 0, dumps[1])
    weight = diff.per_parameter["linear.weight"]
    assert weight.norm_ratio == pytest.approx(2.0, rel=1e-12) and weight.cosine == pytest.approx(1.0, rel=1e-12)
    assert weight.rel_l2 == pytest.approx(1.0, rel=1e-12)
    for name in ("linear.bias", "norm.weight", "norm.bias"):
        assert diff.per_parameter[name].max_abs_err == 0.0, name
    assert sorted(diff.per_module_class) == ["LayerNorm", "Linear"]
    assert diff.per_module_class["LayerNorm"].rel_l2 == 0.0
    assert 0.0 < diff.per_module_class["Linear"].rel_l2 < 1.0  # pooled with the unchanged bias
    assert diff.scaling_differences == {"loss_scale": (1.0, 1024.0)}
    table = format_diff(diff)
    assert "linear.weight" in table and "scaling differs: loss_scale: a=1.0 b=1024.0" in table


def test_cli_prints_and_writes_json(dumps, tmp_path):
    out = tmp_path / "diff.json"
    completed = subprocess.run([sys.executable, str(TOOL), str(dumps[0]), str(dumps[1]), "--step", "0",
                                "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "per module class (pooled):" in completed.stdout and "linear.weight" in completed.stdout
    payload = json.loads(out.read_text())
    assert payload["per_parameter"]["linear.weight"]["norm_ratio"] == pytest.approx(2.0, rel=1e-12)
    assert payload["scaling_differences"] == {"loss_scale": [1.0, 1024.0]}



def test_cli_exit_status_2_names_the_missing_dump(dumps, capsys):
    spec = importlib.util.spec_from_file_location("gradient_dump_diff", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(dumps[0]), str(dumps[1]), "--step", "3"]) == 2
    assert "no gradient dump of step 3" in capsys.readouterr().err

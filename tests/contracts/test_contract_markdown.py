"""Markdown rendering of gradient contracts for reports."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_vllm_align.contracts import (
    contract_to_markdown,
    contracts_table_markdown,
    default_contracts,
    get_default_contract,
)
from megatron_vllm_align.contracts.markdown import ROW_HEADERS

DEFAULTS = default_contracts()


def _cells(row: str) -> list[str]:
    """Cells of a Markdown table row, splitting only on unescaped pipes."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_every_row_header_appears_once_with_two_cells(name):
    text = contract_to_markdown(DEFAULTS[name])
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert [_cells(row)[0] for row in rows[2:]] == list(ROW_HEADERS)
    assert all(len(_cells(row)) == 2 for row in rows)
    assert text.startswith(f"### `{name}` (case {DEFAULTS[name].case})")


def test_key_values_are_rendered():
    text = contract_to_markdown(get_default_contract("nvfp4_linear"))
    for fragment in ["`vllm:ModelOptLinearMethod.apply`", "bf16 -> bf16", "nvfp4_e2m1 block_16",
                     "clamp ±6", "input.global fixed", "dX uses weight: dequantized",
                     "X_ref for dW: quantized", "weight STE: identity",
                     "activation STE: clipped at 2688 (derivative 1 at the threshold)",
                     "`transformer_engine:general_gemm`, else `torch:matmul`", "input_clip_mask",
                     "rel_l2 0.01171875", "Notes: input.global is calibrated"]:
        assert fragment in text, fragment


def test_pipes_and_newlines_cannot_break_the_table():
    contract = get_default_contract("rms_norm")
    layout = "x | y\nsecond line"
    forward = dataclasses.replace(contract.visible_forward, layout=layout)
    text = contract_to_markdown(dataclasses.replace(contract, visible_forward=forward))
    row = next(line for line in text.splitlines() if line.startswith("| Visible forward"))
    assert len(_cells(row)) == 2
    assert "x \\| y second line" in row


def test_summary_has_one_row_per_contract_with_key_choices():
    text = contracts_table_markdown(DEFAULTS.values())
    rows = [line for line in text.splitlines() if line.startswith("|")][2:]
    assert len(rows) == len(DEFAULTS)
    by_name = {_cells(row)[0].strip("`"): _cells(row) for row in rows}
    assert set(by_name) == set(DEFAULTS)
    assert by_name["fp8_linear_block128"][1:5] == [
        "B", "`vllm:Fp8PerBlockOnlineLinearMethod.apply`",
        "weight fp8_e4m3 block_128x128; input fp8_e4m3 per_token_group_128", "dequantized"]
    assert by_name["nvfp4_linear"][7].startswith("clipped at 2688")
    assert by_name["dense_linear"][3:5] == ["none", "not_applicable"]
    assert by_name["routed_experts"][9] == (
        "input 0.015625, expert_w13 0.015625, expert_w2 0.01171875, topk_weights 0.01171875")

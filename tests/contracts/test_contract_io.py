"""YAML round trips, file errors and atomic saving of gradient contracts."""

from __future__ import annotations

import os

import pytest
import yaml

from megatron_vllm_align.contracts import (
    ContractError,
    contract_from_dict,
    contract_to_dict,
    contracts_from_yaml,
    contracts_to_yaml,
    default_contracts,
    load_contracts,
    save_contracts,
)
from megatron_vllm_align.contracts.defaults import default_contract_files

DEFAULTS = default_contracts()


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_default_round_trips_exactly(name, tmp_path):
    contract = DEFAULTS[name]
    assert contract_from_dict(contract_to_dict(contract)) == contract
    text = contracts_to_yaml([contract])
    assert contracts_from_yaml(text) == {name: contract}
    path = save_contracts([contract], tmp_path / "one.yaml")
    assert path.read_text(encoding="utf-8") == text
    assert contracts_to_yaml(load_contracts(path)) == text


def test_shipped_files_are_canonical():
    files = default_contract_files()
    assert len(files) == len(DEFAULTS)
    for op, file_name, text in files:
        assert contracts_to_yaml(contracts_from_yaml(text)) == text, (
            f"ops/{op}/{file_name} is not canonical: rewrite it with save_contracts")


def test_many_contracts_in_one_file_keep_their_order(tmp_path):
    chosen = [DEFAULTS["rms_norm"], DEFAULTS["nvfp4_linear"], DEFAULTS["attention"]]
    loaded = load_contracts(save_contracts(chosen, tmp_path / "three.yaml"))
    assert list(loaded) == ["rms_norm", "nvfp4_linear", "attention"]
    assert list(loaded.values()) == chosen


def test_unusual_text_round_trips():
    data = contract_to_dict(DEFAULTS["dense_linear"])
    data["notes"] = "two  spaces, trailing space , tab\there, NEL\x85, LS\u2028, 'quotes' \"x\": #"
    data["reference"]["reasoning"] = "line one\n  indented line\n\nlast line: ±448 — dYᵀ\n"
    data["reference"]["coverage"] = ["- looks like a list item", "null", "1e-6", "yes", "a: b"]
    contract = contract_from_dict(data)
    assert contracts_from_yaml(contracts_to_yaml([contract])) == {"dense_linear": contract}


def _yaml_with(mutate) -> str:
    data = contract_to_dict(DEFAULTS["fp8_linear_per_channel"])
    del data["module_class"]
    mutate(data)
    return yaml.safe_dump({"fp8_linear_per_channel": data}, sort_keys=False, allow_unicode=True)


def test_load_names_the_path_of_an_unknown_nested_key(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(_yaml_with(lambda d: d["reference"]["tolerances"]["*"].update(rtoll=0.1)),
                    encoding="utf-8")
    with pytest.raises(ContractError) as caught:
        load_contracts(path)
    error = caught.value
    assert error.contract == "fp8_linear_per_channel"
    assert error.field == "reference.tolerances.*.rtoll"
    assert "allowed: atol, rtol, rel_l2" in str(error)
    assert str(path) in str(error)


def test_yaml_1e_minus_6_gets_a_hint():
    text = _yaml_with(lambda d: d["reference"]["tolerances"]["*"].update(atol=0.0)).replace(
        "atol: 0.0", "atol: 1e-6")
    with pytest.raises(ContractError, match=r"write 1\.0e-6") as caught:
        contracts_from_yaml(text)
    assert caught.value.field == "reference.tolerances.*.atol"


@pytest.mark.parametrize("text, fragment", [
    ("a: [unclosed", "not valid YAML"),
    ("", "non-empty mapping"),
    ("- a\n- b\n", "non-empty mapping"),
    ("1: {}\n", "keys must be strings"),
    ("dense_linear: 3\n", "expected a mapping"),
])
def test_malformed_files_are_rejected(text, fragment):
    with pytest.raises(ContractError, match=fragment) as caught:
        contracts_from_yaml(text, source="bad.yaml")
    assert "bad.yaml" in str(caught.value)


def test_duplicate_keys_are_rejected():
    text = contracts_to_yaml([DEFAULTS["silu_and_mul"]])
    with pytest.raises(ContractError, match="'silu_and_mul' appears twice"):
        contracts_from_yaml(text + text)
    nested = text.replace("  case: A\n", "  case: A\n  case: B\n")
    with pytest.raises(ContractError, match="'case' appears twice"):
        contracts_from_yaml(nested)


def test_module_class_inside_a_body_is_rejected():
    text = _yaml_with(lambda d: d.update(module_class="fp8_linear_per_channel"))
    with pytest.raises(ContractError) as caught:
        contracts_from_yaml(text)
    assert caught.value.field == "module_class"


def test_save_rejects_inconsistent_collections(tmp_path):
    with pytest.raises(ContractError, match="stored under key 'other'"):
        save_contracts({"other": DEFAULTS["rms_norm"]}, tmp_path / "x.yaml")
    with pytest.raises(ContractError, match="given twice"):
        save_contracts([DEFAULTS["rms_norm"]] * 2, tmp_path / "x.yaml")
    with pytest.raises(ContractError, match="no contracts"):
        save_contracts([], tmp_path / "x.yaml")
    assert os.listdir(tmp_path) == []


def test_save_into_a_missing_directory_fails_clearly(tmp_path):
    target = tmp_path / "missing" / "contracts.yaml"
    with pytest.raises(OSError, match="cannot write gradient contracts .*missing.*No such file"):
        save_contracts([DEFAULTS["rms_norm"]], target)
    assert not target.parent.exists()


def test_save_under_a_file_fails_clearly(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot write gradient contracts .*a_file.*Not a directory"):
        save_contracts([DEFAULTS["rms_norm"]], blocker / "contracts.yaml")
    assert os.listdir(tmp_path) == ["a_file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_save_into_a_read_only_directory_fails_and_leaves_nothing(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        with pytest.raises(OSError, match="Permission denied"):
            save_contracts([DEFAULTS["rms_norm"]], read_only / "contracts.yaml")
        assert os.listdir(read_only) == []
    finally:
        read_only.chmod(0o700)


def test_failed_replace_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = save_contracts([DEFAULTS["rms_norm"]], tmp_path / "contracts.yaml")
    before = target.read_text(encoding="utf-8")

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="cannot write gradient contracts .*Permission denied"):
        save_contracts([DEFAULTS["attention"]], target)
    assert os.listdir(tmp_path) == ["contracts.yaml"]
    assert target.read_text(encoding="utf-8") == before

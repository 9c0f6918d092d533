"""Gradient contracts to and from plain dicts and YAML files.

File format: a YAML mapping from module class to contract body (the body holds every field
except `module_class`, which is the key). Writing is canonical (field order, literal blocks for
multi-line text), so load -> save reproduces a canonical file byte for byte. Duplicate keys,
unknown fields at any depth and missing required fields are errors naming the field path.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from megatron_vllm_align.contracts.schema import ContractError, GradientContract, field_types
from megatron_vllm_align.utils.atomic_io import atomic_write_text


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def contract_to_dict(contract: GradientContract) -> dict[str, Any]:
    """Plain dict (str, float, list, dict) of `contract` in field order; STE thresholds that
    are None are omitted."""
    return _plain(contract)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _build(hint: Any, data: Any, path: str) -> Any:
    """Records from plain data; scalars are left for the records' own type checks."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(data, Mapping):
            raise ContractError(f"expected a mapping for {hint.__name__}, got "
                                f"{type(data).__name__} {data!r}", field=path or None)
        fields = dataclasses.fields(hint)
        names = [f.name for f in fields]
        for key in data:
            if key not in names:
                raise ContractError(f"unknown field {key!r} in {hint.__name__}; allowed: "
                                    f"{', '.join(names)}", field=_join(path, str(key)))
        for f in fields:
            if f.name not in data and f.default is dataclasses.MISSING:
                raise ContractError(f"missing required field {f.name!r} in {hint.__name__}",
                                    field=_join(path, f.name))
        hints = field_types(hint)
        kwargs = {key: _build(hints[key], value, _join(path, key)) for key, value in data.items()}
        try:
            return hint(**kwargs)
        except ContractError as error:
            raise error.within(prefix=path or None) from None
    if origin is tuple and isinstance(data, list):
        return tuple(_build(args[0], item, f"{path}[{i}]") for i, item in enumerate(data))
    if origin is dict and isinstance(data, Mapping):
        return {key: _build(args[1], value, _join(path, str(key))) for key, value in data.items()}
    return data


def contract_from_dict(data: Mapping[str, Any]) -> GradientContract:
    """The contract described by `data` (as produced by `contract_to_dict`); ContractError
    names the contract and the field path of the first problem."""
    name = data.get("module_class") if isinstance(data, Mapping) else None
    try:
        return _build(GradientContract, data, "")
    except ContractError as error:
        raise error.within(contract=name if isinstance(name, str) else None) from None


class _StrictLoader(yaml.SafeLoader):
    """Safe loader that rejects a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ContractError(f"key {key!r} appears twice "
                                    f"(line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


class _CanonicalDumper(yaml.SafeDumper):
    """Block style, except short collections of single words on one line (flow style);
    long text folded, multi-line text as literal blocks."""


_WIDTH = 88  # soft line width of the written file
_INLINE_TEXT = 76  # longest text written on its key's line
_FLOW = 60  # longest collection written on one line
# YAML line breaks besides \n; PyYAML writes them raw unless double-quoted, and they then
# read back as \n.
_OTHER_LINE_BREAKS = ("\r", "\x85", "\u2028", "\u2029")


def _fits_one_line(values: list[Any]) -> bool:
    words = [str(v) for v in values]
    return (all(isinstance(v, float) or len(str(v).split()) == 1 for v in values)
            and sum(map(len, words)) + 2 * len(words) <= _FLOW)


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    single_spaced = " ".join(text.split()) == text  # folding keeps only such text intact
    style = ('"' if any(c in text for c in _OTHER_LINE_BREAKS) else
             "|" if "\n" in text else
             ">" if len(text) > _INLINE_TEXT and single_spaced else None)
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


def _represent_list(dumper: yaml.SafeDumper, items: list) -> yaml.SequenceNode:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items,
                                     flow_style=_fits_one_line(items))


def _represent_dict(dumper: yaml.SafeDumper, mapping: dict) -> yaml.MappingNode:
    node = dumper.represent_mapping("tag:yaml.org,2002:map", mapping.items())
    node.flow_style = bool(mapping) and _fits_one_line([*mapping, *mapping.values()])
    return node


_CanonicalDumper.add_representer(str, _represent_text)
_CanonicalDumper.add_representer(list, _represent_list)
_CanonicalDumper.add_representer(dict, _represent_dict)


def contracts_from_yaml(text: str, source: str = "<string>") -> dict[str, GradientContract]:
    """Contracts keyed by module class from YAML `text`; errors mention `source`."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        raise ContractError(f"not valid YAML: {error}", source=source) from None
    except ContractError as error:
        raise error.within(source=source) from None
    if not isinstance(data, Mapping) or not data:
        raise ContractError("expected a non-empty mapping of module class -> contract",
                            source=source)
    contracts = {}
    for name, body in data.items():
        if not isinstance(name, str):
            raise ContractError(f"module class keys must be strings, got {name!r}", source=source)
        if not isinstance(body, Mapping):
            raise ContractError(f"expected a mapping, got {type(body).__name__}", contract=name,
                                source=source)
        if "module_class" in body:
            raise ContractError("module_class is given by the mapping key; remove it from the "
                                "body", contract=name, field="module_class", source=source)
        try:
            contracts[name] = contract_from_dict({"module_class": name, **body})
        except ContractError as error:
            raise error.within(source=source) from None
    return contracts


def _keyed(contracts: Mapping[str, GradientContract] | Iterable[GradientContract],
           ) -> dict[str, GradientContract]:
    if isinstance(contracts, Mapping):
        for key, contract in contracts.items():
            if key != contract.module_class:
                raise ContractError(f"stored under key {key!r}", contract=contract.module_class)
        return dict(contracts)
    keyed: dict[str, GradientContract] = {}
    for contract in contracts:
        if contract.module_class in keyed:
            raise ContractError("given twice", contract=contract.module_class)
        keyed[contract.module_class] = contract
    return keyed


def contracts_to_yaml(contracts: Mapping[str, GradientContract] | Iterable[GradientContract],
                      ) -> str:
    """Canonical YAML text of `contracts` (a mapping keyed by module class, or an iterable)."""
    keyed = _keyed(contracts)
    if not keyed:
        raise ContractError("no contracts to write")
    bodies = {name: {k: v for k, v in contract_to_dict(c).items() if k != "module_class"}
              for name, c in keyed.items()}
    return yaml.dump(bodies, Dumper=_CanonicalDumper, sort_keys=False, allow_unicode=True,
                     width=_WIDTH)


def load_contracts(path: str | os.PathLike[str]) -> dict[str, GradientContract]:
    """Contracts keyed by module class from the YAML file at `path`."""
    path = Path(path)
    return contracts_from_yaml(path.read_text(encoding="utf-8"), source=str(path))


def save_contracts(contracts: Mapping[str, GradientContract] | Iterable[GradientContract],
                   path: str | os.PathLike[str]) -> Path:
    """Write `contracts` to `path` atomically (temporary file in the same directory, then
    os.replace); on any failure the temporary file is removed and `path` is left as it was.
    The directory must exist and be writable; OSError otherwise, naming both."""
    return atomic_write_text(path, contracts_to_yaml(contracts), what="gradient contracts")

"""A user's vLLM serving flags (``--max-num-seqs 64 --enable-prefix-caching ...``) parsed by vLLM's own
parser: ``EngineArgs.add_cli_args`` on vLLM's ``FlexibleArgumentParser``, then ``EngineArgs.from_cli_args``,
so every flag the ``vllm serve`` / OpenAI server command accepts for its engine is accepted here, with vLLM's
types, aliases (``-O3``, underscores for dashes) and validation.

:func:`parse_engine_args` returns only the arguments the flags set, by ``EngineArgs`` field name, with
the values ``EngineArgs`` holds for them (``{"max_num_seqs": 64, "enable_prefix_caching": True}``): the
overrides to apply to an engine (``ReferenceEngineConfig.with_overrides``, :mod:`.vllm_reference`).
An unknown flag or a bad value raises :class:`EngineArgsError` with vLLM's message; nothing is printed and
nothing exits.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any

_UNSET = object()


class EngineArgsError(ValueError):
    """The flags are not vLLM engine arguments (unknown flag, bad value); the message says which."""


def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message):   # argparse would print usage and exit(2)
            raise EngineArgsError(message)

        def exit(self, status=0, message=None):   # --help, --version
            raise EngineArgsError(f"{message or ''}not an engine argument (exit {status})".strip())

    parser = Parser(prog="--engine-args", add_help=False)
    EngineArgs.add_cli_args(parser)
    return parser, EngineArgs


def parse_engine_args(flags: str | Sequence[str]) -> dict[str, Any]:
    """``{EngineArgs field: value}`` of the flags given (a shell-quoted string or an argv list), parsed
    by vLLM's parser (module docstring). EngineArgsError for an unknown flag, a positional word or a bad value."""
    argv = shlex.split(flags) if isinstance(flags, str) else [str(flag) for flag in flags]
    parser, engine_args_type = _parser()
    fields = {field.name for field in dataclasses.fields(engine_args_type)}
    dests = {action.dest for action in parser._actions if action.dest in fields}
    try:
        # Every destination starts unset, so the ones the flags set are exactly those that change.
        given = parser.parse_args(argv, argparse.Namespace(**{dest: _UNSET for dest in dests}))
        engine_args = engine_args_type.from_cli_args(parser.parse_args(argv))
    except EngineArgsError:
        raise
    except (ValueError, TypeError) as error:
        raise EngineArgsError(f"{' '.join(argv)}: {error}") from error
    return {dest: getattr(engine_args, dest) for dest in sorted(dests) if getattr(given, dest) is not _UNSET}


def json_safe(value: Any) -> Any:
    """An engine argument value as JSON can hold it (configs and enums as their string form)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


__all__ = ["EngineArgsError", "json_safe", "parse_engine_args"]

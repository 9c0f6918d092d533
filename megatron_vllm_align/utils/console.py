"""Quiet console for the commands that start a vLLM engine: engine and library output into a log file.

Within ``with engine_logs_to(path, verbose=False):``

* file descriptors 1 and 2 point at ``path`` (truncated, its folder created), so all that is written
  to them lands there: vLLM's log lines (``VLLM_LOGGING_STREAM=ext://sys.stderr`` meanwhile; a handler
  vLLM set up earlier holds the old ``sys.stdout``, on descriptor 1), ``sys.stderr`` and with it
  Python warnings, ``logging`` and tqdm bars, and C/C++ output such as torch's ``[W ...]`` lines;
* ``sys.stdout`` writes to the terminal: ``print()`` is for progress lines. The first one names the log.

On exit, normal or by an exception, all is restored, pending Python and C buffers flushed into the
log first: an exception, and whatever the caller prints after the block, reach the terminal.
``verbose=True`` redirects nothing and writes no log. A nested block logs to its own path.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

_STREAM_VARIABLE = "VLLM_LOGGING_STREAM"
_terminal: TextIO | None = None   # the terminal's standard output while a block is active


def _flush(*streams: TextIO) -> None:
    for stream in streams:
        stream.flush()
    ctypes.CDLL(None).fflush(None)   # C stdio buffers, written to whatever descriptors 1 and 2 are now


@contextmanager
def engine_logs_to(path: str | os.PathLike, verbose: bool = False) -> Iterator[None]:
    """Engine and library output into ``path``, ``print()`` on the terminal (module docstring)."""
    global _terminal
    if verbose:
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stdout, stream_variable, outermost = sys.stdout, os.environ.get(_STREAM_VARIABLE), _terminal is None
    _flush(sys.stdout, sys.stderr)
    saved = (os.dup(1), os.dup(2))
    if outermost:
        _terminal = open(os.dup(1), "w", buffering=1, encoding=stdout.encoding,  # noqa: SIM115 (closed on exit)
                         errors=stdout.errors)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ[_STREAM_VARIABLE] = "ext://sys.stderr"
        sys.stdout = _terminal
        print(f"engine and library logs: {path}", flush=True)
        yield
    finally:
        _flush(stdout, sys.stdout, sys.stderr)
        sys.stdout = stdout
        if stream_variable is None:
            os.environ.pop(_STREAM_VARIABLE, None)
        else:
            os.environ[_STREAM_VARIABLE] = stream_variable
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(log)
        if outermost:
            _terminal.close()
            _terminal = None

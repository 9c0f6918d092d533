"""Atomic file writes: a temporary file in the target's directory, then ``os.replace``.

A reader never sees a half-written file: the target either keeps its old content or gets the
complete new one, and on failure the temporary file is removed.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False,
                 what: str = "file", make_dirs: bool = False, mode: int = 0o644) -> Path:
    """Write ``path`` atomically with ``write(stream)``; returns the path.

    ``what`` names the content in error messages; ``make_dirs`` creates missing parent
    directories. Any OSError is re-raised as OSError naming ``what``, the path and the cause.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    temporary = None
    try:
        if make_dirs:
            directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".partial")
        with os.fdopen(handle, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, mode)  # mkstemp creates 0600
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        if isinstance(error, OSError):
            raise OSError(error.errno, f"cannot write {what} {str(path)!r}: {error.strerror or error}") from error
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, what: str = "file", make_dirs: bool = False) -> Path:
    """``atomic_write`` of a UTF-8 text."""
    return atomic_write(path, lambda stream: stream.write(text), what=what, make_dirs=make_dirs)

"""Launching ``torchrun`` (``python -m torch.distributed.run``) on this machine: one node, a free port."""
from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``--master-port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(nproc_per_node: int, *target: str) -> list[str]:
    """The argv of a one-node torchrun of ``target`` (a script path and its arguments, or ``-m``
    and a module) with ``nproc_per_node`` ranks, on this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", *target]

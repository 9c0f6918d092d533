"""Weight pushes into an engine in another process: vLLM's RLHF pattern, a worker extension whose methods
the trainer calls with ``collective_rpc`` and a process group between the trainer and the engine's worker.

The engine is started with ``worker_extension_cls=`` :data:`EXTENSION` (:class:`WeightSyncExtension`).
:meth:`~WeightSyncExtension.mva_join_weight_group` and the trainer's :func:`join_weight_group` build a
two-rank gloo group on a TCP store the trainer hosts (rank 0 the trainer, rank 1 the worker; neither
side's default process group is touched). Per push the trainer packs the tensors (:func:`pack`: one
uint8 buffer and a JSON manifest of names, kinds, dtypes, shapes and byte ranges), calls
:meth:`~WeightSyncExtension.mva_receive_weights` with the manifest and broadcasts the buffer; the worker
loads it as the in-process push does (:func:`.rollout.reload_calls`: checkpoint-format tensors through
``load_weights`` and post-load processing, deployed ones copied). :meth:`~WeightSyncExtension.mva_arm_taps`
/ :meth:`~WeightSyncExtension.mva_take_taps` capture the engine's activations for the divergence report.
Every ``collective_rpc`` argument is a JSON string and every result JSON, so the methods are reachable
through the server's ``/collective_rpc``. Step by step: docs/rl.md#server-mode-step-by-step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from datetime import timedelta

import torch

EXTENSION = "megatron_vllm_align.rl.weight_sync.WeightSyncExtension"
TRAINER_RANK, WORKER_RANK, GROUP_SIZE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Packed:
    """One push as one contiguous uint8 ``buffer`` and its ``manifest`` (one entry per tensor: ``name``,
    ``kind`` ``"checkpoint"`` or ``"deployed"``, ``dtype`` (torch name), ``shape``, ``offset`` and
    ``nbytes`` into the buffer)."""

    buffer: torch.Tensor
    manifest: list[dict]


def pack(weights) -> Packed:
    """``weights`` (:class:`.rollout.EngineWeights`) as one buffer, tensors in their own dtype's bytes."""
    entries, chunks, offset = [], [], 0
    for kind, tensors in (("checkpoint", weights.checkpoint), ("deployed", weights.deployed)):
        for name, tensor in tensors.items():
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            entries.append({"name": name, "kind": kind, "dtype": str(tensor.dtype).removeprefix("torch."),
                            "shape": list(tensor.shape), "offset": offset, "nbytes": int(data.numel())})
            chunks.append(data)
            offset += int(data.numel())
    buffer = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return Packed(buffer, entries)


def unpack(buffer: torch.Tensor, manifest: list[dict]):
    """The :class:`.rollout.EngineWeights` of a packed ``buffer`` (each tensor a copy, in its own dtype)."""
    from megatron_vllm_align.rl.rollout import EngineWeights

    parts: dict[str, dict[str, torch.Tensor]] = {"checkpoint": {}, "deployed": {}}
    for entry in manifest:
        data = buffer[entry["offset"]:entry["offset"] + entry["nbytes"]].clone()
        parts[entry["kind"]][entry["name"]] = data.view(getattr(torch, entry["dtype"])).view(entry["shape"])
    return EngineWeights(parts["checkpoint"], parts["deployed"])


def listening_socket(host: str) -> socket.socket:
    """A socket bound to a free port of ``host`` and listening: the trainer's TCP store is served on it
    (no port race, and no rendezvous: under torchrun a rendezvous would look for torchrun's own store)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def join_weight_group(host: str, port: int, rank: int, timeout_s: float, listen_socket: socket.socket | None = None):
    """This process's end of the two-rank gloo group whose TCP store is at ``host:port`` (the trainer, rank
    ``TRAINER_RANK``, serves it on ``listen_socket``); a ``torch.distributed.ProcessGroup`` outside the
    default group."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(host, port, rank, GROUP_SIZE, "gloo",
                                                          listen_socket=listen_socket,
                                                          timeout=timedelta(seconds=timeout_s))


def broadcast_buffer(group, buffer: torch.Tensor):
    """Start the broadcast of ``buffer`` from the trainer (rank 0) over ``group``; returns the ``Work``."""
    return group.broadcast(buffer, TRAINER_RANK)


class WeightSyncExtension:
    """Methods vLLM adds to the engine's worker (module docstring). ``self`` is the vLLM worker."""

    def mva_join_weight_group(self, init: str) -> dict:
        """Join the trainer's gloo group; ``init``: JSON ``{"host", "port", "timeout_s"}``. Returns this
        worker's pid and whether the invariance plugin installed its patches in it."""
        from megatron_vllm_align.invariance import plugin

        info = json.loads(init)
        self.mva_weight_group = join_weight_group(info["host"], int(info["port"]), WORKER_RANK,
                                                  float(info["timeout_s"]))
        return {"pid": os.getpid(), "invariant": bool(plugin._installed)}

    def mva_receive_weights(self, manifest: str) -> dict:
        """Receive one push (its ``manifest``, JSON, from :func:`pack`) over the group and load it
        (:func:`.rollout.reload_calls`: the in-process push's loads). Returns the counts."""
        entries = json.loads(manifest)
        buffer = torch.empty(sum(e["nbytes"] for e in entries), dtype=torch.uint8)
        broadcast_buffer(self.mva_weight_group, buffer).wait()
        return self.mva_load_packed(manifest, buffer)

    def mva_load_packed(self, manifest: str, buffer: torch.Tensor) -> dict:
        """Load one push whose ``buffer`` came with the call (an in-process engine's tensor-parallel workers:
        ``collective_rpc`` hands each worker a copy); ``manifest``: JSON, from :func:`pack`. Each worker loads
        the full checkpoint-format tensors and keeps its shard, as at the engine's start. Returns the counts."""
        from megatron_vllm_align.rl.rollout import reload_calls

        entries = json.loads(manifest)
        for kwargs in reload_calls(unpack(buffer, entries)):
            self.reload_weights(**kwargs)
        return {"tensors": len(entries), "bytes": int(buffer.numel()), "pid": os.getpid()}

    def mva_leave_weight_group(self) -> None:
        group = getattr(self, "mva_weight_group", None)
        if group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(group)
            self.mva_weight_group = None

    def mva_arm_taps(self, paths: str) -> None:
        """Hook the engine model's modules ``paths`` (JSON ``{name: dotted path}``): each keeps its
        output of the next forwards (``megatron.activation_divergence``'s capture)."""
        from megatron_vllm_align.megatron.activation_divergence import _hooked

        self.mva_disarm_taps()
        self.mva_taps: dict[str, torch.Tensor] = {}
        self.mva_tap_handles = _hooked(self.model_runner.get_model(), json.loads(paths), self.mva_taps)

    def mva_disarm_taps(self) -> None:
        for handle in getattr(self, "mva_tap_handles", []):
            handle.remove()
        self.mva_tap_handles = []

    def mva_take_taps(self) -> dict:
        """The captured outputs (``{name: [[fp32, ...], ...]}``; JSON numbers round-trip fp32 exactly),
        the hooks removed."""
        self.mva_disarm_taps()
        taps, self.mva_taps = getattr(self, "mva_taps", {}), {}
        return {name: tensor.tolist() for name, tensor in taps.items()}

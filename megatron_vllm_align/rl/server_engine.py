"""The GRPO run's engine out of the trainer's process (``rl.engine: server``): vLLM's OpenAI-compatible
server as a subprocess (:mod:`megatron_vllm_align.engine.server`), sampled over HTTP, its weights
updated through vLLM's RLHF path (:mod:`.weight_sync`).

:class:`ServerRolloutEngine` has :class:`.rollout.RolloutEngine`'s methods: :meth:`sample` (one
concurrent ``/v1/completions`` request per prompt, each with its seed and the stop token; sampled tokens
and fp32 logprobs as the in-process engine returns them), :meth:`push_weights`, :meth:`prompt_logprobs`
(the probe check), :meth:`first_divergence` and :meth:`shutdown` (idempotent; also at interpreter exit
and on SIGTERM, so no server outlives the run). At start it refuses a server in which the invariance
plugin did not install its patches in every vLLM process when asked, joins the gloo group with the
worker and runs a one-token request; its log is kept (``log_path``). Dense models only (R3's routing
capture hooks an in-process model). Server flags and each step: docs/rl.md#server-mode-step-by-step.
"""
from __future__ import annotations

import atexit
import json
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_vllm_align.engine.server import (
    HOST,
    ServerError,
    ServerProcess,
    _opener,
    _post_completion,
    sample_completions_http,
)
from megatron_vllm_align.engine.vllm_reference import SampledCompletion
from megatron_vllm_align.megatron.hf_checkpoint import HFDenseConfig
from megatron_vllm_align.rl.rollout import SAMPLING_FIELDS, EngineWeights
from megatron_vllm_align.rl.weight_sync import (
    EXTENSION,
    TRAINER_RANK,
    broadcast_buffer,
    join_weight_group,
    listening_socket,
    pack,
)

START_TIMEOUT_S = 900.0
RPC_TIMEOUT_S = 600.0
GROUP_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 120.0
# The server's OpenMP threads wait passively: spinning threads slow the trainer's ranks on the same cores
# (the computation is the same).
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def server_args(kv_cache_mb: int, seed: int) -> list[str]:
    """The engine arguments of the rollout server (module docstring)."""
    return ["--enforce-eager", "--skip-tokenizer-init", "--dtype", "bfloat16", "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs",
            "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(kv_cache_mb * 1024 * 1024),
            "--worker-extension-cls", EXTENSION, "--disable-uvicorn-access-log"]


class ServerRolloutEngine:
    """The run's engine as an OpenAI server subprocess on ``checkpoint_dir`` (module docstring); start it
    on one rank. Raises ``EngineStartError`` when the server does not start, lacks the invariance
    patches it was asked for, cannot join the weight group or cannot run a one-token request (the
    server is stopped then)."""

    def __init__(self, checkpoint_dir: str | Path, hf_config: HFDenseConfig, kv_cache_mb: int, seed: int, *,
                 invariant: bool, log_path: str | Path) -> None:
        from megatron_vllm_align.engine import EngineStartError

        if hf_config.moe is not None:
            raise EngineStartError("rl.engine server serves dense models only: the MoE routing replay needs the "
                                   "engine's routing, captured in an in-process engine (rl.engine: in_process)")
        self.hf_config, self.invariant = hf_config, invariant
        self.group = None
        self.process = ServerProcess(checkpoint_dir, server_args(kv_cache_mb, seed), log_path=log_path,
                                     invariant=invariant, kv_cache_gib=None, env=SERVER_ENV)
        self._stopped = False
        self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        atexit.register(self.shutdown)
        try:
            self.server = self.process.wait_healthy(START_TIMEOUT_S)
            self.processes = (self.server.assert_invariance_loaded() if invariant
                              else self.server.assert_invariance_absent() or self.server.vllm_processes())
            joined = self._join_group()
            if joined.get("invariant") is not invariant:
                raise AssertionError(f"the engine worker (pid {joined.get('pid')}) has the invariance patches "
                                     f"{'off' if invariant else 'on'}; rl.invariant is {invariant}")
            self.prompt_logprobs([[1, 2]])
        except Exception as error:
            self.shutdown()
            raise EngineStartError(f"the vLLM server engine ({type(error).__name__}): {error}") from error

    # --- collective_rpc over the server's development endpoint ---

    def rpc(self, method: str, timeout_s: float = RPC_TIMEOUT_S, **kwargs: str) -> list:
        """``collective_rpc(method, kwargs=kwargs)`` on the engine's workers (string arguments); their results."""
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        request = _json_request(f"{self.process.url}/collective_rpc", body)
        try:
            with _opener().open(request, timeout=timeout_s + 30) as response:
                raw = response.read()
        except Exception as error:
            detail = error.read().decode(errors="replace")[:2000] if hasattr(error, "read") else ""
            raise ServerError(f"collective_rpc {method}: {type(error).__name__}: {error} {detail}".rstrip()) from error
        return json.loads(raw)["results"] if raw else []

    def _join_group(self) -> dict:
        sock = listening_socket(HOST)
        port = sock.getsockname()[1]
        init = json.dumps({"host": HOST, "port": port, "timeout_s": GROUP_TIMEOUT_S})
        ours: dict = {}

        def join() -> None:   # a daemon thread: it blocks until the worker joins (or the group's timeout)
            try:
                ours["group"] = join_weight_group(HOST, port, TRAINER_RANK, GROUP_TIMEOUT_S, listen_socket=sock)
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                ours["error"] = error

        thread = threading.Thread(target=join, name="mva-join", daemon=True)
        thread.start()
        with ThreadPoolExecutor(1, thread_name_prefix="mva-join-rpc") as pool:
            (joined,) = pool.submit(self.rpc, "mva_join_weight_group", timeout_s=JOIN_TIMEOUT_S, init=init).result()
        thread.join(JOIN_TIMEOUT_S)
        if "group" not in ours:
            raise ServerError(f"the trainer's end of the weight group did not form: {ours.get('error', 'timed out')}")
        self.group = ours["group"]
        return joined

    # --- the RolloutEngine interface ---

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int,
               sampling, stop_token_id: int) -> list[SampledCompletion]:
        """One concurrent request per prompt: request i samples from ``sampling`` (``rl.rollout.sampling_params``;
        its :data:`~.rollout.SAMPLING_FIELDS` go in the body) with ``seeds[i]`` until ``stop_token_id`` or
        ``max_new_tokens``; returns ``engine.vllm_reference.SampledCompletion`` per prompt (processed logprobs)."""
        fields = {field: getattr(sampling, field) for field in SAMPLING_FIELDS}

        def one(i: int) -> SampledCompletion:
            extra = {**fields, "seed": int(seeds[i]), "ignore_eos": False, "stop_token_ids": [int(stop_token_id)]}
            (completion,) = sample_completions_http(self.server, [prompts[i]], max_new_tokens, stagger_s=0.0,
                                                    extra=extra)
            return completion

        with ThreadPoolExecutor(len(prompts), thread_name_prefix="mva-rollout") as pool:
            return list(pool.map(one, range(len(prompts))))

    def push_weights(self, weights: EngineWeights) -> None:
        """Send ``weights`` to the engine's worker and load them there (module docstring); ServerError when
        the worker fails or answers with other counts."""
        packed = pack(weights)
        with ThreadPoolExecutor(1, thread_name_prefix="mva-push") as pool:
            loaded = pool.submit(self.rpc, "mva_receive_weights", manifest=json.dumps(packed.manifest))
            work = broadcast_buffer(self.group, packed.buffer)
            while not work.is_completed():
                if loaded.done() and loaded.exception() is not None:
                    raise ServerError(f"weight push: the worker failed: {loaded.exception()}")
                time.sleep(0.01)
            work.wait()
            (result,) = loaded.result()
        if result.get("tensors") != len(packed.manifest) or result.get("bytes") != packed.buffer.numel():
            raise ServerError(f"weight push: the worker loaded {result}, sent {len(packed.manifest)} tensors, "
                              f"{packed.buffer.numel()} bytes")

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's fp32 prompt logprobs (tokens 1..n-1) of each sequence, one request each."""
        def one(sequence: Sequence[int]) -> torch.Tensor:
            tokens = [int(t) for t in sequence]
            body = {"model": self.server.model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0,
                    "return_tokens_as_token_ids": True}
            per_position = _post_completion(self.server.url, body, RPC_TIMEOUT_S)["choices"][0]["prompt_logprobs"]
            return torch.tensor([_entry(per_position[t], tokens[t]) for t in range(1, len(tokens))],
                                dtype=torch.float32)

        with ThreadPoolExecutor(len(sequences), thread_name_prefix="mva-probe") as pool:
            return list(pool.map(one, sequences))

    def activations(self, sequence: Sequence[int], points) -> dict[str, torch.Tensor]:
        """The engine's outputs at ``points`` (``megatron.activation_divergence.TapPoint``) in one prefill of
        ``sequence``, captured by the worker extension."""
        self.rpc("mva_arm_taps", paths=json.dumps({p.name: p.engine for p in points}))
        try:
            self.prompt_logprobs([sequence])
        finally:
            (taps,) = self.rpc("mva_take_taps")
        return {name: torch.tensor(values, dtype=torch.float32) for name, values in taps.items()}

    def describe(self) -> dict:
        """What the run summary records: the kind, the server's URL, log, start time and processes."""
        return {"kind": "server", "url": self.server.url, "log": str(self.server.log_path),
                "start_seconds": round(self.server.start_seconds, 1), "api_server_pid": self.server.pid,
                "processes": {str(pid): name for pid, name in self.processes.items()}, "invariant": self.invariant}

    def shutdown(self) -> None:
        """Leave the weight group and stop the server's process group (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.group is not None:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(self.group)
                self.group = None
        finally:
            self.process.stop()
            atexit.unregister(self.shutdown)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._previous_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM as SystemExit, so the run's ``finally`` (and this engine's shutdown) runs."""
    raise SystemExit(128 + signum)


def _json_request(url: str, body: dict):
    import urllib.request

    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                  method="POST")


def _entry(position: dict, token: int) -> float:
    """The logprob of ``token`` in one ``prompt_logprobs`` position (keyed by the id, or ``token_id:N``)."""
    for key in (str(token), f"token_id:{token}"):
        if key in position:
            return float(position[key]["logprob"])
    raise ServerError(f"prompt_logprobs: token {token} not among {list(position)[:4]}")

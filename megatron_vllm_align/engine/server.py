"""vLLM as users serve it: its OpenAI-compatible server as a subprocess, and a concurrent HTTP client.

:func:`vllm_server` (or :class:`ServerProcess`, to start several concurrently) starts
``python -m vllm.entrypoints.openai.api_server --model DIR`` on 127.0.0.1 and a free port with the
caller's engine arguments and ``MVA_INVARIANT`` as asked, keeps its output in a log file, polls
``/health`` until it answers, and stops the server's whole process group when the block ends (SIGTERM,
then SIGKILL after a grace period). :func:`sample_completions_http` sends ``/v1/completions`` requests
concurrently (request ``i`` after ``i * stagger_s`` seconds; token-id prompts, ``logprobs: 1``,
``return_tokens_as_token_ids``) and returns per request the prompt, the sampled token ids and their
logprobs as :class:`~megatron_vllm_align.engine.vllm_reference.SampledCompletion`; the JSON numbers hold
the engine's fp32 values exactly. :meth:`RunningServer.assert_invariance_loaded` checks that every vLLM
process of the server (API server, engine core, worker) logged the invariance plugin's
:data:`~megatron_vllm_align.invariance.plugin.INSTALLED_MESSAGE`. Why not ``vllm serve``, start times
and thread binding: docs/engine_facts.md#the-openai-server.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch

from megatron_vllm_align.engine.vllm_reference import SampledCompletion
from megatron_vllm_align.utils.torchrun import free_port

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
DEFAULT_KV_CACHE_GIB = 1     # VLLM_CPU_KVCACHE_SPACE: unbounded, the CPU engine takes ~16 GiB
MAX_REQUESTS = 256           # sample_completions_http sends at most this many requests (one thread each)
LOG_TAIL_LINES = 40
# Variables of this process that must not reach the server: an in-process engine's switch (the server's
# engine core runs in its own process) and torchrun's rank variables.
DROPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")
_PROCESS_PREFIX = re.compile(r"^\((\w[\w-]*) pid=(\d+)\) ", re.MULTILINE)


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error; the message says which
    (with the tail of its log where there is one)."""


def server_command(model_dir: str | os.PathLike, port: int, args: Sequence[str] = ()) -> list[str]:
    """The argv that starts the OpenAI-compatible server on ``model_dir`` at ``127.0.0.1:port``, this
    interpreter, with the engine arguments ``args`` (e.g. ``["--enforce-eager", "--max-num-seqs", "16"]``)."""
    return [sys.executable, "-m", SERVER_MODULE, "--model", str(model_dir), "--host", HOST, "--port", str(port),
            *map(str, args)]


@dataclasses.dataclass(frozen=True)
class RunningServer:
    """A server started by :func:`vllm_server`: its base ``url`` (``http://127.0.0.1:PORT``), the name
    it serves the model under, the API server's ``pid``, its ``log_path`` (kept after the server
    stops), the ``command`` it runs and ``start_seconds`` (from launch to the first healthy answer)."""

    url: str
    model: str
    pid: int
    log_path: Path
    command: tuple[str, ...]
    start_seconds: float
    invariant: bool

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def invariance_pids(self) -> set[int]:
        """The pids whose invariance-plugin line is in the log (:func:`invariance_pids`)."""
        return invariance_pids(self.log_text())

    def vllm_processes(self) -> dict[int, str]:
        """``{pid: name}`` of every vLLM process that wrote a prefixed line to the log (:func:`vllm_processes`)."""
        return vllm_processes(self.log_text())

    def assert_invariance_loaded(self) -> dict[int, str]:
        """AssertionError unless the invariance plugin installed its patches in every vLLM process of the
        server (:meth:`vllm_processes`: the API server, its engine core and its worker at least); returns them."""
        processes, pids = self.vllm_processes(), self.invariance_pids()
        missing = {pid: name for pid, name in processes.items() if pid not in pids}
        assert self.pid in processes and len(processes) >= 3 and not missing, (
            f"invariance plugin: patches installed in pids {sorted(pids)}; the server's vLLM processes are "
            f"{processes} (API server {self.pid}), without it: {missing}; log {self.log_path}:\n{_tail(self.log_path)}")
        return processes

    def assert_invariance_absent(self) -> None:
        """AssertionError if the invariance plugin installed its patches in any of the server's processes."""
        pids = self.invariance_pids()
        assert not pids, f"invariance plugin installed in pids {sorted(pids)} of a server started with it off"


def invariance_pids(log_text: str) -> set[int]:
    """The pids of the processes whose invariance-plugin line
    (:data:`~megatron_vllm_align.invariance.plugin.INSTALLED_MESSAGE`) is in ``log_text``."""
    from megatron_vllm_align.invariance.plugin import INSTALLED_MESSAGE

    found = re.findall(re.escape(INSTALLED_MESSAGE) + r" \(pid (\d+),", log_text)
    return {int(pid) for pid in found}


def vllm_processes(log_text: str) -> dict[int, str]:
    """``{pid: name}`` of every vLLM process that wrote a prefixed line to ``log_text`` (``(APIServer pid=N)``,
    ``(EngineCore pid=N)``, ``(VllmWorker-0 pid=N)``, ...; a process that logs under two names: the first)."""
    found: dict[int, str] = {}
    for name, pid in _PROCESS_PREFIX.findall(log_text):
        found.setdefault(int(pid), name)
    return found


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(log unreadable: {error})"


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))   # 127.0.0.1 only: never a proxy


def _check_local(url: str) -> None:
    if urlsplit(url).hostname != HOST:
        raise ValueError(f"only servers on {HOST} are driven here, got {url!r}")


def _get_json(url: str, timeout_s: float):
    with _opener().open(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def omp_threads_on_all_cpus() -> dict[str, str]:
    """Environment that puts a CPU engine's OpenMP threads on every CPU this process may use
    (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's automatic binding leaves a core free, so on a 2-core machine
    it runs one thread, and one thread never splits a request's KV range: the attention kernel's
    batch dependence, docs/invariance.md), waiting passively (``OMP_WAIT_POLICY``: spinning threads
    slow a loaded machine down; the computation is the same)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
            "OMP_WAIT_POLICY": "PASSIVE"}


def server_env(invariant: bool, kv_cache_gib: int | None = DEFAULT_KV_CACHE_GIB,
               env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this process's, without :data:`DROPPED_ENV`, with ``MVA_INVARIANT``
    ``"1"`` or ``"0"``, ``VLLM_CPU_KVCACHE_SPACE`` = ``kv_cache_gib`` (unless None) and ``env`` on top."""
    result = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    result["MVA_INVARIANT"] = "1" if invariant else "0"
    if kv_cache_gib is not None:
        result["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return {**result, **(env or {})}


def _stop(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the server's process group, SIGKILL to it after ``grace_s`` if the server still runs,
    then any member left (the group outlives its leader when a child lingers)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:   # children that outlive the API server (the engine core exiting)
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


class ServerProcess:
    """A vLLM OpenAI-compatible server launched on construction (not waited for): :meth:`wait_healthy`
    returns the :class:`RunningServer` once ``/health`` answers, :meth:`stop` (or leaving the ``with``
    block) stops its process group. Launching several before waiting for any starts them concurrently.

    ``args``: the server's engine arguments after ``--model``, ``--host`` and ``--port`` (which this
    sets); with ``invariant`` pass ``--enforce-eager`` (the plugin refuses a compiled engine).
    ``log_path``: the server's stdout and stderr (truncated first, kept afterwards). ``kv_cache_gib``
    and ``env``: :func:`server_env`."""

    def __init__(self, model_dir: str | os.PathLike, args: Sequence[str] = (), *, log_path: str | os.PathLike,
                 invariant: bool = False, kv_cache_gib: int | None = DEFAULT_KV_CACHE_GIB,
                 env: Mapping[str, str] | None = None) -> None:
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.invariant = invariant
        self.url = f"http://{HOST}:{free_port()}"
        self.command = server_command(model_dir, int(self.url.rsplit(":", 1)[1]), args)
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=server_env(invariant, kv_cache_gib, env))

    def _failure(self, what: str) -> ServerError:
        return ServerError(f"vLLM server {what} ({' '.join(self.command)}); log {self.log_path}:\n"
                           f"{_tail(self.log_path)}")

    def wait_healthy(self, timeout_s: float = 600.0) -> RunningServer:
        """Poll ``/health`` until it answers 200; ServerError with the log's tail when the process exits
        first or ``timeout_s`` (from the launch) passes (the server is stopped then)."""
        try:
            while True:
                if self.process.poll() is not None:
                    raise self._failure(f"exited with status {self.process.returncode} before it was healthy")
                if time.monotonic() - self.started > timeout_s:
                    raise self._failure(f"not healthy within {timeout_s:.0f} s")
                try:
                    with _opener().open(f"{self.url}/health", timeout=5) as response:
                        if response.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                time.sleep(0.5)
            start_seconds = time.monotonic() - self.started
            model = _get_json(f"{self.url}/v1/models", timeout_s=30)["data"][0]["id"]
        except BaseException:
            self.stop()
            raise
        return RunningServer(self.url, model, self.process.pid, self.log_path, tuple(self.command), start_seconds,
                             self.invariant)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server's process group (idempotent): :func:`_stop`."""
        _stop(self.process, grace_s)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def vllm_server(model_dir: str | os.PathLike, args: Sequence[str] = (), *, log_path: str | os.PathLike,
                invariant: bool = False, kv_cache_gib: int | None = DEFAULT_KV_CACHE_GIB,
                env: Mapping[str, str] | None = None, start_timeout_s: float = 600.0) -> Iterator[RunningServer]:
    """Run the OpenAI-compatible vLLM server on ``model_dir`` for the block, healthy when the block
    starts and stopped when it ends however it ends (:class:`ServerProcess`, module docstring)."""
    with ServerProcess(model_dir, args, log_path=log_path, invariant=invariant, kv_cache_gib=kv_cache_gib,
                       env=env) as server:
        yield server.wait_healthy(start_timeout_s)


def _post_completion(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with _opener().open(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise ServerError(f"POST {url}/v1/completions: HTTP {error.code}: {detail}") from error


def parse_completion(prompt: Sequence[int], response: dict) -> SampledCompletion:
    """The :class:`SampledCompletion` of one ``/v1/completions`` answer to a ``return_tokens_as_token_ids``
    request with ``logprobs`` (ServerError when a token is not ``token_id:N`` or a logprob is missing)."""
    choice = response["choices"][0]
    logprobs = choice.get("logprobs") or {}
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    ids = []
    for token in tokens:
        match = _TOKEN_ID.match(token)
        if match is None:
            raise ServerError(f"completion token {token!r} is not 'token_id:N' (return_tokens_as_token_ids ignored?)")
        ids.append(int(match.group(1)))
    if len(values) != len(ids) or any(v is None for v in values):
        raise ServerError(f"completion logprobs: {len(values)} values ({values[:4]}...) for {len(ids)} tokens")
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return SampledCompletion(tuple(int(t) for t in prompt), tuple(ids), torch.tensor(values, dtype=torch.float32),
                             num_cached_tokens=int(details.get("cached_tokens") or 0))


def served_models(url: str, timeout_s: float = 30.0) -> list[dict]:
    """``/v1/models`` of the server at ``url`` (on 127.0.0.1): one entry per served model, with vLLM's
    ``id`` (the served name), ``max_model_len`` and ``root`` (the path or name it loaded). ServerError
    naming the URL when it cannot be reached or answers something else."""
    url = str(url).rstrip("/")
    _check_local(url)
    try:
        data = _get_json(f"{url}/v1/models", timeout_s)["data"]
    except urllib.error.HTTPError as error:
        raise ServerError(f"GET {url}/v1/models: HTTP {error.code}: "
                          f"{error.read().decode(errors='replace')[:500]}") from error
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as error:
        raise ServerError(f"GET {url}/v1/models: {type(error).__name__}: {error}") from error
    if not isinstance(data, list) or not data or not all(isinstance(entry, dict) and "id" in entry for entry in data):
        raise ServerError(f"GET {url}/v1/models: no served model in the answer ({str(data)[:300]})")
    return data


def _post_concurrently(url: str, bodies: Sequence[dict], stagger_s: float, timeout_s: float, parse,
                       describe) -> list:
    """POST each body to ``/v1/completions`` in its own thread, body ``i`` leaving ``i * stagger_s`` s after
    the first; ``parse(i, response)`` of each answer, in order. ServerError naming ``describe(i)`` when a
    request fails (the requests not yet sent are not sent)."""
    if not 0 < len(bodies) <= MAX_REQUESTS:
        raise ValueError(f"1 to {MAX_REQUESTS} requests, got {len(bodies)}")
    start = time.monotonic()
    deadline = start + timeout_s
    failed = threading.Event()

    def send(i: int):
        delay = start + i * stagger_s - time.monotonic()
        if delay > 0 and failed.wait(delay):
            raise ServerError(f"request {i} not sent: an earlier request failed")
        try:
            return parse(i, _post_completion(url, bodies[i], max(1.0, deadline - time.monotonic())))
        except Exception as error:
            failed.set()
            raise ServerError(f"request {i} ({describe(i)}): {type(error).__name__}: {error}") from error

    with ThreadPoolExecutor(max_workers=len(bodies), thread_name_prefix="mva-http") as pool:
        futures = [pool.submit(send, i) for i in range(len(bodies))]
        return [future.result() for future in futures]


def _target(server: RunningServer | str, model: str | None, caller: str) -> tuple[str, str]:
    url = server.url if isinstance(server, RunningServer) else str(server).rstrip("/")
    model = model or (server.model if isinstance(server, RunningServer) else None)
    _check_local(url)
    if model is None:
        raise ValueError(f"{caller}: name the served model (model=...) with a bare URL")
    return url, model


def sample_completions_http(server: RunningServer | str, prompts: Sequence[Sequence[int]],
                            max_tokens: int | Sequence[int], *, model: str | None = None, stagger_s: float = 0.1,
                            temperature: float = 1.0, timeout_s: float = 600.0,
                            extra: Mapping[str, object] | None = None) -> list[SampledCompletion]:
    """Send one ``/v1/completions`` request per prompt, concurrently (one thread each), request ``i``
    leaving ``i * stagger_s`` s after the first; return what the server sampled, in prompt order.

    ``server``: a :class:`RunningServer` or a base URL on 127.0.0.1 (then ``model`` names the served
    model). ``max_tokens``: one for all or one per prompt. Each request asks for ``logprobs: 1``,
    ``return_tokens_as_token_ids: true``, ``ignore_eos: true`` (exactly ``max_tokens`` tokens) and
    ``temperature``; ``extra`` adds or replaces body fields. At most :data:`MAX_REQUESTS` requests;
    every request must answer within ``timeout_s`` of the first one's departure (ServerError otherwise,
    naming the request)."""
    url, model = _target(server, model, "sample_completions_http")
    if not 0 < len(prompts) <= MAX_REQUESTS:
        raise ValueError(f"sample_completions_http: 1 to {MAX_REQUESTS} prompts, got {len(prompts)}")
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"sample_completions_http: {len(limits)} max_tokens for {len(prompts)} prompts")
    bodies = [{"model": model, "prompt": [int(t) for t in prompt], "max_tokens": int(limit),
               "temperature": temperature, "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True,
               **(extra or {})} for prompt, limit in zip(prompts, limits)]
    return _post_concurrently(url, bodies, stagger_s, timeout_s, lambda i, answer: parse_completion(prompts[i], answer),
                              lambda i: f"prompt of {len(prompts[i])} tokens, max_tokens {limits[i]}")


def parse_prompt_logprobs(prompt: Sequence[int], response: dict) -> torch.Tensor:
    """The fp32 logprobs of prompt tokens 1..n-1 in one ``/v1/completions`` answer to a request with
    ``prompt_logprobs`` (vLLM's extension: per position a ``{token id: {"logprob": ...}}`` object, None for
    the first). ServerError when a position lacks its prompt token."""
    per_position = response["choices"][0].get("prompt_logprobs")
    if not isinstance(per_position, list) or len(per_position) != len(prompt):
        raise ServerError(f"prompt_logprobs: {None if per_position is None else len(per_position)} positions for a "
                          f"prompt of {len(prompt)} tokens (does the server support prompt_logprobs?)")
    values = []
    for t in range(1, len(prompt)):
        entry = (per_position[t] or {}).get(str(int(prompt[t])))
        if not isinstance(entry, dict) or entry.get("logprob") is None:
            raise ServerError(f"prompt_logprobs: position {t} has no logprob of prompt token {int(prompt[t])}")
        values.append(entry["logprob"])
    return torch.tensor(values, dtype=torch.float32)


def prompt_logprobs_http(server: RunningServer | str, prompts: Sequence[Sequence[int]], *, model: str | None = None,
                         timeout_s: float = 600.0) -> list[torch.Tensor]:
    """For each token-id prompt, the server's fp32 logprobs of tokens 1..n-1 (n - 1 values, as
    :func:`~megatron_vllm_align.engine.vllm_reference.prompt_logprobs` returns an in-process engine's):
    one request per prompt (``prompt_logprobs: 0``, ``max_tokens: 1``), all sent at once. The server
    clamps a logprob of -inf to -9999 in its answer."""
    url, model = _target(server, model, "prompt_logprobs_http")
    bodies = [{"model": model, "prompt": [int(t) for t in prompt], "max_tokens": 1, "temperature": 1.0,
               "prompt_logprobs": 0, "return_tokens_as_token_ids": True} for prompt in prompts]
    return _post_concurrently(url, bodies, 0.0, timeout_s, lambda i, answer: parse_prompt_logprobs(prompts[i], answer),
                              lambda i: f"prompt logprobs of a prompt of {len(prompts[i])} tokens")


__all__ = ["DEFAULT_KV_CACHE_GIB", "MAX_REQUESTS", "RunningServer", "ServerError", "ServerProcess", "invariance_pids",
           "omp_threads_on_all_cpus", "parse_completion", "parse_prompt_logprobs", "prompt_logprobs_http",
           "sample_completions_http", "served_models", "server_command", "server_env", "vllm_processes", "vllm_server"]

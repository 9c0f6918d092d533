"""The aligned trainer's logprobs at tensor parallel size T, computed by T ``torchrun`` processes.

:func:`tensor_parallel_logprobs` writes the requests to a file, launches
``torchrun --nproc-per-node T -m megatron_vllm_align.megatron.parallel_logprobs`` (gloo on CPU, NCCL
with CUDA) and reads the result back. Each rank (:func:`main`) sets up Megatron's parallel state
with TP = T (``expert_parallel``: and EP = T, expert TP 1, the engine's ``enable_expert_parallel``
layout of an MoE model, :mod:`.vllm_moe`), builds the vLLM-forward model from the checkpoint (its shard,
:mod:`.vllm_tensor_parallel`) and computes, as :func:`~.logprobs.token_logprobs` and
:func:`~.logprobs.completion_logprobs` do in one process, the prompt logprobs of ``prompts`` and the
logprobs of ``sampled_tokens`` after ``sampled_prompts``; rank 0 writes them (atomically). Every
rank holds the same full-vocabulary logprobs (the output layer gathers its shards).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_vllm_align.utils.atomic_io import atomic_write
from megatron_vllm_align.utils.torchrun import torchrun_command

LAUNCH_TIMEOUT_S = 1200


class ParallelLogprobsError(RuntimeError):
    """The torchrun launch failed; the message holds the end of its output."""



def tensor_parallel_logprobs(model_dir: str | os.PathLike, tensor_parallel_size: int,
                             prompts: Sequence[Sequence[int]], sampled_prompts: Sequence[Sequence[int]],
                             sampled_tokens: Sequence[Sequence[int]], quantization: str | None = None,
                             layouts: Sequence[str] = ("packed",), timeout_s: float = LAUNCH_TIMEOUT_S,
                             expert_parallel: bool = False) -> dict[str, list[torch.Tensor]]:
    """``{"prompt": [fp32 [n_i - 1]], "sampled": [fp32 [len(tokens_i)]], "sampled.<layout>": ...}`` from the
    aligned trainer at TP = ``tensor_parallel_size`` (module docstring): ``sampled`` in the first of
    ``layouts`` (:data:`~.logprobs.SAMPLED_LAYOUTS`), one more entry per further layout.
    ParallelLogprobsError naming the failure."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    if len(sampled_prompts) != len(sampled_tokens):
        raise ValueError(f"{len(sampled_prompts)} sampled prompts but {len(sampled_tokens)} token lists")
    threads = max(1, len(os.sched_getaffinity(0)) // tensor_parallel_size)
    with tempfile.TemporaryDirectory(prefix="mva_tp_logprobs_") as work:
        requests, result = Path(work) / "requests.pt", Path(work) / "logprobs.pt"
        torch.save({"prompts": [list(p) for p in prompts], "sampled_prompts": [list(p) for p in sampled_prompts],
                    "sampled_tokens": [list(t) for t in sampled_tokens]}, requests)
        command = torchrun_command(tensor_parallel_size, "-m", "megatron_vllm_align.megatron.parallel_logprobs",
                                   "--model", str(model_dir), "--requests", str(requests), "--out", str(result),
                                   "--layouts", *layouts,
                                   *([] if quantization is None else ["--quantization", quantization]),
                                   *(["--expert-parallel"] if expert_parallel else []))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if completed.returncode != 0 or not result.is_file():
            raise ParallelLogprobsError(f"torchrun (TP={tensor_parallel_size}) exited {completed.returncode}:\n"
                                        f"{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
        return torch.load(result)


def main(argv: list[str] | None = None) -> None:
    """One torchrun rank (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--layouts", nargs="+", default=["packed"])
    parser.add_argument("--expert-parallel", action="store_true")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import enable_cpu_compat, seed_cpu_rng
    from megatron_vllm_align.megatron.logprobs import (
        completion_logprobs,
        token_logprobs,
    )

    enable_cpu_compat()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world,
        **({"expert_model_parallel_size": world, "expert_tensor_parallel_size": 1} if args.expert_parallel else {}))
    seed_cpu_rng(1234)
    requests = torch.load(args.requests)
    model = build_gpt_from_hf(args.model, align=True, quantization=args.quantization)
    with torch.no_grad():
        logprobs = {"prompt": token_logprobs(model, requests["prompts"])}
        for i, layout in enumerate(args.layouts):
            logprobs["sampled" if i == 0 else f"sampled.{layout}"] = completion_logprobs(
                model, requests["sampled_prompts"], requests["sampled_tokens"], layout=layout)
    if dist.get_rank() == 0:
        atomic_write(args.out, lambda handle: torch.save(logprobs, handle), binary=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

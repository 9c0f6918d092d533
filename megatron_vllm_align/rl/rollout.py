"""Rollouts from the run's in-process vLLM engine, shared by every data-parallel rank, and the live
weight sync into that engine (the engine out of process, ``rl.engine: server``: :mod:`.server_engine`).

Rank 0 hosts the engine (:class:`RolloutEngine`); it samples the step's completions and broadcasts
them (:func:`broadcast_rollouts`), so every rank trains on the same rollouts, each on its slice.
After each optimizer step rank 0 pushes the new parameters into the running engine in place through
vLLM's own reload path (``collective_rpc("reload_weights")``), no restart, so the engine deploys the
values the trainer's forward deploys. Fused-MoE experts of the aligned model are pushed as the
trainer's deployed values, the native model's in checkpoint format; why:
docs/moe_facts.md#reloading-fused-moe-experts-into-a-running-engine.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.engine.vllm_reference import prompt_logprobs as engine_prompt_logprobs
from megatron_vllm_align.megatron.hf_checkpoint import HFDenseConfig
from megatron_vllm_align.megatron.hf_export import hf_state_dict
from megatron_vllm_align.rl.weight_sync import EXTENSION, pack


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One sampled completion: prompt ``problem`` (index into the train split), sample ``sample`` of
    its group, the request ``seed``, the prompt and completion token ids, the engine's fp32 logprob
    of every completion token under the distribution it sampled from (processed logprobs,
    :func:`sampling_params`), the reward, the group-normalised advantage and, for an MoE model,
    the experts the engine routed every fed-in token to (int32 [n - 1, moe_layers, top_k], replayed
    into the trainer's routers; None for a dense model), and the engine's raw logprobs (its prompt
    logprobs of prompt + completion) of the completion tokens."""

    problem: int
    sample: int
    seed: int
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    engine_logprobs: tuple[float, ...]
    reward: float
    advantage: float
    routed_experts: torch.Tensor | None = None
    engine_raw_logprobs: tuple[float, ...] = ()

    @property
    def tokens(self) -> torch.Tensor:
        """Prompt then completion, int64 [n]."""
        return torch.tensor([*self.prompt, *self.completion], dtype=torch.long)

    @property
    def loss_mask(self) -> torch.Tensor:
        """bool [n - 1]: True where the next token is a completion token (the sampled tokens)."""
        mask = torch.zeros(len(self.prompt) + len(self.completion) - 1, dtype=torch.bool)
        mask[len(self.prompt) - 1:] = True
        return mask

    @property
    def engine_logprob_tensor(self) -> torch.Tensor:
        return torch.tensor(self.engine_logprobs, dtype=torch.float32)

    @property
    def engine_raw_logprob_tensor(self) -> torch.Tensor:
        return torch.tensor(self.engine_raw_logprobs, dtype=torch.float32)


# The rl.sampling fields (train.config.SamplingSection), vllm.SamplingParams fields of the same names.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")


def sampling_params(section):
    """The run's one ``vllm.SamplingParams`` from ``rl.sampling`` (``train.config.SamplingSection``):
    the distribution the engine samples every rollout from and the trainer's processed logprobs are
    of. ValueError naming the field for a value vLLM refuses, for what processed logprobs refuse
    (``check_sampling_params``) and for a value vLLM replaces (a temperature below 0.01 becomes 0.01),
    which the run would record wrongly."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from megatron_vllm_align.ops.processed_logprob import check_sampling_params

    try:
        params = SamplingParams(**{field: getattr(section, field) for field in SAMPLING_FIELDS})
    except VLLMValidationError as error:   # vLLM's own range checks; the message names the parameter
        raise ValueError(f"SamplingParams: {error}") from error
    check_sampling_params(params)
    for field in SAMPLING_FIELDS:
        if getattr(params, field) != getattr(section, field):
            raise ValueError(f"SamplingParams.{field}: vLLM replaces {getattr(section, field)!r} by "
                             f"{getattr(params, field)!r}; set a value it keeps")
    return params


def request_params(sampling, seed: int, max_new_tokens: int, stop_token_id: int):
    """One rollout request's ``vllm.SamplingParams``: ``sampling``'s fields (:data:`SAMPLING_FIELDS`)
    with the request's seed, ``max_new_tokens``, the stop token and the sampled token's logprob."""
    from vllm import SamplingParams

    return SamplingParams(**{field: getattr(sampling, field) for field in SAMPLING_FIELDS}, max_tokens=max_new_tokens,
                          logprobs=0, seed=seed, stop_token_ids=[stop_token_id])


def broadcast_rollouts(rollouts: list[Rollout] | None) -> list[Rollout]:
    """Rank 0's ``rollouts`` on every rank (collective; other ranks pass None)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(rollouts or [])
    box = [rollouts]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclasses.dataclass(frozen=True)
class EngineWeights:
    """What one push loads: ``checkpoint`` (Hugging Face names and layout, processed by the engine)
    and ``deployed`` (engine parameter names, values already processed: the aligned model's fused-MoE
    experts)."""

    checkpoint: dict[str, torch.Tensor]
    deployed: dict[str, torch.Tensor]

    def without(self, prefix: str) -> EngineWeights:
        """These weights less every tensor whose engine name starts with ``prefix``."""
        return EngineWeights({k: v for k, v in self.checkpoint.items() if not k.startswith(prefix)},
                             {k: v for k, v in self.deployed.items() if not k.startswith(prefix)})


def reload_calls(weights: EngineWeights) -> list[dict]:
    """The keyword arguments of each vLLM worker ``reload_weights`` call that loads ``weights``, in order:
    the checkpoint-format tensors (loaded and then processed by the model), then the deployed ones (copied
    as they are), when there are any. The in-process engine and the out-of-process engine's worker
    (:mod:`.weight_sync`) both load a push this way."""
    calls = [{"weights_iterator": iter(list(weights.checkpoint.items())), "is_checkpoint_format": True}]
    if weights.deployed:
        calls.append({"weights_iterator": iter(list(weights.deployed.items())), "is_checkpoint_format": False})
    return calls


def engine_weights(model: nn.Module, hf_config: HFDenseConfig) -> EngineWeights:
    """The model's parameters for the engine (module docstring): every parameter in checkpoint format,
    except the aligned MoE layers' experts, which are their deployed values."""
    from megatron_vllm_align.megatron.vllm_moe import VllmMoELayer

    checkpoint = hf_state_dict(model, hf_config)
    deployed = {}
    for i, layer in enumerate(model.decoder.layers):
        if isinstance(layer.mlp, VllmMoELayer):
            shadow = layer.mlp.experts.kernel.runner.routed_experts
            prefix = f"model.layers.{i}.mlp.experts."
            deployed[prefix + "routed_experts.w13_weight"] = shadow.w13_weight.detach()
            deployed[prefix + "routed_experts.w2_weight"] = shadow.w2_weight.detach()
            checkpoint = {k: v for k, v in checkpoint.items() if not k.startswith(prefix)}
    return EngineWeights(checkpoint, deployed)


class RolloutEngine:
    """The run's vLLM engine on ``checkpoint_dir`` (start it on one rank; :meth:`shutdown` stops it).

    Raises ``EngineStartError`` when vLLM cannot serve the model: when it does not start, or when a
    one-token request fails (some configurations, e.g. a head size the CPU attention has no kernel
    for, start and fail only at the first step)."""

    def __init__(self, checkpoint_dir: str | Path, hf_config: HFDenseConfig, kv_cache_mb: int, seed: int,
                 tensor_parallel_size: int = 1) -> None:
        from megatron_vllm_align.engine import EngineStartError

        self.hf_config = hf_config
        self.tensor_parallel_size = tensor_parallel_size   # > 1: the model lives in that many worker processes
        workers = {"worker_extension_cls": EXTENSION} if tensor_parallel_size > 1 else {}
        self.llm = start_reference_engine(checkpoint_dir, ReferenceEngineConfig(
            kv_cache_bytes=kv_cache_mb * 1024 * 1024, seed=seed, return_routed_experts=hf_config.moe is not None,
            logprobs_mode="processed_logprobs", tensor_parallel_size=tensor_parallel_size, engine_args=workers))
        try:
            engine_prompt_logprobs(self.llm, [[1, 2]])
        except Exception as error:
            self.shutdown()
            raise EngineStartError(f"the engine started but cannot run the model: {type(error).__name__}: "
                                   f"{error}") from error

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int,
               sampling, stop_token_id: int):
        """One ``generate`` call: request i samples from ``sampling`` (:func:`sampling_params`) with
        ``seeds[i]`` until ``stop_token_id`` or ``max_new_tokens``; returns
        ``engine.vllm_reference.SampledCompletion`` per prompt (processed logprobs)."""
        params = [request_params(sampling, seed, max_new_tokens, stop_token_id) for seed in seeds]
        return sample_completions(self.llm, prompts, params)

    def push_weights(self, weights: EngineWeights) -> None:
        """Load ``weights`` into the running engine in place (module docstring); at tensor parallel size > 1
        packed (``weight_sync.pack``) into every worker, which keeps its shard. RuntimeError when a worker
        loaded other counts."""
        if self.tensor_parallel_size == 1:
            for kwargs in reload_calls(weights):
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            return
        packed = pack(weights)
        for result in self.llm.collective_rpc("mva_load_packed", args=(json.dumps(packed.manifest), packed.buffer)):
            if result.get("tensors") != len(packed.manifest) or result.get("bytes") != packed.buffer.numel():
                raise RuntimeError(f"weight push: a worker loaded {result}, sent {len(packed.manifest)} tensors, "
                                   f"{packed.buffer.numel()} bytes")

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's prompt logprobs (tokens 1..n-1) of each sequence."""
        return engine_prompt_logprobs(self.llm, sequences)

    def activations(self, sequence: Sequence[int], points) -> dict[str, torch.Tensor]:
        """The engine's outputs at ``points`` (``megatron.activation_divergence.TapPoint``) in one prefill of
        ``sequence``; at tensor parallel size > 1 tensor-parallel rank 0's (captured by its worker, the shard
        the trainer's tensor-parallel rank 0 computes)."""
        from megatron_vllm_align.megatron.activation_divergence import engine_activations

        if self.tensor_parallel_size == 1:
            return engine_activations(self.llm, sequence, points)
        self.llm.collective_rpc("mva_arm_taps", args=(json.dumps({p.name: p.engine for p in points}),))
        try:
            engine_prompt_logprobs(self.llm, [list(sequence)])
        finally:
            taps = self.llm.collective_rpc("mva_take_taps")[0]
        return {name: torch.tensor(values, dtype=torch.float32) for name, values in taps.items()}

    def describe(self) -> dict:
        """What the run summary records about the engine."""
        return {"kind": "in_process", "tensor_parallel_size": self.tensor_parallel_size}

    def shutdown(self) -> None:
        shutdown_engine(self.llm)


def replayed_logprobs(model: nn.Module, sequences: Sequence[Sequence[int]],
                      routed_experts: Sequence[torch.Tensor] | None, processed=None) -> list[torch.Tensor]:
    """``megatron.logprobs.token_logprobs`` of ``sequences`` (one packed forward, autograd kept; with
    ``processed``, per sequence ``(first, SamplingParams)``, the processed logprobs of tokens
    first..n-1); with ``routed_experts`` (per sequence, int [n - 1 or n, moe_layers, top_k]) the MoE
    layers route by the engine's choice (``router_replay``)."""
    from megatron_vllm_align.megatron.logprobs import replay_rows, token_logprobs
    from megatron_vllm_align.megatron.vllm_moe import router_replay

    if routed_experts is None:
        return token_logprobs(model, sequences, processed)
    rows = [replay_rows(ids, len(seq), i) for i, (ids, seq) in enumerate(zip(routed_experts, sequences, strict=True))]
    with router_replay(model, torch.cat(rows).unbind(1)):
        return token_logprobs(model, sequences, processed)

"""Read a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE checkpoint and convert it to
Megatron-Core's layout.

Reading: ``config.json`` into :class:`HFDenseConfig` (transformers 4.x ``rope_theta`` or 5.x
``rope_parameters``); weights with ``safetensors`` directly (one ``model.safetensors`` or the shards of
``model.safetensors.index.json``). :func:`megatron_state_dict_from_hf` gives the parameter names of a
GPTModel built with Megatron's local spec (the vLLM spec keeps them; ``linear_qkv`` rows grouped per KV
head, ``linear_fc1`` = [gate; up], MoE layers in the local MoE spec's names);
:func:`hf_tensors_from_megatron` is its exact inverse (weight export, live engine weight sync); both read
one name table, :func:`name_table`. Every tensor's shape is checked against the config; a mismatch names
the tensor. Name table:
docs/megatron_facts.md#hugging-face-names-to-megatron-core-names-megatronhf_checkpointpy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


class HFCheckpointError(ValueError):
    """The checkpoint cannot be converted: unsupported config, or tensors that do not fit it."""


@dataclasses.dataclass(frozen=True)
class HFMoEConfig:
    """The MoE fields of a Qwen3-MoE / Qwen2-MoE ``config.json``.

    top_k: experts per token (``num_experts_per_tok``); norm_topk_prob: the k weights are
    renormalised to sum to 1; sparse_layers: indices of the layers whose MLP is the MoE block;
    shared_expert_intermediate_size: FFN size of the sigmoid-gated shared expert (Qwen2-MoE), 0 if none.
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0


@dataclasses.dataclass(frozen=True)
class HFDenseConfig:
    """The fields of a dense decoder's ``config.json`` that decide the Megatron model.

    qkv_bias: q/k/v projections carry biases (always for Qwen2). qk_norm: per-head RMSNorm on
    q and k before RoPE (Qwen3). head_dim is explicit or hidden_size // num_attention_heads.
    rope_scaling: None for plain RoPE, else the scaling entries (``rope_type`` one of
    :data:`SCALED_ROPE_TYPES`, ``factor``, ...), as vLLM's ``get_rope`` reads them.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: HFMoEConfig | None = None
    rope_scaling: dict | None = None


def _field(raw: dict, key: str, default=None):
    """raw[key], else `default`; a missing (or null) field without a default is an error."""
    if raw.get(key) is not None:
        return raw[key]
    if default is None:
        raise HFCheckpointError(f"config.json: required field {key!r} is missing")
    return default


# RoPE scalings of the supported families that vLLM's get_rope implements (Llama 3.x: llama3; others
# by configuration). Every other type is refused by name.
SCALED_ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn")


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(base, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling``
    (4.x); scaling is None for plain RoPE."""
    params = raw.get("rope_parameters") or {}
    scaling = {**(raw.get("rope_scaling") or {}), **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ("default", *SCALED_ROPE_TYPES):
        raise HFCheckpointError(f"config.json: rope type {rope_type!r} is not supported (supported: default, "
                                f"{', '.join(SCALED_ROPE_TYPES)})")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise HFCheckpointError("config.json: no rope_theta (neither in rope_parameters nor top level)")
    return float(theta), None if rope_type == "default" else {"rope_type": rope_type, **scaling}


def _moe_config(raw: dict, num_layers: int) -> HFMoEConfig:
    """The MoE fields of a qwen3_moe / qwen2_moe ``config.json``; sparse layers chosen as vLLM's
    Qwen3-MoE / Qwen2-MoE do. A shared expert is accepted on qwen2_moe only (HF's Qwen3-MoE has none)."""
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    if shared and raw["model_type"] != "qwen2_moe":
        raise HFCheckpointError(f"config.json: shared_expert_intermediate_size on {raw['model_type']} is not "
                                "supported (shared experts: qwen2_moe)")
    num_experts = int(_field(raw, "num_experts", raw.get("num_local_experts")))
    top_k = int(_field(raw, "num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise HFCheckpointError(f"config.json: num_experts_per_tok={top_k} must lie in [1, num_experts={num_experts}]")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return HFMoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=int(_field(raw, "moe_intermediate_size")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=shared,
    )


def hf_config_from_dict(raw: dict) -> HFDenseConfig:
    """Validate a parsed ``config.json`` and reduce it to :class:`HFDenseConfig`."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"config.json: model_type {model_type!r} (architectures {raw.get('architectures')}) is not supported; "
            f"supported: {SUPPORTED_MODEL_TYPES}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("mlp_bias", False):
        raise HFCheckpointError("config.json: mlp_bias=true is not supported")
    if raw.get("use_sliding_window", False):
        raise HFCheckpointError("config.json: use_sliding_window=true is not supported")
    if model_type not in ("qwen2", "qwen2_moe") and raw.get("attention_bias", False):
        raise HFCheckpointError(
            f"config.json: attention_bias=true on {model_type} also biases o_proj, which is not supported"
        )
    hidden_size = int(_field(raw, "hidden_size"))
    num_heads = int(_field(raw, "num_attention_heads"))
    num_kv_heads = int(_field(raw, "num_key_value_heads", num_heads))
    num_layers = int(_field(raw, "num_hidden_layers"))
    if num_heads % num_kv_heads != 0:
        raise HFCheckpointError(
            f"config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    return HFDenseConfig(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=int(_field(raw, "intermediate_size")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=int(_field(raw, "head_dim", hidden_size // num_heads)),
        vocab_size=int(_field(raw, "vocab_size")),
        max_position_embeddings=int(_field(raw, "max_position_embeddings")),
        rope_theta=_rope(raw)[0],
        rope_scaling=_rope(raw)[1],
        rms_norm_eps=float(_field(raw, "rms_norm_eps")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_moe_config(raw, num_layers) if model_type in MOE_MODEL_TYPES else None,
    )


def read_hf_config(checkpoint_dir: str | os.PathLike) -> HFDenseConfig:
    """Parse and validate ``checkpoint_dir/config.json``."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{path}: not found (not a Hugging Face checkpoint directory)")
    return hf_config_from_dict(json.loads(path.read_text()))


def read_hf_tensors(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint's safetensors file(s), by name, in their stored dtype."""
    from safetensors.torch import load_file

    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (checkpoint_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFCheckpointError(f"{checkpoint_dir}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(checkpoint_dir / file).items():
            if name in tensors:
                raise HFCheckpointError(f"{checkpoint_dir}: tensor {name!r} appears in more than one shard")
            tensors[name] = tensor
    return tensors


class _TensorSource:
    """Hands out checkpoint tensors by name with a shape check, and reports what was never used."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._tensors:
            raise HFCheckpointError(f"checkpoint lacks tensor {name!r} (expected shape {shape})")
        tensor = self._tensors.pop(name)
        if tuple(tensor.shape) != tuple(shape):
            raise HFCheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies {tuple(shape)}: "
                "the checkpoint does not fit its config"
            )
        return tensor

    def has(self, name: str) -> bool:
        return name in self._tensors

    def check_all_used(self) -> None:
        leftover = sorted(name for name in self._tensors if not name.endswith("rotary_emb.inv_freq"))
        if leftover:
            raise HFCheckpointError(f"checkpoint has tensors the converter does not know: {leftover[:8]}")


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Concatenate q/k/v rows per query group, Megatron's linear_qkv layout (weights or biases).

    q has num_heads * head_dim rows, k and v num_kv_heads * head_dim rows each; trailing
    dimensions (the input features of a weight) are kept.
    """
    trailing = q.shape[1:]
    q_groups = q.reshape(num_kv_heads, -1, *trailing)
    k_groups = k.reshape(num_kv_heads, -1, *trailing)
    v_groups = v.reshape(num_kv_heads, -1, *trailing)
    return torch.cat([q_groups, k_groups, v_groups], dim=1).reshape(-1, *trailing)


@dataclasses.dataclass(frozen=True)
class NameEntry:
    """One row of the HF <-> Megatron name table: the Megatron parameter ``megatron`` is the HF tensors
    ``hf`` (shapes ``hf_shapes``) joined by ``join``: ``"copy"`` (one tensor, unchanged), ``"rows"``
    (rows stacked in order: ``linear_fc1`` = [gate; up]) or ``"qkv"`` (q, k, v rows grouped per KV head,
    :func:`interleave_qkv`)."""

    megatron: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    join: str = "copy"

    @property
    def megatron_shape(self) -> tuple[int, ...]:
        return (sum(shape[0] for shape in self.hf_shapes), *self.hf_shapes[0][1:])


def _copy(megatron: str, hf: str, shape: tuple[int, ...]) -> NameEntry:
    return NameEntry(megatron, (hf,), (shape,))


def _gated_mlp(hf: str, mg: str, ffn: int, hidden: int) -> list[NameEntry]:
    """Megatron ``linear_fc1`` ([gate; up]) and ``linear_fc2`` of the HF gated MLP under prefix ``hf``."""
    return [NameEntry(mg + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                      ((ffn, hidden), (ffn, hidden)), "rows"),
            _copy(mg + "linear_fc2.weight", hf + "down_proj.weight", (hidden, ffn))]


def name_table(config: HFDenseConfig) -> list[NameEntry]:
    """The HF <-> Megatron local-spec name table of ``config``'s model, in checkpoint order; both
    :func:`megatron_state_dict_from_hf` and its inverse :func:`hf_tensors_from_megatron` read it.
    ``lm_head.weight`` is a row only when the embeddings are untied."""
    c = config
    q_rows, kv_rows, hidden = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    table = [_copy("embedding.word_embeddings.weight", "model.embed_tokens.weight", (c.vocab_size, hidden))]
    for i in range(c.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        table.append(_copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight", (hidden,)))
        table.append(NameEntry(mg + "self_attention.linear_qkv.weight",
                               tuple(f"{attn}{n}_proj.weight" for n in "qkv"),
                               ((q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)), "qkv"))
        if c.qkv_bias:
            table.append(NameEntry(mg + "self_attention.linear_qkv.bias", tuple(f"{attn}{n}_proj.bias" for n in "qkv"),
                                   ((q_rows,), (kv_rows,), (kv_rows,)), "qkv"))
        if c.qk_norm:
            table.append(_copy(mg + "self_attention.q_layernorm.weight", attn + "q_norm.weight", (c.head_dim,)))
            table.append(_copy(mg + "self_attention.k_layernorm.weight", attn + "k_norm.weight", (c.head_dim,)))
        table.append(_copy(mg + "self_attention.linear_proj.weight", attn + "o_proj.weight", (hidden, q_rows)))
        table.append(_copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", (hidden,)))
        if c.moe is not None and i in c.moe.sparse_layers:
            table.append(_copy(mg + "mlp.router.weight", hf + "mlp.gate.weight", (c.moe.num_experts, hidden)))
            for e in range(c.moe.num_experts):
                table += _gated_mlp(f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.local_experts.{e}.",
                                    c.moe.moe_intermediate_size, hidden)
            if c.moe.shared_expert_intermediate_size:
                shared = mg + "mlp.shared_experts."
                table += _gated_mlp(hf + "mlp.shared_expert.", shared, c.moe.shared_expert_intermediate_size, hidden)
                table.append(_copy(shared + "gate_weight", hf + "mlp.shared_expert_gate.weight", (1, hidden)))
        else:
            table += _gated_mlp(hf + "mlp.", mg + "mlp.", c.intermediate_size, hidden)
    table.append(_copy("decoder.final_layernorm.weight", "model.norm.weight", (hidden,)))
    if not c.tie_word_embeddings:
        table.append(_copy("output_layer.weight", "lm_head.weight", (c.vocab_size, hidden)))
    return table


def megatron_state_dict_from_hf(tensors: dict[str, torch.Tensor], config: HFDenseConfig) -> dict[str, torch.Tensor]:
    """Megatron local-spec parameter name -> tensor, converted from HF tensors (dtype unchanged) by
    :func:`name_table`.

    Raises HFCheckpointError naming the tensor when one is missing, has the wrong shape for
    `config`, or is left over; a tied checkpoint that stores a different lm_head is an error.
    """
    source = _TensorSource(tensors)
    out = {}
    for entry in name_table(config):
        parts = [source.take(name, shape) for name, shape in zip(entry.hf, entry.hf_shapes, strict=True)]
        if entry.join == "qkv":
            out[entry.megatron] = interleave_qkv(*parts, config.num_key_value_heads)
        else:
            out[entry.megatron] = parts[0] if entry.join == "copy" else torch.cat(parts)
    if config.tie_word_embeddings and source.has("lm_head.weight"):
        lm_head = source.take("lm_head.weight", (config.vocab_size, config.hidden_size))
        if not torch.equal(lm_head, out["embedding.word_embeddings.weight"]):
            raise HFCheckpointError(
                "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight"
            )
    source.check_all_used()
    return out


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) rows of Megatron's interleaved ``linear_qkv`` (inverse of :func:`interleave_qkv`)."""
    trailing = qkv.shape[1:]
    per_group = qkv.reshape(num_kv_heads, -1, *trailing)
    group_rows = per_group.shape[1]
    kv_rows = group_rows // (num_heads // num_kv_heads + 2)
    q_rows = group_rows - 2 * kv_rows
    q, k, v = per_group.split([q_rows, kv_rows, kv_rows], dim=1)
    return q.reshape(-1, *trailing), k.reshape(-1, *trailing), v.reshape(-1, *trailing)


def hf_tensors_from_megatron(state: dict[str, torch.Tensor], config: HFDenseConfig) -> dict[str, torch.Tensor]:
    """HF tensor name -> tensor from a Megatron local-spec (or vLLM-spec) state: the inverse of
    :func:`megatron_state_dict_from_hf`, read from the same :func:`name_table` (dtype unchanged;
    ``lm_head.weight`` only when untied).

    Raises HFCheckpointError naming the parameter when one is missing or left over."""
    source = _TensorSource(state)
    out = {}
    for entry in name_table(config):
        tensor = source.take(entry.megatron, entry.megatron_shape)
        if entry.join == "qkv":
            parts = split_qkv(tensor, config.num_attention_heads, config.num_key_value_heads)
        else:
            parts = (tensor,) if entry.join == "copy" else tensor.split([shape[0] for shape in entry.hf_shapes])
        out.update(zip(entry.hf, parts, strict=True))
    source.check_all_used()
    return out

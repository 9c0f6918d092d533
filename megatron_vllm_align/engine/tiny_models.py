"""Tiny Hugging Face decoder checkpoints with random weights, built locally (no download).

They are the test subjects for the engine comparisons: small enough to load in seconds, shaped
like the real thing (GQA, gated SiLU MLP or Qwen3-MoE / Qwen2-MoE experts, RMSNorm, RoPE) and saved in bf16 safetensors
with a ``config.json`` that both vLLM and :mod:`megatron_vllm_align.megatron.hf_checkpoint` read.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"]

# Prompt lengths that are not multiples of the kernels' tile sizes, with 1 (no logprobs), and
# both sides of 16 and 32.
UNALIGNED_LENGTHS = (1, 2, 7, 16, 17, 31, 33, 37)
# A directory where build_tiny_hf_model keeps one build per config and copies it from (the test suite
# sets it for its session, so that a checkpoint several modules use is built once).
CACHE_ENV_VAR = "MVA_TINY_MODEL_CACHE"
# Qwen3-0.6B's widths (TinyModelConfig fields; its 28 layers are the config's num_layers, 2 by default):
# hidden 1024, 16 query / 8 KV heads of 128, FFN 3072, vocabulary 151936, tied embeddings.
QWEN3_0_6B_WIDTHS = dict(architecture="qwen3", hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                         intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Shape and seed of a tiny random decoder.

    head_dim must be one the vLLM CPU attention backend serves (32, 64, 80, 96, 112, 128, ...).
    norm_weight_jitter and bias_std move RMSNorm weights away from HF's all-ones init and
    biases away from zero, so that a loader which swaps two norms or misplaces a bias gives
    a different forward instead of an identical one.

    qwen3_moe / qwen2_moe only: num_experts routed SwiGLU experts of moe_intermediate_size, top_k
    per token, norm_topk_prob, and the sparse layers chosen by decoder_sparse_step / mlp_only_layers
    (the others keep a dense MLP of intermediate_size). vLLM's CPU experts need hidden_size % 32 == 0.
    qwen2_moe also has q/k/v biases and, per sparse layer, a shared SwiGLU expert of
    shared_expert_intermediate_size with a sigmoid gate (one output row).
    rope_scaling: the RoPE scaling entries of ``rope_parameters`` besides ``rope_theta`` (e.g.
    ``{"rope_type": "llama3", "factor": 32.0, ...}``); None is plain RoPE.
    """

    architecture: Architecture = "llama"
    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    norm_weight_jitter: float = 0.1
    bias_std: float = 0.02
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 192
    rope_scaling: dict | None = None
    seed: int = 0


def _hf_config(config: TinyModelConfig):
    """The transformers config object for `config` (qwen2 always has q/k/v biases)."""
    import transformers

    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta},
    )
    if config.architecture == "llama":
        return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if config.architecture == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    if config.architecture == "qwen3":
        return transformers.Qwen3Config(attention_bias=False, use_sliding_window=False, **common)
    if config.architecture == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            attention_bias=False, use_sliding_window=False, num_experts=config.num_experts,
            num_experts_per_tok=config.top_k, moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=list(config.mlp_only_layers), **common)
    if config.architecture == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            use_sliding_window=False, num_experts=config.num_experts, num_experts_per_tok=config.top_k,
            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers),
            shared_expert_intermediate_size=config.shared_expert_intermediate_size, **common)
    raise ValueError(f"TinyModelConfig.architecture: unsupported {config.architecture!r}")


def build_tiny_hf_model(out_dir: str | os.PathLike, config: TinyModelConfig = TinyModelConfig()) -> Path:
    """Create a random-weight causal LM per `config`, save it to `out_dir` in bf16; return the dir.

    Deterministic for a given `config` (seeded). The directory is written atomically: the model
    is saved to a sibling temporary directory that is renamed into place, so a reader never sees
    a half-written checkpoint. An existing `out_dir` is an error. With ``$MVA_TINY_MODEL_CACHE``
    (:data:`CACHE_ENV_VAR`) naming a directory, each config is built there once (under a file lock, so
    that concurrent processes build it once) and its files are copied to `out_dir`: the same bytes, and
    torch's global random state left as the build leaves it (the build seeds and draws from it).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"build_tiny_hf_model: out_dir {out_dir} already exists")
    cache = os.environ.get(CACHE_ENV_VAR)
    if cache:
        _write_atomically(out_dir, lambda staging: shutil.copytree(_cached_build(Path(cache), config), staging,
                                                                   dirs_exist_ok=True))
    else:
        _write_atomically(out_dir, lambda staging: _random_model(config).save_pretrained(staging))
    return out_dir


def _random_model(config: TinyModelConfig):
    """The seeded random-weight transformers model of `config`, in bf16."""
    import transformers

    hf_config = _hf_config(config)
    torch.manual_seed(config.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(config.seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=generator) * config.norm_weight_jitter)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * config.bias_std)
    return model.to(torch.bfloat16)


def _write_atomically(out_dir: Path, fill) -> None:
    """``fill(staging)`` writes the checkpoint into a sibling temporary directory, renamed to `out_dir`."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        fill(staging)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _cached_build(cache: Path, config: TinyModelConfig) -> Path:
    """`config`'s checkpoint in `cache`, built there first if no process has yet (keyed by the config and
    the torch / transformers versions that build it)."""
    import transformers

    fields = json.dumps({"config": dataclasses.asdict(config), "torch": torch.__version__,
                         "transformers": transformers.__version__}, sort_keys=True)
    built = cache / hashlib.sha256(fields.encode()).hexdigest()[:24]
    cache.mkdir(parents=True, exist_ok=True)
    rng_after = built.with_suffix(".rng")   # torch's global random state after the build

    def build(staging: Path) -> None:   # the state is saved before the checkpoint is renamed into place
        _random_model(config).save_pretrained(staging)
        torch.save(torch.get_rng_state(), rng_after)

    with open(built.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.is_dir():
            _write_atomically(built, build)
    torch.set_rng_state(torch.load(rng_after))
    return built


def random_token_sequences(lengths: tuple[int, ...], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """One uniformly random token-id list per entry of `lengths`, reproducible from `seed`."""
    if any(n < 1 for n in lengths):
        raise ValueError(f"random_token_sequences: lengths must be >= 1, got {lengths}")
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def save_byte_level_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Save a byte-level BPE tokenizer without merges into checkpoint directory ``out_dir``
    (``tokenizer.json`` + ``tokenizer_config.json``, through ``transformers.PreTrainedTokenizerFast``):
    ids 0, 1, 2 are ``<pad>``, ``<s>`` (prepended to every text), ``</s>``; ids 3..258 the 256 byte
    symbols of the GPT-2 byte alphabet, in its order. A real tokenizer file that transformers' and
    vLLM's loaders read, made locally (nothing downloaded); the model's vocabulary must cover 259 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate([*specials, *sorted(alphabet)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                      eos_token="</s>")
    wrapped.save_pretrained(out_dir)
    return Path(out_dir)

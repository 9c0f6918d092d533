"""Router replay from the engine (R3): the experts the engine routed each token to, replayed into
the trainer's routers, give the engine's sampled-token logprobs bit for bit, even when the
trainer's router would choose differently on its own.

The engine (Qwen3-MoE, 32 experts, top-2, MVA_INVARIANT=1) records every fed-in token's experts
(``ReferenceEngineConfig(return_routed_experts=True)``, :mod:`megatron_vllm_align.engine.routing_capture`).
Then, per MoE layer, the trainer's router row of an expert the engine never chose for these
sequences is turned towards the tokens' mean router input, so the trainer's own top-k picks it:
without replay its logprobs move away from the engine's; with replay they equal them (vLLM's
renormalised top-k softmax reads only the chosen experts' logits, so the perturbed row is unseen).
"""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align import invariance
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model, random_token_sequences
from megatron_vllm_align.engine.vllm_reference import ReferenceEngineConfig, engine_sample_completions
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.megatron.logprobs import completion_logprobs, token_logprobs
from megatron_vllm_align.megatron.vllm_moe import moe_layers, recorded_routing
from megatron_vllm_align.ops.refresh import refresh_deployed_weights

pytestmark = pytest.mark.engine

CONFIG = TinyModelConfig(architecture="qwen3_moe", num_experts=32, top_k=2, seed=21)
PROMPT_LENGTHS, MAX_TOKENS = (5, 9, 14), (6, 4, 9)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from vllm import SamplingParams

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(invariance.ENV_VAR, "1")
        checkpoint = build_tiny_hf_model(tmp_path_factory.mktemp("r3") / "qwen3_moe", CONFIG)
        prompts = random_token_sequences(PROMPT_LENGTHS, vocab_size=CONFIG.vocab_size, seed=12)
        params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, seed=50 + i, ignore_eos=True)
                  for i, n in enumerate(MAX_TOKENS)]
        completions = engine_sample_completions(checkpoint, prompts, params, ReferenceEngineConfig(
            kv_cache_bytes=64 * 1024 * 1024, return_routed_experts=True))
        init_single_process_cpu(seed=1234)
        yield checkpoint, completions


@pytest.fixture
def invariant_mode(monkeypatch):
    monkeypatch.setenv(invariance.ENV_VAR, "1")


def _replay_logprobs(model, completions, replay: bool):
    with torch.no_grad():
        return completion_logprobs(model, [c.prompt for c in completions], [c.tokens for c in completions],
                                   routed_experts=[c.routed_experts for c in completions] if replay else None)


def test_engine_routing_is_captured_for_every_fed_token(rollout, invariant_mode):
    checkpoint, completions = rollout
    for c in completions:
        assert c.routed_experts.shape == (len(c.sequence) - 1, CONFIG.num_layers, CONFIG.top_k)
    model = build_gpt_from_hf(checkpoint, align=True)
    with torch.no_grad():
        token_logprobs(model, [c.sequence[:-1] for c in completions])
    ours = recorded_routing(model)  # per layer [tokens, k] over the packed sequences
    for layer, ids in enumerate(ours):
        engine = torch.cat([c.routed_experts[:, layer] for c in completions])
        assert torch.equal(ids.sort(-1).values, engine.sort(-1).values), f"layer {layer}"


def test_replay_gives_the_engine_bits_with_a_perturbed_router(rollout, invariant_mode, max_delta):
    checkpoint, completions = rollout
    engine = [c.logprobs for c in completions]
    model = build_gpt_from_hf(checkpoint, align=True)
    assert max_delta("replay, router as served", _replay_logprobs(model, completions, True), engine) == 0.0

    inputs = []
    hooks = [layer.router.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
             for layer in moe_layers(model)]
    with torch.no_grad():
        token_logprobs(model, [c.sequence for c in completions])
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for j, layer in enumerate(moe_layers(model)):
            used = set(torch.cat([c.routed_experts[:, j] for c in completions]).flatten().tolist())
            unused = next(e for e in range(CONFIG.num_experts) if e not in used)
            direction = inputs[j].reshape(-1, inputs[j].shape[-1]).float().mean(0)
            layer.router.weight[unused] = (direction / direction.norm() * 50).to(layer.router.weight.dtype)
    refresh_deployed_weights(model)

    own = _replay_logprobs(model, completions, False)
    assert max_delta("own routing, perturbed router", own, engine) > 0.0
    replayed = _replay_logprobs(model, completions, True)
    assert max_delta("replay, perturbed router", replayed, engine) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(replayed, engine, strict=True))


def test_replay_rows_of_the_wrong_length_are_refused(rollout, invariant_mode):
    checkpoint, completions = rollout
    model = build_gpt_from_hf(checkpoint, align=True)
    with pytest.raises(ValueError, match=r"routed_experts\[0\] must be \[n - 1 or n"):
        completion_logprobs(model, [completions[0].prompt], [completions[0].tokens],
                            routed_experts=[completions[0].routed_experts[:-2]])


def test_a_new_capturing_engine_forgets_what_earlier_engines_recorded():
    """Request ids start at 0 in every engine: rows an earlier engine of this process recorded and nobody
    took (prompt-logprob requests, a calibration run) would match a new engine's ids. Starting the capture
    again forgets them; without that, the take names the ambiguity."""
    from megatron_vllm_align.engine import routing_capture

    row = torch.zeros(2, 2, dtype=torch.int32)
    routing_capture._captured.update({"6-earlier": {0: row}, "6-now": {0: row}})
    with pytest.raises(RuntimeError, match="2 captured requests match id '6'"):
        routing_capture.take_routed_experts("6", 1)
    routing_capture.install_routing_capture()
    assert routing_capture._captured == {}
    routing_capture._captured["6-now"] = {0: row}
    assert torch.equal(routing_capture.take_routed_experts("6", 1), row.unsqueeze(0))

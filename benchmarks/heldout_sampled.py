"""Held-out check of issue 9: sampled-token logprobs, aligned trainer vs a real engine.

    .venv/bin/python benchmarks/heldout_sampled.py dense|moe

Model shapes and workload used by no test: ``dense`` is Qwen2 (qkv bias), 3 layers, hidden 512,
8/2 heads, FFN 1376, vocab 32000; ``moe`` is Qwen2-MoE, 3 layers, hidden 384, 6/2 heads, 12
experts top-3, expert FFN 192, shared expert 256, vocab 20000. 8 prompts of 5..150 random tokens,
``max_tokens`` 8..60 (224 sampled tokens, the decode batch shrinks step by step), temperature 1,
unseeded, ``MVA_INVARIANT=1`` in this process (in-process engine).

Prints max |trainer - engine| over every sampled token for the aligned and the native spec (and,
for MoE, the aligned spec replaying the engine's routing). Exit status 1 unless aligned is 0 and
native is > 0. Not part of the test suite on purpose: its shapes must stay unseen by the tests.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

DENSE = dict(architecture="qwen2", num_layers=3, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
             intermediate_size=1376, vocab_size=32000, seed=77)
MOE = dict(architecture="qwen2_moe", num_layers=3, hidden_size=384, num_heads=6, num_kv_heads=2, head_dim=64,
           intermediate_size=768, moe_intermediate_size=192, num_experts=12, top_k=3,
           shared_expert_intermediate_size=256, vocab_size=20000, seed=78)
PROMPT_LENGTHS = (5, 17, 33, 60, 80, 101, 128, 150)
MAX_TOKENS = (20, 60, 8, 35, 14, 50, 26, 11)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("dense", "moe"))
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["MVA_INVARIANT"] = "1"

    from vllm import SamplingParams

    from megatron_vllm_align.engine import ReferenceEngineConfig, engine_sample_completions
    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model, random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import completion_logprobs

    moe = args.model == "moe"
    config = TinyModelConfig(**(MOE if moe else DENSE))
    with tempfile.TemporaryDirectory() as workdir:
        checkpoint = build_tiny_hf_model(os.path.join(workdir, args.model), config)
        prompts = random_token_sequences(PROMPT_LENGTHS, vocab_size=config.vocab_size, seed=99)
        params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, ignore_eos=True) for n in MAX_TOKENS]
        completions = engine_sample_completions(checkpoint, prompts, params, ReferenceEngineConfig(
            kv_cache_bytes=128 * 1024 * 1024, return_routed_experts=moe))

        init_single_process_cpu(seed=1)
        engine = [completion.logprobs for completion in completions]
        tokens = [completion.tokens for completion in completions]
        arms = {"aligned": dict(align=True), "native": dict(align=False)}
        if moe:
            arms["aligned, engine routing replayed"] = dict(
                align=True, routed_experts=[completion.routed_experts for completion in completions])
        deltas = {}
        for name, arm in arms.items():
            with torch.no_grad():
                model = build_gpt_from_hf(checkpoint, align=arm["align"])
                ours = completion_logprobs(model, prompts, tokens, routed_experts=arm.get("routed_experts"))
            deltas[name] = max(float((a - b).abs().max()) for a, b in zip(ours, engine))
    count = sum(logprobs.numel() for logprobs in engine)
    for name, delta in deltas.items():
        print(f"{args.model} {name}: max |trainer - engine| = {delta:.3g} over {count} sampled tokens")
    ok = deltas["native"] > 0 and all(delta == 0 for name, delta in deltas.items() if name != "native")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

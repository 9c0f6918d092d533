"""What MVA_INVARIANT=1 costs: engine decode and prefill, and the aligned trainer's step, on and off.

    .venv/bin/python benchmarks/invariance_cost.py [--requests 1,2,3,4,6,8,16,32,64]
        [--prefill 128,512,2048,4096] [--new-tokens 48] [--repeats 3]

Qwen3-0.6B widths (hidden 1024, 16 heads, 8 KV heads, head_dim 128, vocab 151936, 2 layers),
random weights built locally. Each configuration runs in its own subprocess (vLLM patches and
plugin loading are per process), on the same checkpoint, in this one run:

* engine decode, per batch size R: R prompts of 16 tokens sampled for 1 and for ``--new-tokens``
  tokens (``ignore_eos``, temperature 1); decode tokens/s = (extra tokens) / (extra time), best of
  ``--repeats`` (the prefill cost cancels out);
* engine prefill, per length L: one prompt of L tokens and one sampled token, best of ``--repeats``
  (the engine's default chunked prefill: 2048-token steps);
* trainer: forward + backward of the summed sampled-token logprobs of 4 sequences of 128 tokens,
  packed, median of 5 steps after 2 warm-up steps.

Prints each figure and the ratio invariant / default (``--json`` keys ``invariance_cost.qwen3_0.6b.
decode_slowdown_<R>``, ``.prefill_ratio_<L>``, ``.step_ratio``). Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import add_json_option, write_figures

QWEN3_06B_WIDTHS = dict(architecture="qwen3", hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)


def engine_times(checkpoint: str, requests: list[int], prefill: list[int], new_tokens: int, repeats: int) -> dict:
    """In this process: decode tokens/s per batch size and prefill seconds per length of one in-process
    engine (module docstring)."""
    from vllm import SamplingParams

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.engine.vllm_reference import (
        ReferenceEngineConfig,
        sample_completions,
        shutdown_engine,
        start_reference_engine,
    )

    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=512 * 1024 * 1024))

    def best_time(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=1, ignore_eos=True)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sample_completions(llm, prompts, params)
            times.append(time.perf_counter() - start)
        return min(times)

    best_time(random_token_sequences((16,) * max(requests), vocab_size=151936, seed=0), 2)  # warm-up
    decode = {}
    for count in requests:
        prompts = random_token_sequences((16,) * count, vocab_size=151936, seed=count)
        decode[str(count)] = count * (new_tokens - 1) / (best_time(prompts, new_tokens) - best_time(prompts, 1))
    prefill_s = {str(length): best_time(random_token_sequences((length,), vocab_size=151936, seed=length), 1)
                 for length in prefill}
    shutdown_engine(llm)
    return {"decode_tokens_per_s": decode, "prefill_s": prefill_s}


def trainer_step(checkpoint: str) -> dict:
    """In this process: median forward + backward time of the aligned trainer (module docstring)."""
    import torch

    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import token_logprobs

    init_single_process_cpu()
    model = build_gpt_from_hf(checkpoint, align=True)
    model.train()
    batch = random_token_sequences((128,) * 4, vocab_size=151936, seed=0)
    times = []
    for _ in range(7):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = -torch.cat(token_logprobs(model, batch)).sum()
        loss.backward()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,2,3,4,6,8,16,32,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--prefill", default="128,512,2048,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "CHECKPOINT", "INVARIANT"), help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    requests, prefill = ([int(value) for value in text.split(",")] for text in (args.requests, args.prefill))
    if args.child:
        what, checkpoint, _ = args.child
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        result = (engine_times(checkpoint, requests, prefill, args.new_tokens, args.repeats) if what == "engine"
                  else trainer_step(checkpoint))
        print("RESULT " + json.dumps(result))
        return

    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        config = TinyModelConfig(**QWEN3_06B_WIDTHS, max_position_embeddings=max(prefill) + args.new_tokens + 16)
        checkpoint = str(build_tiny_hf_model(Path(tmp) / "qwen3_06b_widths", config))
        figures = {}
        for what in ("engine", "trainer"):
            for invariant in ("0", "1"):
                env = {**os.environ, "MVA_INVARIANT": invariant}
                done = subprocess.run([sys.executable, __file__, "--requests", args.requests, "--prefill", args.prefill,
                                       "--new-tokens",
                                       str(args.new_tokens), "--repeats", str(args.repeats),
                                       "--child", what, checkpoint, invariant],
                                      env=env, capture_output=True, text=True, check=False)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    sys.exit(f"{what} (MVA_INVARIANT={invariant}) failed:\n{done.stderr[-3000:]}")
                figures[what, invariant] = json.loads(lines[-1][len("RESULT "):])
    engine_off, engine_on = figures["engine", "0"], figures["engine", "1"]
    trainer_off, trainer_on = figures["trainer", "0"], figures["trainer", "1"]
    result = {}
    for count in requests:
        off, on = (engine["decode_tokens_per_s"][str(count)] for engine in (engine_off, engine_on))
        result[f"decode_slowdown_{count}"] = off / on
        print(f"engine decode, {count} requests: {off:.1f} tokens/s default, {on:.1f} invariant; slowdown "
              f"{off / on:.2f}x")
    for length in prefill:
        off, on = (engine["prefill_s"][str(length)] for engine in (engine_off, engine_on))
        result[f"prefill_ratio_{length}"] = on / off
        print(f"engine prefill of {length} tokens + 1 token: {off * 1e3:.0f} ms default, {on * 1e3:.0f} ms "
              f"invariant; ratio {on / off:.2f}")
    result["step_ratio"] = trainer_on["step_s"] / trainer_off["step_s"]
    print(f"aligned trainer step (4 x 128 tokens): {trainer_off['step_s'] * 1e3:.0f} ms default, "
          f"{trainer_on['step_s'] * 1e3:.0f} ms invariant; ratio {result['step_ratio']:.2f}")
    write_figures(args.json, "invariance_cost", {"qwen3_0.6b": result})


if __name__ == "__main__":
    main()

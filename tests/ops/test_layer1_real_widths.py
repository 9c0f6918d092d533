"""Layer 1 at the widths of the models we claim: every registered case at hidden 1024 (Qwen3-0.6B),
4096 (Llama-3-8B) and 8192 (Llama-3-70B), head_dim 128, the full vocabulary (151936) for the selected
logprob, M = 1 and 37, 2 seeds, every dY kind (the "along_output" kind keeps terms that random dY hides
at these widths: tests/ops/rms_norm/test_rms_norm_dy_along_output.py plants a dropped one)."""
import pytest

from megatron_vllm_align.ops.registry import CaseContexts, Widths, layer1_cases
from megatron_vllm_align.validation import DY_KINDS
from megatron_vllm_align.validation.layer1_suite import run_layer1_suite

HIDDEN = (1024, 4096, 8192)
UNBUILT = CaseContexts(bf16=None, fp8=None, moe=None)
# (hidden, case name), each name once: a case that does not depend on the hidden width (the logprob ops over
# the full vocabulary) has the same name, and the same tensors, at every width
FIRST_WIDTH: dict[str, int] = {}
for _hidden in HIDDEN:
    for _case in layer1_cases(UNBUILT, Widths.real(_hidden)):
        FIRST_WIDTH.setdefault(_case.name, _hidden)
CASES = [(hidden, name) for name, hidden in FIRST_WIDTH.items()]


@pytest.mark.parametrize("hidden, name", CASES, ids=[f"{h}-{n}" for h, n in CASES])
def test_registered_case_passes_layer1_at_real_width(case_contexts, hidden, name):
    (case,) = [c for c in layer1_cases(case_contexts, Widths.real(hidden)) if c.name == name]
    reports = run_layer1_suite([case], seeds=range(2))
    failures = [line for r in reports for line in r.failures]
    assert not failures, "\n".join(failures[:20])
    assert {c.dy_kind for r in reports for c in r.checks} == set(DY_KINDS)
    assert len(reports) == 2 * len(case.token_counts) > 0


def test_real_widths_are_the_models():
    widths = Widths.real(4096)
    assert (widths.heads, widths.kv_heads, widths.head_dim) == (32, 8, 128)
    assert Widths.real(1024).heads * 128 == 1024
    with pytest.raises(ValueError, match="multiple of 128"):
        Widths.real(1000)

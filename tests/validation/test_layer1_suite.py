"""Issue acceptance: every visible module passes layer 1 with its contract's tolerances across
5 seeds, every default dY kind (DY_KINDS) and M = 1 / 37 / 300 (attention: packed 37 and 300)."""
import pytest

from megatron_vllm_align.validation.layer1_suite import run_layer1_suite, visible_module_cases


@pytest.fixture(scope="module")
def cases(bf16_context, fp8_context):
    return {case.name: case for case in visible_module_cases(bf16_context, fp8_context)}


CASE_NAMES = ["dense_linear", "fp8_linear_per_channel[dx=dequantized]", "fp8_linear_per_channel[dx=master]",
              "rms_norm", "rms_norm[fused_residual]", "silu_and_mul", "rotary_embedding", "attention",
              "selected_logprob"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_visible_module_passes_layer1(cases, name):
    reports = run_layer1_suite([cases[name]], seeds=range(5))
    assert len(reports) == len(cases[name].token_counts) * 5
    failures = [line for r in reports for line in r.failures]
    assert not failures, "\n".join(failures[:20])
    kinds = {c.dy_kind for r in reports for c in r.checks}
    assert kinds == {"random", "zero", "sparse", "along_output"}


def test_cases_cover_every_visible_module(cases):
    assert sorted(cases) == sorted(CASE_NAMES)

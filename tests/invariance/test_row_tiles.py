"""Row rules: each linear kernel runs under the cheapest rule its probe shows row-invariant, and a row's
bits then never depend on M. The probe's decisions are pinned on kernels with planted row dependence;
vLLM's own kernels are then checked at call counts and offsets the probe did not use."""
import pytest
import torch

from megatron_vllm_align.invariance import ROW_TILE, InvarianceUnsupported
from megatron_vllm_align.invariance.row_tiles import (
    PROBE_FIRST_ROW,
    PROBE_MAX_ROWS,
    PROBE_OUTPUTS,
    RowRule,
    first_difference,
    measured_rules,
    padded_count,
    probe_generator,
    probe_plan,
    probe_row_rule,
    run_in_row_tiles,
    run_under_rule,
)
from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel

# (K, N): Qwen3-0.6B's qkv (1024 -> 4096) and down (3072 -> 1024) projections, a small sgl-routed
# shape (256 -> 96) and a router gate (256 -> 8 experts).
SHAPES = [(1024, 4096), (3072, 1024), (256, 96), (256, 8)]
# Row counts and positions none of the probe's calls used.
UNPROBED = ((6, 11), (10, 3), (23, 40), (40, 0), (100, 13), (200, 7))


def _weights(k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    return weight, torch.randn(n, generator=gen).to(torch.bfloat16)


def _record_gemm_rows(kernel):
    """Wrap the shadow layer's GEMM callable (vLLM's ``cpu_linear``, or the FP8 kernel's apply) and
    return the list its calls' row counts are appended to."""
    rows = []
    layer = kernel.layer
    if hasattr(layer, "cpu_linear"):
        inner = layer.cpu_linear
        layer.cpu_linear = lambda x, w, b: (rows.append(x.shape[0]), inner(x, w, b))[1]
    else:
        inner = layer.quant_method.fp8_linear.apply_weights
        layer.quant_method.fp8_linear.apply_weights = lambda lyr, x, *a, **kw: (rows.append(x.shape[0]),
                                                                                 inner(lyr, x, *a, **kw))[1]
    return rows


def _calls(rule, count):
    """The row counts the kernel sees for one call of ``count`` rows under ``rule``."""
    if rule is RowRule.TILES:
        return [ROW_TILE] * -(-count // ROW_TILE)
    return [padded_count(rule, count)]


def test_the_rules_pad_calls_in_cost_order():
    """The whole call, the lone row paired and the even rule each pass the kernel no more rows than the next; every
    rule but the tiles makes one call of at most 4 rows more."""
    for count in range(1, 70):
        whole, paired, even, least, tiles = (_calls(rule, count) for rule in RowRule)
        assert whole == [count] and sum(whole) <= sum(paired) <= sum(even), count
        assert all(len(calls) == 1 and calls[0] - count <= 4 for calls in (paired, even, least)), count
        assert len(tiles) == -(-count // ROW_TILE)
    assert [padded_count(RowRule.EVEN_ROWS, m) for m in (1, 2, 3, 4, 5, 6, 33)] == [4, 4, 4, 4, 6, 6, 34]
    assert [padded_count(RowRule.LEAST_ROWS, m) for m in (1, 2, 4, 5, 6, 33)] == [5, 5, 5, 5, 6, 33]


def test_run_in_row_tiles_is_the_function_on_fixed_blocks():
    x = torch.randn(2, 19, 5)
    seen = []
    out = run_in_row_tiles(lambda r: (seen.append(tuple(r.shape)), r.flip(-1) * 3)[1], x)
    assert torch.equal(out, x.flip(-1) * 3) and out.shape == (2, 19, 5)
    assert seen == [(ROW_TILE, 5)] * -(-38 // ROW_TILE)     # 38 rows in tiles, the last one padded
    assert run_in_row_tiles(lambda r: r[:, :2], torch.zeros(0, 4)).shape == (0, 2)


@pytest.mark.parametrize("rule", list(RowRule))
def test_each_rule_computes_the_function_and_passes_the_rows_it_says(rule):
    for count in (1, 2, 3, 6, 7):
        x = torch.randn(count, 5)
        seen = []
        out = run_under_rule(rule, lambda r: (seen.append(r.shape[0]), r.flip(-1) * 3)[1], x)
        assert torch.equal(out, x.flip(-1) * 3)
        assert seen == _calls(rule, count)


def _planted(depends_on):
    """A row-wise function whose every output moves by 2^-7 when ``depends_on(M)`` holds for its call's M."""
    return lambda rows: rows * 3 + (2 ** -7 if depends_on(rows.shape[0]) else 0.0)


def _rarely(depends_on):
    """A row-wise function whose outputs move by 2^-7 when ``depends_on(M)`` holds for its call's M, but only at
    about 1e-4 of the output positions (fixed by the input's value, as a rounding flip would be)."""
    return lambda rows: rows * 3 + torch.where(((rows * 8191).frac().abs() < 1e-4) & depends_on(rows.shape[0]),
                                               2 ** -7, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_probe_picks_the_cheapest_rule_that_holds(seed):
    torch.manual_seed(seed)
    assert probe_row_rule(_planted(lambda m: False), 8, 8, torch.float32) == (RowRule.WHOLE, {})
    # a lone row computed otherwise (oneDNN at K >= 2048 on an AVX-512 BF16 EPYC)
    rule, failures = probe_row_rule(_planted(lambda m: m == 1), 8, 8, torch.float32)
    assert rule is RowRule.PAIRED_LONE_ROW and "1 rows" in failures[RowRule.WHOLE]
    # M < 4 and odd M computed otherwise than even M >= 4 (oneDNN without bf16 dot products, AVX512_CORE)
    rule, failures = probe_row_rule(_planted(lambda m: m < 4 or m % 2 == 1), 8, 8, torch.float32)
    assert rule is RowRule.EVEN_ROWS and set(failures) == {RowRule.WHOLE, RowRule.PAIRED_LONE_ROW}
    # M <= 4 computed otherwise than M >= 5 (sgl's weight_packed_linear on an AMX Xeon)
    rule, failures = probe_row_rule(_planted(lambda m: m <= 4), 8, 8, torch.float32)
    assert rule is RowRule.LEAST_ROWS and set(failures) == {RowRule.WHOLE, RowRule.PAIRED_LONE_ROW, RowRule.EVEN_ROWS}
    # M = 2 and M >= 33 computed otherwise than M = 1 and 3..32 (oneDNN on an AMX Xeon)
    rule, failures = probe_row_rule(_planted(lambda m: m == 2 or m >= 33), 8, 8, torch.float32)
    assert rule is RowRule.TILES and set(failures) == {RowRule.WHOLE, RowRule.PAIRED_LONE_ROW, RowRule.EVEN_ROWS,
                                                       RowRule.LEAST_ROWS}
    # only one lone row of the probe's computed otherwise: still found
    odd_row = torch.randint(0, probe_plan(8)[0], ()).item()
    rule, _ = probe_row_rule(lambda r: r * 3 + (2 ** -7 if r.shape[0] == 1 and bool((r == _row(odd_row)).all())
                                                else 0.0), 8, 8, torch.float32)
    assert rule is RowRule.PAIRED_LONE_ROW
    # sgl's two paths differ in about 1e-4 of the bf16 outputs (measured on an AMX Xeon): found at a width of 8
    # outputs as at 96 (the probe compares more rows where rows are narrow)
    for width in (8, 96):
        rule, failures = probe_row_rule(_rarely(lambda m: m <= 4), width, width, torch.float32)
        assert rule is RowRule.LEAST_ROWS, (width, failures)


def _row(index):
    return torch.randn(probe_plan(8)[0], 8, generator=probe_generator())[index]


def test_a_kernel_no_rule_fixes_is_refused_with_what_each_rule_saw():
    # a row's output depends on its position in the call: no rule can hide that
    position_dependent = lambda rows: rows * 3 + torch.arange(rows.shape[0]).unsqueeze(1) * 2 ** -7  # noqa: E731
    with pytest.raises(InvarianceUnsupported,
                       match="whole call: .*lone row paired: .*even, at least 4 rows: .*at least 5 rows: "
                             ".*tiles of 4 rows: "):
        probe_row_rule(position_dependent, 8, 8, torch.float32)


@pytest.mark.parametrize("outputs_per_row", [1, 8, 96, 256, 1024, 151936])
def test_the_probe_calls_cover_the_measured_blockings(outputs_per_row):
    batch, calls = probe_plan(outputs_per_row)
    assert {rows for rows, _ in calls} == {1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 65} == set(PROBE_FIRST_ROW)
    assert batch == max(start + rows for rows, start in calls) <= PROBE_MAX_ROWS
    per_count = {count: [start for rows, start in calls if rows == count] for count in PROBE_FIRST_ROW}
    assert len(per_count[1]) >= 48 and len(per_count[2]) >= 24
    for count, starts in per_count.items():   # consecutive calls from the count's first row
        assert starts == [PROBE_FIRST_ROW[count] + i * count for i in range(len(starts))]
        # enough outputs compared, unless the batch's row limit stops it
        assert (len(starts) * count * outputs_per_row >= PROBE_OUTPUTS
                or starts[-1] + 2 * count > PROBE_MAX_ROWS or len(starts) == {1: 48, 2: 24}.get(count, 1))


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("k,n", SHAPES)
def test_vllm_kernels_run_their_probed_rule_and_a_row_never_changes_bits(bf16_context, fp8_context, invariant,
                                                                          quantized, k, n):
    context = fp8_context if quantized else bf16_context
    w, b = _weights(k, n, seed=7 * k + n)
    kernel = VllmLinearKernel(context, k, n, True, quantized=quantized)
    kernel.load(w, b)
    gen = torch.Generator().manual_seed(n)
    batch = torch.randn(256, k, generator=gen).to(torch.bfloat16)
    reference = kernel(batch)
    key = f"{type(kernel.quant_method).__name__} {k} -> {n} bfloat16 bias {torch.get_num_threads()} threads"
    rule = RowRule(measured_rules()[key])
    rows = _record_gemm_rows(kernel)
    for count, start in UNPROBED + ((1, 200), (1, 201), (2, 203)):
        assert torch.equal(kernel(batch[start:start + count]), reference[start:start + count]), \
            f"{rule.value}: rows {start}..{start + count - 1} changed bits"
    assert rows == [m for count, _ in UNPROBED + ((1, 200), (1, 201), (2, 203)) for m in _calls(rule, count)]


@pytest.mark.parametrize("k,n", [(3072, 1024), (256, 96)])
def test_gemm_calls_are_untouched_when_off(bf16_context, invariant, not_invariant, k, n):
    w, b = _weights(k, n, seed=1)
    kernel = VllmLinearKernel(bf16_context, k, n, True, quantized=False)
    kernel.load(w, b)
    rows = _record_gemm_rows(kernel)
    for m in (1, 2, 3, 17, 40):
        kernel(torch.randn(m, k).to(torch.bfloat16))
    assert rows == [1, 2, 3, 17, 40]


@pytest.mark.parametrize("k,n", [(3072, 1024), (1024, 4096), (256, 96)])
def test_the_rule_is_needed_exactly_where_the_plain_kernel_is_row_dependent(bf16_context, invariant, monkeypatch,
                                                                            k, n):
    """The control: the probe picks a rule other than the whole call only where vLLM's kernel, run plainly
    (``MVA_INVARIANT=0``), gives some probed rows of another random batch other bits than the batch (on an
    AVX-512 BF16 EPYC: K = 3072 needs the lone row paired, K = 1024 does not; on an AMX Xeon 256 -> 96 runs on
    sgl's weight_packed_linear, whose M <= 4 differs from M >= 5 in about 1e-4 of the outputs)."""
    w, b = _weights(k, n, seed=k - n)
    kernel = VllmLinearKernel(bf16_context, k, n, True, quantized=False)
    kernel.load(w, b)
    kernel(torch.randn(3, k).to(torch.bfloat16))
    rule = RowRule(measured_rules()[f"UnquantizedLinearMethod {k} -> {n} bfloat16 bias {torch.get_num_threads()} "
                                    f"threads"])
    monkeypatch.setenv("MVA_INVARIANT", "0")
    batch = torch.randn(probe_plan(n)[0], k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    plain_differs = first_difference(lambda start, stop: kernel(batch[start:stop]), probe_plan(n))
    assert (plain_differs is not None) == (rule is not RowRule.WHOLE), (rule, plain_differs)

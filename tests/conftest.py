"""Shared fixtures: the vLLM engine contexts a bf16 and an FP8 (per-channel) engine resolve for a tiny
Llama, and a tiny Qwen3-MoE's (``config.json`` only; no weights, no engine started). The session's
vLLM engine starts are counted and printed at the end (:func:`pytest_terminal_summary`); its tiny
checkpoints are built once per config (:func:`_share_tiny_checkpoints`)."""
import gc
import os
import sys
import tempfile
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning, in this process and every subprocess it starts. The suite runs
# two pytest-xdist workers (each with torchrun ranks, servers, engine workers) on the same cores, where the
# spinning threads of one process take the cores the other needs: two copies of tests/ops/test_layer1_real_widths.py
# at width 4096, side by side on 2 cores, took 109 s spinning and 47 s passive (one copy alone: 32 s / 35 s).
# OpenMP reads it when torch loads it, hence before the first torch import of the session (this file's).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_vllm_align.megatron.cpu_report import fp8_gemm_on_onednn
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
from megatron_vllm_align.validation.layer1_suite import (
    TINY_LLAMA_CONFIG,
    TINY_QWEN3_MOE_CONFIG,
    write_model_config,
)


def _count_engine_starts() -> Path:
    """The file every engine core of this session logs its start into (``subprocess_site/``): in this
    process and in subprocesses that inherit ``PYTHONPATH``."""
    import logging.config

    import vllm.logger

    folder = Path(__file__).parent / "subprocess_site"
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("MVA_ENGINE_START_LOG"):
        log = Path(os.environ["MVA_ENGINE_START_LOG"])  # a pytest-xdist worker logs into its controller's file
    else:
        log = Path(tempfile.mkdtemp(prefix="mva_engine_starts_")) / "engine_core.log"
        os.environ["MVA_ENGINE_START_LOG"] = str(log)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(folder))
    import sitecustomize  # this process started before the folder was on its path

    vllm.logger.dictConfig = logging.config.dictConfig = sitecustomize._configure_then_attach
    sitecustomize.attach()
    return log


ENGINE_START_LOG = _count_engine_starts()


def _share_tiny_checkpoints() -> Path:
    """The session's tiny-checkpoint cache (``engine.tiny_models.CACHE_ENV_VAR``): made by the controller,
    inherited by its pytest-xdist workers and every subprocess; removed when the session ends."""
    from megatron_vllm_align.engine.tiny_models import CACHE_ENV_VAR

    if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(CACHE_ENV_VAR)):
        os.environ[CACHE_ENV_VAR] = tempfile.mkdtemp(prefix="mva_tiny_checkpoints_")
    return Path(os.environ[CACHE_ENV_VAR])


TINY_CHECKPOINT_CACHE = _share_tiny_checkpoints()


# FP8 tests whose FP8 GEMMs would take hours where torch runs them on oneDNN (fp8_gemm_on_onednn): (module, id
# part) pairs. The sampled-token test's long prompts (2 x 1200 and 2700 tokens, four engine runs) and layer 1
# and the row rules at real widths; the short FP8 engine tests (TP = 2, check, layer 1 at 1024) still run.
SLOW_FP8_TESTS = (("test_sampled_zero_diff.py", "llama_fp8_per_channel"),
                  ("test_layer1_real_widths.py", "[4096-fp8"), ("test_layer1_real_widths.py", "[8192-fp8"),
                  ("test_row_tiles.py", "[1024-4096-True]"), ("test_row_tiles.py", "[3072-1024-True]"))


def pytest_collection_modifyitems(config, items):
    """Modules that start vLLM engines or torchrun processes (the suite's long ones) run first, each keeping
    its own order: pytest-xdist hands whole modules to its workers in this order (``--dist=loadfile
    --no-loadscope-reorder``), so no long module is left running alone at the end."""
    long_modules = {item.nodeid.split("::")[0] for item in items
                    if item.get_closest_marker("engine") or item.get_closest_marker("distributed")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in long_modules)
    if fp8_gemm_on_onednn():
        slow = pytest.mark.skip(reason="torch._scaled_mm runs FP8 GEMMs on oneDNN on this CPU (AMX-INT8), about 70x "
                                       "slower than elsewhere: this FP8 test at long prompts / real widths would take "
                                       "hours (docs/fp8_facts.md); it runs on CPUs without AMX")
        for item in items:
            if any(all(part in item.nodeid for part in parts) for parts in SLOW_FP8_TESTS):
                item.add_marker(slow)


def pytest_collection_finish(session):
    """Everything the collected modules imported (torch, megatron-core, vLLM: millions of objects) moved out of
    the cyclic garbage collector's reach (``gc.freeze``): each later full collection of this long-lived process
    would traverse them all again. Objects created by the tests are collected as before."""
    gc.freeze()


def pytest_sessionfinish(session):
    """The controller (or a run without workers) removes the session's checkpoint cache."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        shutil.rmtree(TINY_CHECKPOINT_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """The number of vLLM engine cores this session started (in-process and in subprocesses), and the
    modules that started the most."""
    import collections

    from sitecustomize import ENGINE_START_LINE, TEST_FIELD_END

    lines = ENGINE_START_LOG.read_text().splitlines() if ENGINE_START_LOG.exists() else []
    modules = collections.Counter(line.split(TEST_FIELD_END)[0].split("::")[0]
                                  for line in lines if ENGINE_START_LINE in line)
    terminalreporter.write_line(f"vLLM engine starts in this session: {sum(modules.values())} "
                                f"(engine cores; a TP = 2 engine counts once per rank; log {ENGINE_START_LOG})")
    if modules:
        terminalreporter.write_line("  by module: " + ", ".join(f"{module} {count}"
                                                             for module, count in modules.most_common()))


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory):
    return write_model_config(tmp_path_factory.mktemp("tiny_llama_config"), TINY_LLAMA_CONFIG)


@pytest.fixture(scope="session")
def bf16_context(engine_model_dir):
    return vllm_context(EngineSpec(engine_model_dir))


@pytest.fixture(scope="session")
def fp8_context(engine_model_dir):
    return vllm_context(EngineSpec(engine_model_dir, quantization="fp8_per_channel"))


@pytest.fixture(scope="session")
def tiny_moe_context(tmp_path_factory):
    """``(name, **fields) -> VllmContext`` of a tiny Qwen3-MoE ``config.json`` (hidden 256, expert FFN
    128, 8 experts, top-2) with `fields` replacing its entries, written to a fresh directory `name`."""
    def make(name: str, **fields):
        path = write_model_config(tmp_path_factory.mktemp(name), {**TINY_QWEN3_MOE_CONFIG, **fields})
        return vllm_context(EngineSpec(path))
    return make


@pytest.fixture(scope="session")
def case_contexts(bf16_context, fp8_context, tiny_moe_context):
    """The contexts the registered layer-1 cases build their modules in (tiny Llama, FP8, Qwen3-MoE)."""
    from megatron_vllm_align.ops.registry import CaseContexts

    return CaseContexts(bf16=bf16_context, fp8=fp8_context, moe=tiny_moe_context("layer1_qwen3_moe"))


@pytest.fixture(scope="module")
def vllm_config():
    """vLLM ``CustomOp``s (``QuantFP8``) and kernel selection need a current ``VllmConfig``."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture(scope="module")
def invariant_module():
    """MVA_INVARIANT=1 for the whole test module's engines and trainers (restored afterwards); use
    with ``pytestmark = pytest.mark.usefixtures("invariant_module")``."""
    from megatron_vllm_align import invariance

    patch = pytest.MonkeyPatch()
    patch.setenv(invariance.ENV_VAR, "1")
    invariance.install()
    yield
    patch.undo()


def _logprob_delta_stats(name: str, ours: list[torch.Tensor], reference: list[torch.Tensor],
                         reference_name: str = "engine") -> tuple[float, float]:
    """(max, mean) |delta logprob| over all tokens of paired per-prompt logprobs, printed."""
    delta = torch.cat([a - b for a, b in zip(ours, reference, strict=True)]).abs()
    print(f"{name} vs {reference_name}: max |delta logprob| = {float(delta.max()):.3g}, "
          f"mean = {float(delta.mean()):.3g}, n = {delta.numel()}")
    return float(delta.max()), float(delta.mean())


@pytest.fixture
def delta_stats():
    """``(name, ours, reference, reference_name="engine") -> (max, mean)`` |delta logprob|, printed."""
    return _logprob_delta_stats


@pytest.fixture
def max_delta():
    """``(name, ours, reference, reference_name="engine") -> max`` |delta logprob|, printed."""
    return lambda *args, **kwargs: _logprob_delta_stats(*args, **kwargs)[0]


def _require_batch_dependence(control, workload: str) -> None:
    """AssertionError unless ``control`` (a ``ControlDelta``: the workload without the invariance layer
    against the bit-exact reference) differs: a zero there means ``workload`` never exercised batch
    dependence on this CPU, and the bit-exact claim beside it proves nothing here."""
    from megatron_vllm_align.megatron.cpu_report import cpu_isa

    isa = cpu_isa().describe()
    print(f"control ({workload}), invariance off: max |delta logprob| = {control.max_abs_delta_logprob:.3g} over "
          f"{control.tokens} tokens compared; {isa}", flush=True)
    assert control.tokens > 0, f"control ({workload}): no token to compare (every request resampled at once?)"
    assert control.exercised, (
        f"control: the same workload ({workload}) with the invariance layer off equals the reference on all "
        f"{control.tokens} tokens compared: the workload does not exercise batch dependence on this CPU ({isa}), "
        "so the bit-exact result beside it proves nothing here; lengthen the prompts or add concurrent requests")


@pytest.fixture(scope="session")
def require_batch_dependence():
    """``(control: ControlDelta, workload: str) -> None``: the control of a bit-exact claim must differ
    (printed with the CPU's ISA), else the test fails saying the workload does not exercise batch dependence."""
    return _require_batch_dependence


def _dispatch_thread_state() -> dict[str, object]:
    """What torch keeps per thread that a test can leave changed: autograd and inference mode, the dispatch
    keys included / excluded (a ``with`` block of ``no_dispatch()`` or ``inference_mode()`` held open by a
    suspended generator keeps its keys excluded after the test), the dispatch / function mode stacks."""
    return {"grad enabled": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
            "excluded keys": str(torch._C._dispatch_tls_local_exclude_set()),
            "included keys": str(torch._C._dispatch_tls_local_include_set()),
            "dispatch modes": torch._C._len_torch_dispatch_stack(),
            "function modes": torch._C._len_torch_function_stack()}


def _restore_dispatch_keys(before: dict[str, object]) -> None:
    """Set each dispatch key's thread-local included / excluded flag back to what `before` recorded."""
    for key in torch._C.DispatchKey.__members__.values():
        for field, current, set_flag in (
                ("excluded keys", torch._C._dispatch_tls_is_dispatch_key_excluded,
                 torch._C._dispatch_tls_set_dispatch_key_excluded),
                ("included keys", torch._C._dispatch_tls_is_dispatch_key_included,
                 torch._C._dispatch_tls_set_dispatch_key_included)):
            try:
                wanted = key.name in before[field].removeprefix("DispatchKeySet(").removesuffix(")").split(", ")
                if current(key) != wanted:
                    set_flag(key, wanted)
            except RuntimeError:  # keys that have no thread-local flag (aliases, runtime keys)
                pass


@pytest.fixture
def no_collection_while_tracing():
    """The cyclic garbage collector run before the test and off during it. For tests that call vLLM's
    ``torch.compile``-d sampler ops: a collection during dynamo's tracing can run a finaliser of an earlier
    test's garbage under the fake-tensor mode (vLLM's ``CPUDNNLGEMMHandler.__del__`` calls ``.item()``),
    which raises inside the tracer and leaves dispatch keys excluded."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_LEFT_INFERENCE_MODE_OFF = []  # inference_mode(False) guards entered to undo a test's leaked inference mode


@pytest.fixture(autouse=True)
def thread_state_left_unchanged(request):
    """Torch's per-thread state after every test as before it (:func:`_dispatch_thread_state`). Autograd left
    disabled by a test (or a library call in it) is named in a warning and restored. Any other change, e.g. a
    dispatch key left excluded, silently breaks every later test of this process ("does not require grad",
    "you set no_dispatch()"): the test that left it fails, naming the change, and the state is restored."""
    before = _dispatch_thread_state()
    yield
    after = _dispatch_thread_state()
    if not after["grad enabled"] and before["grad enabled"] and not after["inference mode"]:
        import warnings

        torch.set_grad_enabled(True)
        warnings.warn(f"{request.node.nodeid} left autograd disabled (restored)", stacklevel=1)
        after["grad enabled"] = True
    changed = {name: (before[name], after[name]) for name in before if after[name] != before[name]}
    if changed:
        if after["inference mode"] and not before["inference mode"]:
            guard = torch.inference_mode(False)
            guard.__enter__()
            _LEFT_INFERENCE_MODE_OFF.append(guard)
        _restore_dispatch_keys(before)
        torch.set_grad_enabled(bool(before["grad enabled"]))
        left = _dispatch_thread_state()
        pytest.fail(f"{request.node.nodeid} left torch's thread state changed (before -> after): {changed}; "
                    f"restored: {left == before}", pytrace=False)

"""Every value the recipe schema accepts for the options below builds its model and trains one step
(``run_sft`` in this process: real megatron-core model, vLLM's kernels in the aligned forward), and
each case asserts what the option is for: the frozen parameter bitwise unchanged, the dump's
gradients being the clipped ones the optimizer saw, the optimizer state's dtypes, the checkpoint
written, the FP8 forward differing from the bf16 one. A value that does not work is refused by
``load_recipe`` naming its key.

Cases start from ``recipes/tiny_llama_sft.yaml`` with ``train.steps=1`` and a small batch and vary
one option (or one option on the native arm); :func:`test_every_accepted_value_has_a_training_case`
fails when the schema starts accepting a value of a listed key that no case trains.

Not covered here: ``model.source: hf`` with ``model.path``, ``data.jsonl`` and ``train.export_dir``
(``test_hf_train_export.py``), ``train.resume_from`` (``test_train_resume.py``), the ``layer3`` and
``rl`` sections (``test_layer3.py``, ``tests/rl/``). The recipe has no activation
recompute option: the trainer builds the model with the default TransformerConfig
(``run_setup.build_model``); Megatron's recompute on the aligned model is tested through
``build_gpt_from_hf(..., recompute_granularity=...)`` in ``tests/megatron/test_vllm_recompute.py``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_vllm_align.guards import load_gradient_dump
from megatron_vllm_align.train.config import (
    ALIGN_QUANTIZATIONS,
    Recipe,
    RecipeError,
    _field_type,
    load_recipe,
)
from megatron_vllm_align.train.run import run_sft
from megatron_vllm_align.train.run_setup import checkpoint_fit
from megatron_vllm_align.train.trainer import lr_at

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_llama_sft.yaml"
ONE_STEP = ["train.steps=1", "train.global_batch_size=2", "data.num_train=8", "data.num_validation=2",
            "train.progress_bar=false", "train.save_every=0", "guards.gradient_dump_every=0"]
FROZEN = "decoder.final_layernorm.weight"  # HF name: model.norm.weight
FROZEN_HF = "model.norm.weight"
MOVED, MOVED_HF = "decoder.layers.0.mlp.linear_fc2.weight", "model.layers.0.mlp.down_proj.weight"
# keys whose every accepted value (a Literal's choices, a bool's two) must be trained by some case
ENUMERATED_KEYS = ("align.enabled", "align.quantization", "align.backward_precision", "optimizer.main_params_dtype",
                   "model.params_dtype", "model.tiny.architecture", "guards.optimizer_identity")


def _recipe(run_dir: Path, *overrides: str) -> Recipe:
    return load_recipe(RECIPE, [*ONE_STEP, f"train.run_dir={run_dir}", *overrides])


def _run(run_dir: Path, *overrides: str) -> tuple[Recipe, dict]:
    recipe = _recipe(run_dir, *overrides)
    return recipe, run_sft(recipe)


def _step(result: dict) -> dict:
    (steps,) = result["arms"].values()
    assert [m["step"] for m in steps] == [1]
    return steps[0]


def _state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "step_000001" / "state.pt", weights_only=True)


def _initial(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "initial_model" / "model.safetensors")


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """``baselines(align)``: (recipe, result) of the unchanged one-step recipe, run once per arm."""
    done: dict[bool, tuple[Recipe, dict]] = {}

    def get(align: bool) -> tuple[Recipe, dict]:
        if align not in done:
            done[align] = _run(tmp_path_factory.mktemp(f"baseline_{align}"), f"align.enabled={str(align).lower()}")
        return done[align]
    return get


# --- per-case checks: (recipe, result, run_dir, baselines) -------------------------------------


def _same_start_as_baseline(recipe, result, run_dir, baselines):
    """An option that does not touch the forward: the loss and gradient norm at the initial
    parameters are the baseline's, bit for bit."""
    base = _step(baselines(recipe.align.enabled)[1])
    step = _step(result)
    assert (step["train_loss"], step["grad_norm"]) == (base["train_loss"], base["grad_norm"])
    assert result["val_nll_initial"] == baselines(recipe.align.enabled)[1]["val_nll_initial"]


def check_baseline(recipe, result, run_dir, baselines):
    step = _step(result)
    assert step["clipped"]
    assert step["clip_coef"] == pytest.approx(recipe.optimizer.clip_grad / (step["grad_norm"] + 1e-6))
    assert result["checkpoints"] == [] and not (run_dir / "checkpoints").exists()
    assert not (run_dir / "gradient_dumps").exists()


def check_native(recipe, result, run_dir, baselines):
    assert set(result["arms"]) == {"native"} and result["align_enabled"] is False
    native, aligned = _step(result)["train_loss"], _step(baselines(True)[1])["train_loss"]
    assert native != aligned and abs(native - aligned) < 2e-2  # Megatron's kernels: bf16 noise apart


def check_fp8(recipe, result, run_dir, baselines):
    fp8, bf16 = _step(result)["train_loss"], _step(baselines(True)[1])["train_loss"]
    assert fp8 != bf16 and abs(fp8 - bf16) < 5e-2  # W8A8 FP8 linears: a different, close forward
    state = _state(run_dir)
    assert all(t.dtype == torch.bfloat16 for t in state["model"].values())  # the masters stay bf16
    assert _step(result)["grad_norm"] != _step(baselines(True)[1])["grad_norm"]


def check_quantization_ignored_by_native(recipe, result, run_dir, baselines):
    """The native arm has no vLLM quantization: the FP8 setting leaves its step unchanged (the
    layer-3 native arms are built from the same recipe)."""
    assert result["align_enabled"] is False
    assert _step(result) | {"tokens_per_s": None} == _step(baselines(False)[1]) | {"tokens_per_s": None}


def check_optimizer_state_dtype(main_dtype: torch.dtype | None, param_dtype: torch.dtype):
    def check(recipe, result, run_dir, baselines):
        state = _state(run_dir)
        assert {t.dtype for t in state["model"].values()} == {param_dtype}
        optimizer = state["optimizer"]
        slots = optimizer["state"].values()
        assert slots and all(s["exp_avg"].dtype == (main_dtype or param_dtype) for s in slots)
        if main_dtype is None:
            assert optimizer["main_params"] == {}
        else:
            assert len(optimizer["main_params"]) == len(state["model"])
            assert all(m.dtype == main_dtype for m in optimizer["main_params"].values())
            for i, (name, param) in enumerate(state["model"].items()):  # params = the rounded main copies
                assert torch.equal(optimizer["main_params"][i].to(param.dtype), param), name
        if param_dtype == torch.float32:  # bf16 checkpoint values, stepped in fp32: no longer bf16 values
            assert _initial(run_dir)[MOVED_HF].dtype == torch.bfloat16
            assert not torch.equal(state["model"][MOVED].bfloat16().float(), state["model"][MOVED])
        if recipe.model.params_dtype == "bfloat16":
            _same_start_as_baseline(recipe, result, run_dir, baselines)
    return check


def _dump_norm(run_dir: Path) -> tuple[float, dict[str, torch.Tensor]]:
    dump = load_gradient_dump(run_dir / "gradient_dumps", 0)
    assert dump.step == 0 and dump.world_size == 1
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in dump.grads.values())), dump.grads


def check_dump(recipe, result, run_dir, baselines):
    """The dump holds the gradients the optimizer steps with: fp32 (main copies), clipped."""
    step = _step(result)
    norm, grads = _dump_norm(run_dir)
    assert sorted(p.name for p in (run_dir / "gradient_dumps").iterdir()) == ["step_00000000"]
    meta = json.loads((run_dir / "checkpoints" / "step_000001" / "meta.json").read_text())
    assert set(grads) == set(meta["parameters"])
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads.values())
    assert norm == pytest.approx(step["grad_norm"] * step["clip_coef"], rel=1e-5)
    if recipe.optimizer.clip_grad > 0:
        assert step["clipped"] and norm == pytest.approx(recipe.optimizer.clip_grad, rel=1e-5)
    else:
        assert not step["clipped"] and step["clip_coef"] == 1.0 and norm > 1.5  # unclipped: the raw norm
    _same_start_as_baseline(recipe, result, run_dir, baselines)


def check_freeze(recipe, result, run_dir, baselines):
    state, initial = _state(run_dir)["model"], _initial(run_dir)
    assert torch.equal(state[FROZEN], initial[FROZEN_HF])
    assert not torch.equal(state[MOVED], initial[MOVED_HF])
    _, grads = _dump_norm(run_dir)
    assert FROZEN not in grads and MOVED in grads


def check_saved(recipe, result, run_dir, baselines):
    checkpoint = run_dir / "checkpoints" / "step_000001"
    assert result["checkpoints"] == [str(checkpoint)]
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["step"] == 1 and meta["fit"] == json.loads(json.dumps(checkpoint_fit(recipe)))
    state = _state(run_dir)
    assert state["history"]["steps"] == result["arms"]["aligned"]
    assert not torch.equal(state["model"][MOVED], _initial(run_dir)[MOVED_HF])
    _same_start_as_baseline(recipe, result, run_dir, baselines)


def check_architecture(recipe, result, run_dir, baselines):
    initial = _initial(run_dir)
    moe = recipe.model.tiny.architecture.endswith("_moe")
    assert any(".mlp.experts." in name for name in initial) == moe
    architecture = recipe.model.tiny.architecture
    assert any(name.endswith("q_norm.weight") for name in initial) == architecture.startswith("qwen3")
    assert any(name.endswith("q_proj.bias") for name in initial) == architecture.startswith("qwen2")
    assert _step(result)["train_loss"] != _step(baselines(True)[1])["train_loss"]


def check_engine_layout(recipe, result, run_dir, baselines):
    """The forward computes a TP = 2 engine's shards: the same weights give another first-step loss (the
    row-parallel sums round differently; bit-exactness against a real TP = 2 engine:
    tests/distributed/test_tensor_parallel.py)."""
    assert recipe.align.engine_tensor_parallel_size == 2
    own = _run(run_dir.parent / "own", "model.tiny.vocab_size=384")[1]
    ours, theirs = _step(result)["train_loss"], _step(own)["train_loss"]
    assert ours != theirs and abs(ours - theirs) < 1e-2 * abs(theirs)


def check_fp32_backward(recipe, result, run_dir, baselines):
    """The fp32 closed-form backward ran (the run says so, and the process is back at the library's after
    it); the forward is untouched (loss and initial validation NLL are the baseline's bits) and the
    gradient is the library's up to bf16 rounding."""
    from megatron_vllm_align.ops.dense_linear import current_backward_precision

    _, base = baselines(True)
    assert result["backward_precision"] == "fp32" and base["backward_precision"] == "library"
    assert current_backward_precision() == "library"
    step, base_step = _step(result), _step(base)
    assert step["train_loss"] == base_step["train_loss"] and result["val_nll_initial"] == base["val_nll_initial"]
    assert step["grad_norm"] == pytest.approx(base_step["grad_norm"], rel=1e-2)


CASES = [
    pytest.param([], check_baseline, id="aligned-bf16"),
    pytest.param(["align.backward_precision=fp32"], check_fp32_backward, id="align.backward_precision=fp32"),
    pytest.param(["align.engine_tensor_parallel_size=2", "model.tiny.vocab_size=384"], check_engine_layout,
                 id="align.engine_tensor_parallel_size=2"),
    pytest.param(["align.enabled=false"], check_native, id="align.enabled=false"),
    *[pytest.param([f"align.quantization={q}", "train.save_every=1"], check_fp8, id=f"align.quantization={q}")
      for q in ALIGN_QUANTIZATIONS if q is not None],
    *[pytest.param(["align.enabled=false", f"align.quantization={q}"], check_quantization_ignored_by_native,
                   id=f"native-align.quantization={q}") for q in ALIGN_QUANTIZATIONS if q is not None],
    pytest.param(["optimizer.main_params_dtype=none", "train.save_every=1"],
                 check_optimizer_state_dtype(None, torch.bfloat16), id="optimizer.main_params_dtype=none"),
    pytest.param(["train.save_every=1"], check_optimizer_state_dtype(torch.float32, torch.bfloat16),
                 id="optimizer.main_params_dtype=float32"),
    pytest.param(["align.enabled=false", "model.params_dtype=float32", "train.save_every=1"],
                 check_optimizer_state_dtype(None, torch.float32), id="native-model.params_dtype=float32"),
    pytest.param(["align.enabled=false", "model.params_dtype=float32", "optimizer.main_params_dtype=none",
                  "train.save_every=1"], check_optimizer_state_dtype(None, torch.float32),
                 id="native-model.params_dtype=float32-main_params_dtype=none"),
    pytest.param(["guards.gradient_dump_every=1", "train.save_every=1"], check_dump,
                 id="guards.gradient_dump_every=1-optimizer.clip_grad=1"),
    pytest.param(["guards.gradient_dump_every=1", "train.save_every=1", "optimizer.clip_grad=0"], check_dump,
                 id="guards.gradient_dump_every=1-optimizer.clip_grad=0"),
    pytest.param(["align.enabled=false", "guards.gradient_dump_every=1", "train.save_every=1", "optimizer.clip_grad=0"],
                 check_dump, id="native-guards.gradient_dump_every=1-optimizer.clip_grad=0"),
    pytest.param(["guards.optimizer_identity=false"], _same_start_as_baseline, id="guards.optimizer_identity=false"),
    pytest.param([f"guards.freeze=[{FROZEN}]", "guards.gradient_dump_every=1", "train.save_every=1"], check_freeze,
                 id="guards.freeze"),
    pytest.param(["align.enabled=false", f"guards.freeze=[{FROZEN}]", "guards.gradient_dump_every=1",
                  "train.save_every=1"], check_freeze, id="native-guards.freeze"),
    pytest.param(["train.save_every=1"], check_saved, id="train.save_every=1"),
    pytest.param(["train.save_every=4"], check_saved, id="train.save_every=4-saves-the-last-step"),
    *[pytest.param([f"model.tiny.architecture={arch}"], check_architecture, id=f"model.tiny.architecture={arch}")
      for arch in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")],
]


@pytest.mark.parametrize("overrides, check", CASES)
def test_option_builds_and_trains_one_step(tmp_path, baselines, overrides, check):
    run_dir = tmp_path / "run"
    recipe, result = _run(run_dir, *overrides)
    assert load_recipe(run_dir / "recipe.yaml") == recipe  # the resolved recipe round-trips
    assert json.loads((run_dir / "metrics.json").read_text()) == result and result["status"] == "complete"
    assert result["align_enabled"] is recipe.align.enabled and result["world_size"] == 1
    step = _step(result)
    vocab = recipe.model.tiny.vocab_size
    for key in ("train_loss", "val_nll", "grad_norm", "update_rms"):
        assert math.isfinite(step[key]) and step[key] > 0, key
    assert abs(step["train_loss"] - math.log(vocab)) < 0.5  # a random model: about uniform over the vocabulary
    assert abs(result["val_nll_initial"] - math.log(vocab)) < 0.5 and step["val_nll"] < result["val_nll_initial"] + 0.1
    assert step["nonfinite"] == 0 and not step["skipped"] and step["lr"] == lr_at(1, 1, recipe.optimizer)
    assert step["loss_tokens"] > 0 and step["tokens"] > step["loss_tokens"]
    check(recipe, result, run_dir, baselines)


def _accepted_values(key: str) -> set:
    import typing

    annotation = _field_type(Recipe, key.split("."), key)
    if annotation is bool:
        return {True, False}
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    values: set = set()
    for option in typing.get_args(annotation) or (annotation,):
        values |= set(typing.get_args(option)) if typing.get_origin(option) is typing.Literal else {None}
    return values


def test_every_accepted_value_has_a_training_case(tmp_path):
    trained: dict[str, set] = {key: set() for key in ENUMERATED_KEYS}
    for case in CASES:
        recipe = _recipe(tmp_path, *case.values[0])
        for key in ENUMERATED_KEYS:
            value = recipe
            for part in key.split("."):
                value = getattr(value, part)
            trained[key].add(value)
    for key in ENUMERATED_KEYS:
        assert trained[key] == _accepted_values(key), key
    assert set(ALIGN_QUANTIZATIONS) == {None, "fp8_per_channel"}


@pytest.mark.parametrize("overrides, message", [
    (["align.quantization=fp8"], r"^align\.quantization: must be one of \['fp8_per_channel'\], got 'fp8'$"),
    (["align.backward_precision=fp16"],
     r"^align\.backward_precision: must be one of \['library', 'fp32'\], got 'fp16'$"),
    (["align.quantization=fp8_per_tensor"], r"^align\.quantization: must be one of"),
    (["align.quantization=fp8_per_block"], r"^align\.quantization: must be one of"),
    (["align.quantization=compressed-tensors"], r"^align\.quantization: must be one of"),
    (["align.quantization="], r"^align\.quantization: must be one of"),
    (["model.params_dtype=float32"], r"^model\.params_dtype: the aligned model runs in the engine dtype bfloat16"),
    (["optimizer.main_params_dtype=float16"], r"^optimizer\.main_params_dtype: must be one of"),
    (["optimizer.clip_grad=-1"], r"^optimizer\.clip_grad: must be >= 0"),
    (["guards.gradient_dump_every=-1"], r"^guards\.gradient_dump_every: must be >= 0"),
    (["train.save_every=-1"], r"^train\.save_every: must be >= 0"),
    (["parallel.expert_model_parallel_size=2"],
     r"^parallel\.expert_model_parallel_size: must be 1 or parallel\.tensor_model_parallel_size=1"),
    (["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2", "train.save_every=0"],
     r"^parallel\.expert_model_parallel_size: expert parallelism needs an MoE model, "
     r"model\.tiny\.architecture is 'llama'"),
    (["parallel.tensor_model_parallel_size=0"], r"^parallel\.tensor_model_parallel_size: must be >= 1"),
    (["parallel.tensor_model_parallel_size=2", "align.engine_tensor_parallel_size=4"],
     r"^align\.engine_tensor_parallel_size: a trainer at parallel\.tensor_model_parallel_size=2 computes an engine "
     r"at TP 4 only at its own size"),
    (["parallel.tensor_model_parallel_size=2", "train.save_every=0", "align.enabled=false"],
     r"^align\.enabled: not supported with parallel\.tensor_model_parallel_size=2"),
])
def test_value_that_cannot_train_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=message):
        _recipe(tmp_path, *overrides)


def test_quantization_in_a_recipe_file_is_checked_too(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.read_text().replace("quantization: null", "quantization: fp8_per_tensor"))
    with pytest.raises(RecipeError,
                       match=r"^align\.quantization: must be one of \['fp8_per_channel'\], got 'fp8_per_tensor'$"):
        load_recipe(path)
    path.write_text(RECIPE.read_text().replace("quantization: null", "quantization: 8"))
    with pytest.raises(RecipeError, match=r"^align\.quantization: must be one of .*got 8$"):
        load_recipe(path)


def test_unknown_freeze_name_is_refused_before_any_step(tmp_path):
    with pytest.raises(ValueError, match=r"guards\.freeze: no parameter named \['decoder\.nope'\]"):
        _run(tmp_path / "run", "guards.freeze=[decoder.nope]")
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_align_section_built_in_code_is_checked_too():
    from megatron_vllm_align.train.config import AlignSection

    assert AlignSection(quantization="fp8_per_channel").quantization == "fp8_per_channel"
    with pytest.raises(RecipeError,
                       match=r"^align\.quantization: must be one of \[None, 'fp8_per_channel'\], got 'fp8'$"):
        AlignSection(quantization="fp8")

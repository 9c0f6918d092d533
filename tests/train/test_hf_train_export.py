"""A user's checkpoint trained from a recipe and exported: ``model.source: hf`` with ``model.path``, text
from a JSONL field tokenised by the checkpoint's own tokenizer, a few aligned steps, ``train.export_dir``
written as sharded safetensors + config + tokenizer; the export holds exactly the trained weights, and
a real vLLM engine loading it gives the trainer's prompt logprobs bitwise (and, with the invariance layer,
its sampled-token logprobs). Bad data is refused naming the file, line and field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model, save_byte_level_tokenizer
from megatron_vllm_align.train.config import RecipeError
from megatron_vllm_align.train.data import DataError
from megatron_vllm_align.train.run import run_sft

TEXTS = [f"Note {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 50} marbles." for i in range(14)]


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory) -> Path:
    """A Hugging Face Llama directory with its own (byte-level BPE) tokenizer, as a user brings one."""
    directory = build_tiny_hf_model(tmp_path_factory.mktemp("user") / "llama", TinyModelConfig(seed=21))
    return save_byte_level_tokenizer(directory)


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "notes.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": t}) + "\n" for i, t in enumerate(TEXTS)))
    return path


def _overrides(checkpoint: Path, texts: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["model.source=hf", f"model.path={checkpoint}", f"data.jsonl={texts}", "data.text_field=content",
            "data.num_train=10", "data.num_validation=2", "train.steps=3", "train.global_batch_size=4",
            "train.save_every=3", "train.progress_bar=false", f"train.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def trained(user_checkpoint, texts, tmp_path_factory):
    from megatron_vllm_align.train.config import load_recipe

    run_dir = tmp_path_factory.mktemp("run")
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_llama_sft.yaml",
                         _overrides(user_checkpoint, texts, run_dir, "train.export_dir=export",
                                    "train.export_shard_mb=1"))
    return run_dir, run_sft(recipe)


def test_text_is_tokenised_with_the_checkpoints_tokenizer(user_checkpoint, texts):
    from transformers import AutoTokenizer

    from megatron_vllm_align.train.data import jsonl_splits

    splits = jsonl_splits(texts, "content", user_checkpoint, 10, 2, max_length=24, vocab_size=512)
    tokenizer = AutoTokenizer.from_pretrained(user_checkpoint)
    expected = [*tokenizer(TEXTS[0])["input_ids"], tokenizer.eos_token_id][:24]
    assert splits.train[0].tokens.tolist() == expected and expected[0] == tokenizer.bos_token_id
    assert len(splits.train) == 10 and len(splits.validation) == 2
    assert splits.validation[1].tokens.tolist()[:5] == tokenizer(TEXTS[11])["input_ids"][:5]
    assert bool(splits.train[0].loss_mask.all()) and splits.train[0].loss_mask.numel() == 23


def test_training_runs_and_the_export_is_sharded_and_complete(trained):
    run_dir, result = trained
    steps = result["arms"]["aligned"]
    assert len(steps) == 3 and steps[-1]["train_loss"] < steps[0]["train_loss"]
    export = Path(result["export"])
    assert export == run_dir / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = sorted(export.glob("model-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (export / name).is_file(), name
    assert not list(run_dir.glob(".export.*"))   # no staging directory left


def test_export_holds_exactly_the_trained_weights(trained, user_checkpoint):
    from megatron_vllm_align.megatron.hf_checkpoint import megatron_state_dict_from_hf, read_hf_config

    run_dir, result = trained
    export = Path(result["export"])
    tensors = {}
    for shard in export.glob("model-*.safetensors"):
        tensors.update(load_file(shard))
    exported = megatron_state_dict_from_hf(tensors, read_hf_config(export))
    final = torch.load(Path(result["checkpoints"][-1]) / "state.pt", weights_only=False)["model"]
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    initial = load_file(user_checkpoint / "model.safetensors")
    down_proj = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(tensors[down_proj], initial[down_proj])


@pytest.mark.engine
def test_engine_on_the_export_equals_the_trainer(trained, tmp_path):
    from vllm import SamplingParams

    from megatron_vllm_align import invariance
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.engine.vllm_reference import (
        ReferenceEngineConfig,
        prompt_logprobs,
        sample_completions,
        shutdown_engine,
        start_reference_engine,
    )
    from megatron_vllm_align.megatron import build_gpt_from_hf, init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import completion_logprobs, token_logprobs

    export = Path(trained[1]["export"])
    prompts = random_token_sequences((5, 17, 33), vocab_size=512, seed=4)
    params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, seed=i, ignore_eos=True)
              for i, n in enumerate((12, 4, 8))]
    with invariance.switched(True):
        llm = start_reference_engine(export, ReferenceEngineConfig(kv_cache_bytes=64 * 1024 * 1024))
        try:
            engine_prompt = prompt_logprobs(llm, prompts)
            completions = sample_completions(llm, prompts, params)
        finally:
            shutdown_engine(llm)
        init_single_process_cpu()
        model = build_gpt_from_hf(export, align=True)
        with torch.no_grad():
            ours = token_logprobs(model, prompts)
            sampled = completion_logprobs(model, prompts, [c.tokens for c in completions])
    assert all(torch.equal(a, b) for a, b in zip(ours, engine_prompt, strict=True))
    assert all(torch.equal(a, c.logprobs) for a, c in zip(sampled, completions, strict=True))


@pytest.mark.parametrize("lines, field, match", [
    (["{\"content\": \"fine text\"}", "not json"], "content", r"notes.jsonl:2: not JSON"),
    (["{\"content\": \"fine text\"}", "{\"body\": \"x\"}"], "content", r":2: no non-empty string field 'content'"),
    (["{\"content\": \"fine text\"}"], "content", r"1 lines, but data.num_train \+ data.num_validation = 2"),
])
def test_bad_text_data_is_refused_naming_file_line_and_field(user_checkpoint, tmp_path, lines, field, match):
    from megatron_vllm_align.train.data import jsonl_splits

    path = tmp_path / "notes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=match):
        jsonl_splits(path, field, user_checkpoint, 1, 1, max_length=16, vocab_size=512)


def test_text_data_without_a_tokenizer_is_refused(tmp_path, texts):
    from megatron_vllm_align.train.data import jsonl_splits

    bare = build_tiny_hf_model(tmp_path / "bare", TinyModelConfig(seed=22))
    with pytest.raises(DataError, match="needs the checkpoint's tokenizer"):
        jsonl_splits(texts, "content", bare, 2, 1, max_length=16, vocab_size=512)


def test_recipe_refuses_text_data_without_an_hf_model(texts):
    from megatron_vllm_align.train.config import load_recipe

    with pytest.raises(RecipeError, match=r"^data\.jsonl: .*model\.source \"hf\""):
        load_recipe(None, [f"data.jsonl={texts}"])
    with pytest.raises(RecipeError, match=r"^model\.path: required"):
        load_recipe(None, ["model.source=hf"])

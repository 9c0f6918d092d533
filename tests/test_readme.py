"""Every fenced code block of README.md and of the guide it links, docs/usage.md, is executed here, or is
a named exemption whose mapping is asserted.

Python blocks run as written in a fresh ``sys.executable -c`` process (cwd: a temporary directory,
so ``dumps/`` and the like stay out of the checkout). Only two things are substituted: placeholder
paths (``"path/to/hf_llama"``, ``"path/to/hf_qwen3_moe"``) by tiny local checkpoints, and the
placeholder names a block uses without defining (``model``, ``prompts``, ``candidate``, ...;
exactly the block's free names, checked) by a prelude of real objects, inserted right before the
block's first statement that uses one (so that, e.g., ``model`` is built after the block has set
``MVA_INVARIANT=1``, as it must be). After each block, a few assertions on what it produced.

Bash blocks: every command line runs as written from the repository root, with one override
added (``train.run_dir=<tmp>``) so that runs do not write to, or reuse, ``runs/`` in the shared
checkout; the exit status and values of the run's output file are asserted. ``make demo`` and
``make test`` are exemptions (see :data:`EXEMPT`).

:func:`test_every_readme_block_is_covered` fails when README or the guide gains a block that no entry
here covers (each entry names an anchor, a string only its block contains). :func:`test_readme_is_a_door`
keeps README short and its links and docs/proof.md's test paths real.
"""
from __future__ import annotations

import ast
import builtins
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_vllm_align.utils.torchrun import free_port, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "usage.md"
DOCUMENTS = (README, GUIDE)  # the files whose fenced blocks run here
README_MAX_LINES = 150
TIMEOUT_S = 300
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# torchrun / engine variables of an enclosing run must not leak into the commands and snippets
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "MVA_INVARIANT", "TORCHELASTIC_RUN_ID")


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of README.md, then of docs/usage.md, in order."""
    return [(lang, text) for path in DOCUMENTS for lang, text in FENCE.findall(path.read_text(encoding="utf-8"))]


def block(anchor: str) -> str:
    """The text of the one README / guide block containing `anchor`."""
    found = [text for _, text in readme_blocks() if anchor in text]
    assert len(found) == 1, f"{len(found)} README / docs/usage.md blocks contain {anchor!r}"
    return found[0]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


# --- python blocks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    """A README python block: `anchor` finds it; `paths` maps placeholder path literals to keys of the
    ``checkpoints`` fixture; `prelude` defines exactly the `names` it uses undefined (``{ckpt[key]}``
    in it is the checkpoint path); `check` runs after it."""

    anchor: str
    names: frozenset[str]
    prelude: str = ""
    check: str = ""
    paths: dict[str, str] = field(default_factory=dict)


def free_names(code: str) -> set[str]:
    """Names `code` reads but never binds (not builtins)."""
    loaded, bound = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def with_prelude(code: str, names: set[str], prelude: str) -> str:
    """`code` with `prelude` inserted before its first top-level statement that reads one of `names`."""
    if not names:
        return prelude + code
    lines = code.splitlines(keepends=True)
    for statement in ast.parse(code).body:
        if free_names(ast.unparse(statement)) & names:
            at = statement.lineno - 1
            return "".join(lines[:at]) + prelude + "".join(lines[at:])
    raise AssertionError(f"no statement reads {sorted(names)}")


def snippet_code(snippet: Snippet, checkpoints: dict[str, Path]) -> str:
    code = block(snippet.anchor)
    for placeholder, key in snippet.paths.items():
        literal = f'"{placeholder}"'
        assert literal in code, f"README block lost its placeholder {literal}"
        code = code.replace(literal, repr(str(checkpoints[key])))
    assert free_names(code) == snippet.names, "the block's undefined names are not the declared placeholders"
    prelude = snippet.prelude.format(ckpt={k: repr(str(v)) for k, v in checkpoints.items()})
    return with_prelude(code, set(snippet.names), textwrap.dedent(prelude)) + "\n" + textwrap.dedent(snippet.check)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def _ok(completed: subprocess.CompletedProcess, what: str) -> None:
    assert completed.returncode == 0, f"{what} failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n" \
                                      f"{completed.stderr[-5000:]}"


USING_IT = Snippet(
    anchor='build_gpt_from_hf("path/to/hf_llama", align=True)    # megatron-core GPTModel, vLLM forward',
    names=frozenset(),
    paths={"path/to/hf_llama": "llama"},
    check="""
    import torch as _torch
    assert len(logprobs) == 2 and logprobs[0].shape == (3,) and logprobs[1].shape == (1,)
    assert all(bool((lp < 0).all()) and lp.dtype == _torch.float32 for lp in logprobs)
    assert type(model).__name__ == "GPTModel"
    """,
)

SAMPLED = Snippet(
    anchor='start_reference_engine("path/to/hf_qwen3_moe"', names=frozenset({"prompts", "model", "torch"}),
    paths={"path/to/hf_qwen3_moe": "qwen3_moe"},
    # the engine's KV cache: ReferenceEngineConfig's default bound (256 MiB), as the block writes it
    prelude="""\
    import torch
    from megatron_vllm_align import build_gpt_from_hf
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    prompts = random_token_sequences((5, 9, 14), vocab_size=512, seed=12)
    model = build_gpt_from_hf({ckpt[qwen3_moe]}, align=True)   # the trainer's aligned MoE model, built invariant
    """,
    check="""
    assert len(rollouts) == len(ours) == 3 and sum(len(r.tokens) for r in rollouts) > 3
    assert [len(a) for a in ours] == [len(r.tokens) for r in rollouts]
    assert all(r.routed_experts.shape[:2] == (len(r.prompt) + len(r.tokens) - 1, 2) for r in rollouts)
    assert all(bool(torch.isfinite(r.logprobs).all() and (r.logprobs <= 0).all()) for r in rollouts)
    print("sampled tokens:", sum(len(r.tokens) for r in rollouts))
    """,
)

COMPARE_VJP = Snippet(
    anchor="compare_vjp(candidate, reference", names=frozenset({"torch", "candidate", "reference", "x"}),
    # candidate: vLLM's RMSNorm at hidden 4096 (the block's reduction length), reference: its float64 reference
    prelude="""\
    import torch
    from megatron_vllm_align.ops.rms_norm.case import rms_norm_builder
    from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
    from megatron_vllm_align.validation.layer1_suite import TINY_LLAMA_CONFIG, write_model_config
    candidate, reference, (x,) = rms_norm_builder(
        vllm_context(EngineSpec(write_model_config("engine_config", TINY_LLAMA_CONFIG))), 4096, fused=False)(0, 37)
    """,
    check="""
    assert report.passed and report.name == "VllmRMSNorm" and len(report.checks) >= 8
    assert {"random", "zero", "sparse", "along_output"} <= {c.dy_kind for c in report.checks}
    assert reasoning and report.tolerance_reasoning == reasoning
    """,
)

GUARDS = Snippet(
    anchor="GradientDumper(optimizer", names=frozenset({"model", "optimizer", "frozen_names"}),
    prelude="""\
    import torch
    from megatron_vllm_align import build_gpt_from_hf, token_logprobs
    model = build_gpt_from_hf({ckpt[llama]}, align=True)
    frozen_names = ["decoder.final_layernorm.weight"]
    model.get_parameter(frozen_names[0]).requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    (-torch.cat(token_logprobs(model, [[1, 5, 9, 2], [7, 3, 4]])).sum()).backward()
    _before = {{name: p.detach().clone() for name, p in model.named_parameters()}}
    """,
    check="""
    from megatron_vllm_align import load_gradient_dump
    _trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    _dump = load_gradient_dump("dumps/", 0)
    assert set(_dump.grads) == set(_trainable) and frozen_names[0] not in _dump.grads
    assert all(torch.equal(_dump.grads[name], p.grad) for name, p in _trainable.items())
    assert torch.equal(model.get_parameter(frozen_names[0]), _before[frozen_names[0]])
    assert all(not torch.equal(p, _before[name]) for name, p in _trainable.items())   # the step ran
    """,
)

THREE_WAY = Snippet(
    anchor="assert_close_three_way(fp32_outputs",
    names=frozenset({"fp32_outputs", "bf16_reference_outputs", "our_outputs"}),
    # an MLP: Hugging Face's LlamaMLP in fp32 (golden) and bf16 (reference), ours = vLLM's linears and SiLU-and-mul
    prelude="""\
    import copy
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
    from megatron_vllm_align.ops.silu_and_mul.module import VllmSiluAndMul
    from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
    _config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, num_hidden_layers=1, vocab_size=512, dtype="bfloat16")
    _config.save_pretrained("engine_config")
    _context = vllm_context(EngineSpec("engine_config"))
    torch.manual_seed(2)
    _hf = LlamaMLP(_config).eval()
    with torch.no_grad():
        for _p in _hf.parameters():
            _p.copy_(_p.bfloat16().float())            # a bf16 checkpoint
    def _linear(k, n, prefix, weight):
        layer = VllmDenseLinear(k, n, vllm_context=_context, prefix=prefix)
        with torch.no_grad():
            layer.weight.copy_(weight.bfloat16())
        layer.refresh_deployed()
        return layer
    _gate_up = _linear(256, 1024, "model.layers.0.mlp.gate_up_proj",
                       torch.cat((_hf.gate_proj.weight, _hf.up_proj.weight)))
    _act = VllmSiluAndMul(vllm_context=_context)
    _down = _linear(512, 256, "model.layers.0.mlp.down_proj", _hf.down_proj.weight)
    _hf_bf16 = copy.deepcopy(_hf).bfloat16()
    _inputs = [torch.randn(98, 256, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(10)]
    with torch.no_grad():
        fp32_outputs = [_hf(x.float()) for x in _inputs]
        bf16_reference_outputs = [_hf_bf16(x) for x in _inputs]
        our_outputs = [_down(_act(_gate_up(x))) for x in _inputs]
    """,
    check="""
    assert result.passed and result.name == "mlp/prefill" and result.n_inputs == 10
    assert result.n_elements == 10 * 98 * 256 and 0 < result.worst_l2_ratio < 3
    """,
)

TENSOR_PARALLEL = Snippet(
    anchor="parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)", names=frozenset(),
    paths={"path/to/hf_llama": "llama"},
    check="""
    import torch as _torch
    if dist.get_rank() == 0:
        _torch.save(logprobs, "logprobs.pt")
    """,
)

FSDP2 = Snippet(
    anchor="model = fully_shard_aligned(build_gpt_from_hf(", names=frozenset(),
    paths={"path/to/hf_llama": "llama"},
    check="""
    torch.save([lp.detach() for lp in logprobs], f"logprobs{dist.get_rank()}.pt")
    """,
)
FSDP2_SHARES = ([[1, 5, 9, 2]], [[7, 3]])

SNIPPETS = {"using_it": USING_IT, "sampled_tokens": SAMPLED, "compare_vjp": COMPARE_VJP, "guards": GUARDS,
            "three_way": THREE_WAY, "tensor_parallel": TENSOR_PARALLEL, "fsdp2": FSDP2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from megatron_vllm_align.engine.tiny_models import (
        TinyModelConfig,
        build_tiny_hf_model,
    )

    root = tmp_path_factory.mktemp("readme_checkpoints")
    return {"llama": build_tiny_hf_model(root / "llama", TinyModelConfig(architecture="llama", seed=0)),
            "qwen3_moe": build_tiny_hf_model(root / "qwen3_moe", TinyModelConfig(architecture="qwen3_moe", seed=21))}


def test_readme_first_snippet_runs_in_a_fresh_process(checkpoints, tmp_path):
    """README's "Using it" snippet, as written, in a fresh Python: the build sets up the one-process
    CPU state itself (no ``init_single_process_cpu`` in the block)."""
    code = block(USING_IT.anchor)
    assert re.search(r"## Using it\n\n```python\n" + re.escape(code), README.read_text())
    assert "init_single_process_cpu" not in code
    _ok(run_python(snippet_code(USING_IT, checkpoints), tmp_path), "the Using it block")


@pytest.mark.engine
def test_readme_sampled_tokens_snippet_is_bit_exact(checkpoints, tmp_path):
    """MVA_INVARIANT=1, a Qwen3-MoE engine with routed experts, the aligned trainer replaying them:
    the block's own assert is the bitwise equality."""
    code = snippet_code(SAMPLED, checkpoints)
    assert code.index('os.environ["MVA_INVARIANT"] = "1"') < code.index("model = build_gpt_from_hf(")
    completed = run_python(code, tmp_path)
    _ok(completed, "the sampled-tokens block")
    assert "sampled tokens:" in completed.stdout


@pytest.mark.engine
@pytest.mark.distributed
def test_readme_tensor_parallel_snippet_equals_a_tp2_engine(checkpoints, tmp_path):
    """The block under ``torchrun --nproc-per-node 2``; rank 0's logprobs equal a TP=2 engine's bitwise."""
    import torch

    from megatron_vllm_align.engine.vllm_reference import (
        ReferenceEngineConfig,
        prompt_logprobs,
        shutdown_engine,
        start_reference_engine,
    )

    script = tmp_path / "snippet.py"
    script.write_text(snippet_code(TENSOR_PARALLEL, checkpoints))
    completed = subprocess.run(torchrun_command(2, str(script)),
                               cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    _ok(completed, "the tensor-parallel block")
    ours = torch.load(tmp_path / "logprobs.pt")
    llm = start_reference_engine(checkpoints["llama"], ReferenceEngineConfig(kv_cache_bytes=64 * 1024 * 1024,
                                                                             tensor_parallel_size=2))
    try:
        engine = prompt_logprobs(llm, [[1, 5, 9, 2], [7, 3]])
    finally:
        shutdown_engine(llm)
    assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True))


@pytest.mark.distributed
def test_readme_fsdp2_snippet_equals_one_rank(checkpoints, tmp_path):
    """The block under ``torchrun --nproc-per-node 2``; each rank's logprobs equal this one process's
    (the unsharded model) bitwise."""
    import torch

    from megatron_vllm_align import build_gpt_from_hf, token_logprobs
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu

    code = snippet_code(FSDP2, checkpoints)
    assert f"share = {list(FSDP2_SHARES)}[dist.get_rank()]" in code
    script = tmp_path / "snippet.py"
    script.write_text(code)
    completed = subprocess.run(torchrun_command(2, str(script)), cwd=tmp_path, env=_env(), capture_output=True,
                               text=True, timeout=TIMEOUT_S, check=False)
    _ok(completed, "the FSDP2 block")
    init_single_process_cpu()
    whole = build_gpt_from_hf(checkpoints["llama"], align=True)
    for rank, share in enumerate(FSDP2_SHARES):
        ours = torch.load(tmp_path / f"logprobs{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(ours, token_logprobs(whole, share), strict=True))


def test_readme_compare_vjp_snippet(checkpoints, tmp_path):
    completed = run_python(snippet_code(COMPARE_VJP, checkpoints), tmp_path)
    _ok(completed, "the compare_vjp block")
    assert "PASS" in completed.stdout  # report.to_markdown() printed


def test_readme_guards_snippet(checkpoints, tmp_path):
    _ok(run_python(snippet_code(GUARDS, checkpoints), tmp_path), "the guards block")
    assert (tmp_path / "dumps" / "step_00000000").is_dir()


def test_readme_three_way_snippet(checkpoints, tmp_path):
    _ok(run_python(snippet_code(THREE_WAY, checkpoints), tmp_path), "the three-way block")


# --- bash blocks -------------------------------------------------------------------------------------

OWN_CHECKPOINT_ANCHOR = "data.text_field=text"
CHECK_TP_ANCHOR = "--model path/to/hf_checkpoint --tp 2"
TRAIN_ANCHOR = "--recipe recipes/tiny_llama_layer3.yaml"
GRPO_ANCHOR = "--recipe recipes/tiny_llama_grpo.yaml"
RUN_ANCHORS = (OWN_CHECKPOINT_ANCHOR, CHECK_TP_ANCHOR, TRAIN_ANCHOR, GRPO_ANCHOR)  # every command of these runs
MAKE_ANCHOR = "make demo"
# make targets not run here, each with its reason; the mapping is asserted in test_make_targets_are_exempt...
EXEMPT = {
    "make demo": "the main job (`$(PY) -m megatron_vllm_align`), which tests/test_main_job.py runs "
                 "(reduced: --seeds 1 --layer3-steps 2) and asserts",
    "make test": "the whole suite (`$(PY) -m pytest -q`): cannot run inside itself",
}
# placeholder paths of the bash blocks -> keys of the bash_inputs fixture
BASH_PATHS = {"path/to/hf_checkpoint": "user_checkpoint", "path/to/train.jsonl": "train_jsonl"}


def commands(anchor: str) -> list[str]:
    """The command lines of a bash block (continuation lines joined, comments dropped)."""
    text = block(anchor).replace("\\\n", " ")
    return [" ".join(line.split("#")[0].split()) for line in text.splitlines() if line.split("#")[0].strip()]



def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _override(argv: list[str], key: str) -> str | None:
    found = [a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")]
    return found[-1] if found else None


def check_own_checkpoint(argv, completed, out):
    summary = json.loads((out / "check.json").read_text())
    tp = int(_value(argv, "--tp")) if "--tp" in argv else 1
    trainer_tp = int(_value(argv, "--trainer-tp")) if "--trainer-tp" in argv else tp
    processed = {"sampled_processed": True} if tp == 1 else {}   # the second sampling arm runs at TP 1
    assert summary["exit_status"] == 0 and summary["bit_exact"] == {"prompt": True, "sampled": True, **processed}
    assert summary["layer1_passed"] and summary["layer1"] and summary["invariant"] is True
    assert summary["architecture"] == "llama" and (out / "check.md").is_file()
    emulated = trainer_tp != tp  # the TP 1 trainer computing the engine's shards
    assert summary["tensor_parallel"] == {"engine": tp, "trainer": trainer_tp, "engine_shards_emulated": emulated}
    report = (out / "check.md").read_text()
    assert ("(the trainer computes the engine's shards)" in report) is emulated
    assert f"tensor parallel size: engine {tp}, trainer {trainer_tp}" in report
    assert f"report: {out / 'check.md'}" in completed.stdout


def check_sft(argv, completed, run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    align = _override(argv, "align.enabled") != "false"
    steps = metrics["arms"]["aligned" if align else "native"]
    assert metrics["status"] == "complete" and metrics["align_enabled"] is align
    assert metrics["world_size"] == int(_value(argv, "--nproc-per-node"))
    assert [m["step"] for m in steps] == list(range(1, 9)) and steps[-1]["train_loss"] < steps[0]["train_loss"] - 0.5
    assert f"sft done: 8 steps, final train loss {steps[-1]['train_loss']:.6f}" in completed.stdout
    every = int(_override(argv, "guards.gradient_dump_every") or 0)
    if every:  # every rank's shards reassemble into the full gradients of every parameter
        from megatron_vllm_align.guards import load_gradient_dump

        dumps = [load_gradient_dump(run_dir / "gradient_dumps", step) for step in range(0, 8, every)]
        assert all(dump.world_size == metrics["world_size"] and dump.grads for dump in dumps)
        experts = int(_override(argv, "parallel.expert_model_parallel_size") or 1) > 1
        assert any(record.is_expert for record in dumps[0].records.values()) is experts
    export = _override(argv, "train.export_dir")
    if export is None:
        assert metrics["export"] is None
    else:  # the trained weights as a Hugging Face directory, with the checkpoint's config and tokenizer
        assert metrics["export"] == str(run_dir / export)
        assert {"config.json", "tokenizer.json"} <= {p.name for p in (run_dir / export).iterdir()}
        assert list((run_dir / export).glob("*.safetensors"))


def check_layer3(argv, completed, run_dir):
    layer3 = json.loads((run_dir / "layer3.json").read_text())
    assert layer3["verdict"] == "pass" and layer3["localisation"]["stage"] is None
    assert f"layer3 verdict: pass - {layer3['verdict_detail']}" in completed.stdout


def check_grpo(argv, completed, run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 6 and summary["world_size"] == 2
    assert summary["align_enabled"] is True and summary["on_policy"]["max_abs_delta_logprob"] == 0.0  # README's claim
    assert "grpo done: 6 steps, max |delta logprob| on sampled tokens 0.0" in completed.stdout


RECIPE_CHECKS = {"tiny_llama_sft.yaml": check_sft, "tiny_llama_layer3.yaml": check_layer3,
                 "tiny_llama_grpo.yaml": check_grpo}


def plan(command: str):
    """(argv with the added output location, the check, the output directory name's role) for a README
    command; AssertionError for a command nothing here knows how to assert."""
    argv = shlex.split(command)
    assert argv[0] in (".venv/bin/torchrun", ".venv/bin/python") and (ROOT / argv[0]).exists(), command
    if argv[1:4] == ["-m", "megatron_vllm_align", "check"]:
        return argv, check_own_checkpoint, "--output-dir"
    recipe = Path(_value(argv, "--recipe")).name if "--recipe" in argv else None
    assert recipe in RECIPE_CHECKS, f"README command {command!r}: no assertion for it here"
    return argv, RECIPE_CHECKS[recipe], "train.run_dir="


def _command_params():
    params = []
    for anchor, block_name in zip(RUN_ANCHORS, ("own_checkpoint", "check_tp", "train", "grpo"), strict=True):
        for i, command in enumerate(commands(anchor)):
            marks = [pytest.mark.distributed] if "torchrun" in command or "--tp" in command else []
            # an engine: check's, and the GRPO run's on rank 0
            marks += [pytest.mark.engine] if "grpo" in command or "megatron_vllm_align check" in command else []
            what = Path(command.split("--recipe ")[1].split()[0]).stem if "--recipe" in command else command.split()[3]
            params.append(pytest.param(command, marks=marks, id=f"{block_name}[{i}]-{what}"))
    return params


@pytest.fixture(scope="module")
def bash_inputs(tmp_path_factory) -> dict[str, Path]:
    """The bash blocks' placeholder paths: a user's Hugging Face checkpoint (tiny Llama at the recipe's
    widths, with its own byte-level tokenizer) and a JSONL file with a ``text`` field, enough lines for
    the recipe's data.num_train + data.num_validation."""
    from megatron_vllm_align.engine.tiny_models import (
        TinyModelConfig,
        build_tiny_hf_model,
        save_byte_level_tokenizer,
    )
    from megatron_vllm_align.train.config import load_recipe

    root = tmp_path_factory.mktemp("readme_bash")
    config = TinyModelConfig(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                             vocab_size=384, seed=21)  # 384: TP=2 shards of vLLM's 64-padded vocabulary
    checkpoint = save_byte_level_tokenizer(build_tiny_hf_model(root / "hf_checkpoint", config))
    data = load_recipe(ROOT / "recipes" / "tiny_llama_sft.yaml").data
    lines = [json.dumps({"text": f"Note {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 50} marbles."})
             for i in range(data.num_train + data.num_validation)]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return {"user_checkpoint": checkpoint, "train_jsonl": root / "train.jsonl"}


@pytest.mark.parametrize("command", _command_params())
def test_readme_command_runs(command, tmp_path, bash_inputs):
    argv, check, output_flag = plan(command)
    for placeholder, key in BASH_PATHS.items():
        argv = [a.replace(placeholder, str(bash_inputs[key])) for a in argv]
    assert not any("path/to/" in a for a in argv), f"a placeholder path of {command!r} has no substitute here"
    out = tmp_path / "out"
    # added: the output goes to tmp, not to runs/<name> of the shared checkout (where another run may be)
    argv = [*argv, output_flag, str(out)] if output_flag.startswith("--") else [*argv, f"{output_flag}{out}"]
    extra = {"PET_MASTER_PORT": str(free_port())} if "torchrun" in argv[0] else {}  # torchrun's --master-port
    completed = subprocess.run(argv, cwd=ROOT, env=_env(**extra), capture_output=True, text=True, timeout=TIMEOUT_S,
                               check=False)
    _ok(completed, command)
    check(argv, completed, out)


def test_make_targets_are_exempt_and_map_to_what_the_tests_run():
    assert commands(MAKE_ANCHOR) == list(EXEMPT)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PY := \.venv/bin/python$", makefile, re.MULTILINE)
    assert re.search(r"^demo: install\n\t@\$\(PY\) -m megatron_vllm_align\n", makefile, re.MULTILINE)
    assert re.search(r"^test: install\n\t@\$\(PY\) -m pytest -q\n", makefile, re.MULTILINE)
    main_job_test = (ROOT / "tests" / "test_main_job.py").read_text()
    assert '[sys.executable, "-m", "megatron_vllm_align", "--output-dir"' in main_job_test
    assert "def test_exit_status_zero_and_summary_table" in main_job_test and "done.returncode == 0" in main_job_test


# --- coverage ------------------------------------------------------------------------------------------

COVERED = {**{s.anchor: "python" for s in SNIPPETS.values()}, **{a: "bash" for a in RUN_ANCHORS}, MAKE_ANCHOR: "bash"}


def test_every_readme_block_is_covered():
    blocks = readme_blocks()
    for i, (lang, text) in enumerate(blocks):
        anchors = [a for a in COVERED if a in text]
        assert len(anchors) == 1, f"README block {i} ({lang}) is covered by {len(anchors)} entries here:\n{text}"
        assert COVERED[anchors[0]] == lang, f"README block {i}: expected a {COVERED[anchors[0]]} block"
    for anchor in COVERED:
        block(anchor)  # each anchor is in exactly one block
    assert len(blocks) == len(COVERED)
    ran = [line for anchor in RUN_ANCHORS for line in commands(anchor)]
    assert [plan(line)[0] for line in ran]  # every command has its assertion (plan raises otherwise)
    assert [p.values[0] for p in _command_params()] == ran


def test_readme_is_a_door():
    """README.md stays a door: at most README_MAX_LINES lines, the two commands first, every local link
    it gives exists, and every test path docs/proof.md names exists."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    assert text.startswith("# megatron-vllm-align\n\n```bash\nmake demo ")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/proof.md" in links and "docs/usage.md" in links and "docs/method.md" in links
    assert [link for link in links if not (ROOT / link).exists()] == []
    proof = (ROOT / "docs" / "proof.md").read_text(encoding="utf-8")
    paths = re.findall(r"`((?:tests|benchmarks)/[^` ]+)`", proof)
    assert len(paths) >= 30 and [p for p in paths if not (ROOT / p).exists()] == []

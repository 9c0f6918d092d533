"""The op registry, keyed by contract name: what the layer-1 suite, the main job and the tests iterate.

Each op home ``ops/<name>/`` holds its contract YAML, visible kernel (``kernel.py``), autograd module
(``module.py``), backward (``vjp.py``), independent reference (``reference.py``) and layer-1 cases
(``case.py``, which defines ``OP``). :func:`registered_ops` imports every home; :func:`layer1_cases`
builds their cases at tiny or real widths; :func:`coverage_gaps` names every autograd function of a home
that no registered case runs, every home without ``OP`` and every visible module whose ``contract_name``
is not its op's.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.contracts import GradientContract

TOKEN_COUNTS = (1, 37, 300)
# Token counts at real widths: decode and an unaligned prefill chunk (M = 300 adds time, not coverage).
REAL_WIDTH_TOKEN_COUNTS = (1, 37)


@dataclass(frozen=True)
class Widths:
    """The sizes a case builds its module at. The defaults are the tiny ones; :meth:`real` gives a
    model's widths at ``hidden`` (head_dim 128, as Llama 3 and Qwen3 use)."""

    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 512
    experts: int = 8
    top_k: int = 2
    expert_ffn: int = 48          # not a multiple of 16: vLLM pads it to 64
    linear_out: int = 512         # output features of a linear case
    output_vocab: int = 500       # vocabulary rows of the output-layer case (not a multiple of 64)
    token_counts: tuple[int, ...] = TOKEN_COUNTS

    @classmethod
    def real(cls, hidden: int) -> Widths:
        """Widths of a model with ``hidden`` (1024 = Qwen3-0.6B, 4096 = Llama-3-8B, 8192 = Llama-3-70B):
        head_dim 128 (as Llama 3 and Qwen3 use), FFN ``3 * hidden``, Qwen's vocabulary (see :meth:`model`)."""
        if hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128 (head_dim), got {hidden}")
        heads = hidden // 128
        return cls.model(hidden, 3 * hidden, heads, min(8, heads), 128, 151936)

    @classmethod
    def model(cls, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
              experts: int = 8, top_k: int = 2, expert_ffn: int = 128) -> Widths:
        """A model's own widths, at the real-width token counts (decode and an unaligned prefill chunk).

        Linear and output-layer cases use a tensor-parallel shard of the projection (``hidden / 4``
        outputs, at most 2000 vocabulary rows) so the float64 references fit in memory; the reduction
        width, which is what the backward's error grows with, is the full ``hidden``."""
        return cls(hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
                   experts=experts, top_k=top_k, expert_ffn=expert_ffn, linear_out=max(hidden // 4, 16),
                   output_vocab=min(vocab, 2000), token_counts=REAL_WIDTH_TOKEN_COUNTS)


@dataclass(frozen=True)
class CaseContexts:
    """The engine contexts visible modules are built in: a dense bf16 engine, the same with
    ``quantization="fp8_per_channel"`` and an unquantized MoE engine (``ops.vllm_context.VllmContext``)."""

    bf16: Any
    fp8: Any
    moe: Any


Build = Callable[[int, int], tuple[nn.Module, nn.Module, list[Any]]]


@dataclass(frozen=True)
class Layer1Case:
    """One visible module in one configuration.

    ``build(seed, tokens)`` returns (candidate, reference, inputs); ``variables`` maps harness items
    (``input[i]``, parameter names) to contract variables; ``function`` is the autograd function whose
    backward the case tests (its node must be in the candidate's graph).
    """

    name: str
    contract: GradientContract
    variables: Mapping[str, str]
    build: Build
    function: type[torch.autograd.Function]
    token_counts: tuple[int, ...] = TOKEN_COUNTS
    declared_unused: tuple[str, ...] = ()


@dataclass(frozen=True)
class Op:
    """An op home: its name (the directory, and its contract's name), its contracts and its cases.

    ``cases(contexts, widths)`` returns the layer-1 cases; None only with ``no_visible_module`` saying
    why nothing runs here (the home then holds a contract and numerics only)."""

    name: str
    contracts: tuple[str, ...]
    cases: Callable[[CaseContexts, Widths], list[Layer1Case]] | None
    no_visible_module: str = ""


def op_names() -> list[str]:
    """Every op home: the subpackages of ``megatron_vllm_align.ops``, sorted."""
    package = importlib.import_module(__package__)
    return sorted(info.name for info in pkgutil.iter_modules(package.__path__) if info.ispkg)


def registered_ops() -> dict[str, Op]:
    """``OP`` of every op home's ``case.py`` that has one, keyed by name (see :func:`coverage_gaps`)."""
    ops = {}
    for name in op_names():
        try:
            case_module = importlib.import_module(f"{__package__}.{name}.case")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{name}.case":
                raise
            continue
        op = getattr(case_module, "OP", None)
        if isinstance(op, Op):
            ops[name] = op
    return ops


def layer1_cases(contexts: CaseContexts, widths: Widths = Widths(),
                 ops: Mapping[str, Op] | None = None) -> list[Layer1Case]:
    """The cases of every op (``ops``, default :func:`registered_ops`) at ``widths``, op by op."""
    ops = registered_ops() if ops is None else ops
    return [case for op in ops.values() if op.cases is not None for case in op.cases(contexts, widths)]


def _home_modules(name: str) -> list[Any]:
    """The Python modules of op home ``name`` that hold its implementation (all but ``case`` and
    ``reference``)."""
    package = importlib.import_module(f"{__package__}.{name}")
    return [importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__) if info.name not in ("case", "reference")]


def module_functions(name: str) -> list[type[torch.autograd.Function]]:
    """The autograd functions defined in op home ``name`` (outside its cases and reference)."""
    return [obj for module in _home_modules(name) for obj in vars(module).values()
            if inspect.isclass(obj) and issubclass(obj, torch.autograd.Function) and obj.__module__ == module.__name__]


def visible_module_classes(name: str) -> list[type[nn.Module]]:
    """The ``nn.Module`` classes of op home ``name`` that declare a ``contract_name``."""
    return [obj for module in _home_modules(name) for obj in vars(module).values()
            if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__
            and "contract_name" in vars(obj)]


def coverage_gaps(ops: Mapping[str, Op], cases: Iterable[Layer1Case]) -> list[str]:
    """What the registry leaves untested, one sentence each (empty when complete).

    ``cases``: the cases built from ``ops``. A home without ``OP``; an ``OP`` whose name or contracts
    do not match its home; an op without cases and without a reason; an autograd function of the
    home that no case names as its ``function``; a visible module whose ``contract_name`` is not one
    of its op's contracts."""
    gaps = []
    tested = {case.function for case in cases}
    for name in op_names():
        op = ops.get(name)
        if op is None:
            gaps.append(f"ops/{name}: no OP registered in its case.py")
            continue
        if op.name != name or any(not contract.startswith(name) for contract in op.contracts):
            gaps.append(f"ops/{name}: OP is named {op.name!r} with contracts {op.contracts}; both must "
                        f"spell the home's name")
        functions = module_functions(name)
        if op.cases is None and (functions or not op.no_visible_module):
            gaps.append(f"ops/{name}: no layer-1 cases and no reason why")
        for function in functions:
            if function not in tested:
                gaps.append(f"ops/{name}: {function.__name__} has no layer-1 case")
        for cls in visible_module_classes(name):
            if cls.contract_name not in op.contracts:
                gaps.append(f"ops/{name}: {cls.__name__}.contract_name = {cls.contract_name!r} is not one of "
                            f"{op.contracts}")
    return gaps


def graph_functions(output: Any) -> set[str]:
    """Names of the autograd nodes reachable from ``output``'s tensors (``<Function>Backward``)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    stack = [t.grad_fn for t in items if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, names = set(), set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(parent for parent, _ in node.next_functions)
    return names


def seeded_bf16(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    """``scale * N(0, 1)`` of ``shape`` from ``gen``, rounded to bf16."""
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


def seed_parameters(module: nn.Module, gen: torch.Generator) -> None:
    """Seeded bf16 values for every parameter (matrices scaled by ``1 / sqrt(fan_in)``), then the
    module's ``refresh_deployed()`` if it has one."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(seeded_bf16(gen, *p.shape, scale=p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0))
    refresh = getattr(module, "refresh_deployed", None)
    if refresh is not None:
        refresh()

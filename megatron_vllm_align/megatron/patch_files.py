"""The package's vLLM and megatron-core changes as patch files against the installed (pinned) sources.

The changes are those of the vLLM entry-point plugins (invariance, CPU MoE expert_map, seeded chunked
prefill) and of :mod:`~megatron_vllm_align.megatron.cpu_compat`. Each patch inserts hooks into pristine
files of the installed package: a marked block right after the class it changes (or at the end of a
module) that applies this package's own wrapper or installer, imported by name. The patched files carry
no logic of their own, so they cannot drift from the plugins: the patched vLLM runs the very functions
the plugins install, and every hook's target and wrapper are taken from the plugins' objects when the
patches are generated. ``--check`` regenerates the patches from the installed sources and compares them
with the committed ones (patches/README.md).

Command line::

    python -m megatron_vllm_align.megatron.patch_files --write patches/   # (re)generate
    python -m megatron_vllm_align.megatron.patch_files --check patches/   # exit 1 if they differ
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

BEGIN = "# >>> megatron-vllm-align"
END = "# <<< megatron-vllm-align"


class PatchSourceError(RuntimeError):
    """An installed source file is not the pristine file a patch is written against."""


@dataclasses.dataclass(frozen=True)
class Hook:
    """Lines inserted into one file of an installed package.

    path: the file relative to site-packages (``vllm/platforms/cpu.py``); after: the top-level class
    after whose definition the lines go, or None for the end of the file; lines: the code, no newlines."""

    path: str
    after: str | None
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PatchFile:
    """One concern's patch: its file name (``<name>.patch``), package, one-line summary and hooks."""

    name: str
    package: str
    summary: str
    hooks: tuple[Hook, ...]


def _module_path(module: str) -> str:
    """``module``'s source file relative to site-packages (``megatron/core/__init__.py`` for a package)."""
    return Path(importlib.import_module(module).__file__).resolve().relative_to(site_packages()).as_posix()


def _import_line(function: Callable) -> tuple[str, str]:
    alias = f"_mva_{function.__name__}"
    return alias, f"from {function.__module__} import {function.__name__} as {alias}  # noqa: E402"


def wrap_hook(cls: type, attribute: str, wrapper: Callable, *, is_classmethod: bool = False) -> Hook:
    """A hook after ``cls``'s definition that sets ``cls.attribute = wrapper(cls.attribute)`` (for a
    classmethod: ``classmethod(wrapper(cls.attribute.__func__))``), exactly as the plugin installs it."""
    alias, line = _import_line(wrapper)
    target = f"{cls.__name__}.{attribute}"
    value = f"classmethod({alias}({target}.__func__))" if is_classmethod else f"{alias}({target})"
    return Hook(_module_path(cls.__module__), cls.__name__,
                (f"{BEGIN}: {target} wrapped by {wrapper.__module__}.{wrapper.__name__}", line,
                 f"{target} = {value}", f"del {alias}", END))


def call_hook(module: str, installer: Callable) -> Hook:
    """A hook at the end of ``module`` that calls ``installer()`` once the module is complete."""
    alias, line = _import_line(installer)
    return Hook(_module_path(module), None, (f"{BEGIN}: {installer.__module__}.{installer.__name__}()", line,
                                             f"{alias}()", f"del {alias}", END))


def patch_specs() -> tuple[PatchFile, ...]:
    """The patch files, their hooks taken from the plugin's own objects (its classes and wrappers)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from megatron_vllm_align.engine.seeded_sampling import install_seeded_chunked_prefill_fix
    from megatron_vllm_align.invariance.attention import query_group_build
    from megatron_vllm_align.invariance.coverage import checked_config_hook
    from megatron_vllm_align.invariance.expert_rows import expert_rows_apply
    from megatron_vllm_align.invariance.row_tiles import linear_method_classes, row_tiled_apply
    from megatron_vllm_align.megatron.cpu_compat import enable_cpu_compat
    from megatron_vllm_align.ops.routed_experts.expert_map import install_expert_map_fix

    return (
        PatchFile("row_tiles", "vllm", "with MVA_INVARIANT=1, the linear, LM-head and MoE-gate methods' apply runs "
                  "under the row rule probed for its kernel",
                  tuple(wrap_hook(cls, "apply", row_tiled_apply) for cls in linear_method_classes())),
        PatchFile("expert_rows", "vllm", "with MVA_INVARIANT=1, the CPU fused experts' apply runs under the rule "
                  "probed for their shape", (wrap_hook(CPUUnquantizedExperts, "apply", expert_rows_apply),)),
        PatchFile("attention_layout", "vllm", "with MVA_INVARIANT=1, the CPU attention metadata has requests of "
                  "at most the probed query group and no KV split", (wrap_hook(CPUAttentionMetadataBuilder, "build",
                                                                           query_group_build),)),
        PatchFile("coverage_gate", "vllm", "with MVA_INVARIANT=1, the CPU platform's config hook refuses a model, "
                  "quantization or attention layout the invariance layer does not cover",
                  (wrap_hook(CpuPlatform, "check_and_update_config", checked_config_hook, is_classmethod=True),)),
        PatchFile("expert_map", "vllm", "CPUUnquantizedExperts.apply honours expert_map (expert parallelism on "
                  "the CPU fused experts)",
                  (call_hook("vllm.model_executor.layers.fused_moe.experts.cpu_moe", install_expert_map_fix),)),
        PatchFile("seeded_chunked_prefill", "vllm", "a seeded request under chunked prefill keeps the CPU engine "
                  "alive (its discarded draw is undone by restoring the generator state)",
                  (call_hook("vllm.v1.worker.cpu_model_runner", install_seeded_chunked_prefill_fix),)),
        PatchFile("megatron_cpu_compat", "megatron-core", "without CUDA, megatron-core's forward and backward run "
                  "on the CPU (megatron_vllm_align.megatron.cpu_compat.PATCHES)",
                  (call_hook("megatron.core", enable_cpu_compat),)),
    )


def site_packages() -> Path:
    """The site-packages directory the installed vllm is imported from."""
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def installed_versions() -> dict[str, str]:
    """``{"vllm": ..., "megatron-core": ...}``; raises unless both are the pinned versions."""
    import vllm

    from megatron_vllm_align.invariance.plugin import check_vllm_version
    from megatron_vllm_align.megatron.cpu_compat import check_megatron_version

    check_vllm_version(vllm.__version__)
    return {"vllm": vllm.__version__, "megatron-core": check_megatron_version()}


def patched_text(text: str, hooks: list[Hook], path: str) -> str:
    """``text`` (one pristine file, ``path`` named in errors) with each hook's lines inserted."""
    if BEGIN in text:
        raise PatchSourceError(f"{path} already holds a megatron-vllm-align hook: generate from pristine sources")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        raise PatchSourceError(f"{path} does not end with a newline")
    ends = {node.name: node.end_lineno for node in ast.parse(text).body if isinstance(node, ast.ClassDef)}
    inserts: dict[int, list[str]] = {}
    for hook in hooks:
        if hook.after is not None and hook.after not in ends:
            raise PatchSourceError(f"{path} defines no top-level class {hook.after}")
        at = len(lines) if hook.after is None else ends[hook.after]
        inserts.setdefault(at, []).extend(["\n", "\n", *(f"{line}\n" for line in hook.lines)])
    out = []
    for number, line in enumerate(lines, start=1):
        out.append(line)
        out.extend(inserts.pop(number, []))
    return "".join(out + inserts.pop(0, []))


def render(spec: PatchFile, root: Path, versions: dict[str, str]) -> str:
    """The patch file text for ``spec`` against the sources under ``root`` (site-packages): a header,
    then one unified diff per touched file (paths ``a/<path>``, ``b/<path>``: apply with
    ``patch -p1 -d <site-packages>``)."""
    version = versions[spec.package]
    parts = [f"megatron-vllm-align {spec.name}: {spec.summary}.\n",
             f"Against {spec.package} {version}. Generated by python -m megatron_vllm_align.megatron.patch_files; "
             "do not edit (patches/README.md).\n", "\n"]
    by_path: dict[str, list[Hook]] = {}
    for hook in spec.hooks:
        by_path.setdefault(hook.path, []).append(hook)
    for path in sorted(by_path):
        source = root / path
        if not source.is_file():
            raise PatchSourceError(f"{spec.name}: {source} does not exist")
        text = source.read_text(encoding="utf-8")
        parts.extend(difflib.unified_diff(text.splitlines(keepends=True),
                                          patched_text(text, by_path[path], path).splitlines(keepends=True),
                                          f"a/{path}", f"b/{path}"))
    return "".join(parts)


def generate(root: Path | None = None) -> dict[str, str]:
    """``{"<name>.patch": text}`` for every patch, against ``root`` (default: the installed site-packages)."""
    versions = installed_versions()
    root = site_packages() if root is None else root
    return {f"{spec.name}.patch": render(spec, root, versions) for spec in patch_specs()}


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write(directory: Path) -> list[Path]:
    """Write every patch into ``directory`` (created if absent); returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generate().items():
        _write_atomic(directory / name, text)
        written.append(directory / name)
    return written


def check(directory: Path) -> list[str]:
    """The differences between ``directory``'s ``*.patch`` files and a fresh generation, one line each
    (missing, differing, or not generated); empty when they are equal byte for byte."""
    expected = generate()
    found = {path.name: path.read_text(encoding="utf-8") for path in sorted(directory.glob("*.patch"))}
    problems = [f"{name}: missing" for name in expected if name not in found]
    problems += [f"{name}: differs from a fresh generation" for name in expected
                 if name in found and found[name] != expected[name]]
    problems += [f"{name}: not generated by this module" for name in found if name not in expected]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vllm_align.megatron.patch_files",
                                     description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="DIR", help="(re)generate the patch files in DIR")
    mode.add_argument("--check", type=Path, metavar="DIR", help="exit 1 unless DIR's patches equal a fresh generation")
    args = parser.parse_args(argv)
    if args.write is not None:
        for path in write(args.write):
            print(path)
        return 0
    if not args.check.is_dir():
        parser.error(f"--check: {args.check} is not a directory")
    problems = check(args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

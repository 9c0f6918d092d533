"""No package imports one above it: the package's layers, lowest first, and every import checked
against them (from the source, with ``ast``; lazy imports inside functions count too). A package's
``__main__`` is its command line, not a layer: it may dispatch to any layer."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_vllm_align"
# Lowest first; a module may import its own layer and any layer below it.
LAYERS = ["utils", "invariance", "contracts", "accuracy", "quant", "ops", "validation", "engine", "megatron",
          "guards", "logging", "report", "train", "rl", "integrations", "check", "main_job", "__main__"]


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "megatron_vllm_align" else None


def upward_imports(sources: dict[str, str]) -> list[str]:
    """``importer -> imported`` for every import of a higher layer; ``sources`` maps dotted module
    names (``megatron_vllm_align.<layer>...``) to their source text."""
    found = []
    for module, text in sources.items():
        if module.endswith(".__main__"):
            continue
        own = _layer_of(module)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] if node.module != "megatron_vllm_align" else \
                    [f"megatron_vllm_align.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                layer = _layer_of(target)
                if layer in LAYERS and own in LAYERS and LAYERS.index(layer) > LAYERS.index(own):
                    found.append(f"{module} -> {target}")
    return found


def _package_sources() -> dict[str, str]:
    sources = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources


def test_every_package_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(LAYERS)


def test_no_package_imports_one_above_it():
    assert upward_imports(_package_sources()) == []


def test_relative_imports_stay_inside_their_package():
    for module, text in _package_sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                raise AssertionError(f"{module}: relative import leaving its package (level {node.level})")


def test_a_planted_upward_import_is_found():
    planted = {"megatron_vllm_align.quant.fp8": "from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp\n",
               "megatron_vllm_align.ops.x": "def f():\n    import megatron_vllm_align.train.run\n",
               "megatron_vllm_align.validation.y": "from megatron_vllm_align import megatron\n"}
    assert upward_imports(planted) == ["megatron_vllm_align.quant.fp8 -> megatron_vllm_align.ops.dense_linear.vjp",
                                       "megatron_vllm_align.ops.x -> megatron_vllm_align.train.run",
                                       "megatron_vllm_align.validation.y -> megatron_vllm_align.megatron"]

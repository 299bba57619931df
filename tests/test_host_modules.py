"""The host side of the engine imports no jax: its modules never import jax, and neither does
any llmserve module they import at load time (the package ``__init__`` files, which re-export
the public API, aside; a lazy import inside a function, such as the tokenizer opening a GGUF
file, loads only when called). The engine and its speculation glue may reach the runner, but
use no jax themselves."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "llmserve"
DEVICE_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax")

# Host modules whose whole llmserve import graph is jax-free.
PURE_HOST = ["batch", "scheduler", "block_manager", "outputs", "sampling_params",
             "speculative.policy", "speculative.ngram", "server.loop", "server.protocol",
             "server.metrics"]
# Modules that drive the runner (so reach jax through it) but import no jax themselves.
NO_DIRECT_JAX = ["engine", "speculative.controller"]


def _imports(module: str, load_time: bool = False) -> set[str]:
    """Absolute module names a module imports: anywhere in it, or (``load_time``) those its
    import runs (outside functions and classes)."""
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if load_time:
        nodes = [n for top in tree.body if not isinstance(
            top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in ast.walk(top)]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_device(name: str) -> bool:
    return name.split(".")[0] in DEVICE_PACKAGES


def _llmserve_module(name: str):
    """The llmserve module file an import names (None for packages, names and others)."""
    if not name.startswith("llmserve."):
        return None
    rel = name[len("llmserve."):]
    return rel if ROOT.joinpath(*rel.split(".")).with_suffix(".py").exists() else None


@pytest.mark.parametrize("module", PURE_HOST)
def test_host_module_graph_has_no_jax(module):
    seen, todo, chains = set(), [module], {module: module}
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for name in _imports(mod):
            assert not _is_device(name), f"{chains[mod]} imports {name}"
        for name in _imports(mod, load_time=True):
            sub = _llmserve_module(name)
            if sub and sub not in seen:
                chains.setdefault(sub, f"{chains[mod]} -> {sub}")
                todo.append(sub)
    if module == "batch":  # the walk follows imports
        assert "sampling_params" in seen


@pytest.mark.parametrize("module", NO_DIRECT_JAX)
def test_engine_side_imports_no_jax_itself(module):
    direct = sorted(name for name in _imports(module) if _is_device(name))
    assert not direct, f"llmserve.{module} imports {direct}"


def test_the_check_sees_jax():
    """The oracle: a device module's imports are seen as jax."""
    assert any(_is_device(name) for name in _imports("runner"))
    assert any(_is_device(name) for name in _imports("kv_cache"))

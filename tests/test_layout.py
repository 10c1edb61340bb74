"""The layout's rules, read from every import in the project's code (the tests aside): no import cycle; `ui` and
`server` never import each other; `inference_core` imports no front end and not the runtime above it (`serving`);
`serving` imports neither front end; a function imports nothing but an optional dependency (so every arrow shows at
the top of its module); and the front ends' request paths stay short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference_core", "serving", "ui", "server")
# What a function may import: dependencies that are not installed everywhere (requirements-tools.txt, llama.cpp's
# bindings, a ZeroGPU Space's package).
OPTIONAL = {"transformers", "gguf", "llama_cpp", "spaces", "llguidance", "xgrammar", "triton"}
# Modules of ours that import an optional dependency at their top, and so are imported on first use
LAZY = {"inference_core.engine._triton_attention_kernel", "inference_core.quant._triton_int4_kernel"}
# package -> packages of the project it must never import
NEVER = {"inference_core": {"serving", "ui", "server", "app"}, "serving": {"ui", "server", "app"},
         "ui": {"server", "app"}, "server": {"ui", "app"}}
SHORT = ("serving", "ui/race.py", "ui/chat.py", "server/openai_api.py")  # no function over MAX_FUNCTION_LINES
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project (a package by its __init__.py)."""
    files = [ROOT / "app.py"] + [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    modules = {}
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _imports(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """(node, dotted module) for every import in `tree`: `from a.b import c` names a.b.c where that is a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node, f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES
                       else node.module) for alias in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {name for _, name in _imports(ast.parse(path.read_text())) if name in MODULES}
        graph[module] = targets - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", sorted(NEVER))
def test_no_arrow_runs_against_the_layers(package):
    wrong = sorted(f"{module} imports {target}" for module, targets in _graph().items()
                   if module.split(".")[0] == package for target in targets if target.split(".")[0] in NEVER[package])
    assert not wrong, wrong


def test_functions_import_only_optional_dependencies():
    inside = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        inside += [f"{module}:{node.lineno} imports {name}" for node, name in _imports(tree)
                   if id(node) not in top and name.split(".")[0] not in OPTIONAL and name not in LAZY]
    assert not inside, inside


def test_the_request_paths_are_made_of_short_functions():
    long = []
    for module, path in MODULES.items():
        relative = path.relative_to(ROOT).as_posix()
        if not any(relative == place or relative.startswith(place + "/") for place in SHORT):
            continue
        long += [f"{relative}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines"
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long

"""The package's modules import each other without circles (package `__init__` re-exports aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import logitless

ROOT = Path(logitless.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Modules of the package that `path` imports anywhere (lazy imports inside functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules}
    return out


def import_graph() -> dict[str, set[str]]:
    """Edges between modules; edges into a package's `__init__` (a re-export facade) are left out."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    packages = {_module_name(p) for p in ROOT.rglob("__init__.py")}
    modules = set(files)
    return {m: _imports(p, m, modules) - packages - {m} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert "logitless.rollout.hf" in graph["logitless.rollout.factory"]  # the graph sees lazy imports
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


# The trainer's wings, lowest first: a module of a wing imports only from its own wing, wings listed before it and
# the layers below the trainer; the trainer's own modules (the loop, its stages, checkpoints) import any wing.
WINGS = ["config", "report", "policy", "distributed", "placement", "checks", "memory"]


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["logitless", "trainer"] and len(parts) > 3 else None


def test_trainer_wings_import_down_only():
    graph = import_graph()
    up = []
    for m, targets in graph.items():
        w = _wing(m)
        if w is None:
            continue
        for t in targets:
            tw = _wing(t)
            if t.startswith("logitless.trainer.") and (tw is None or WINGS.index(tw) > WINGS.index(w)):
                up.append(f"{m} -> {t}")
    assert not up, "a wing imports a wing above it or the trainer's own modules:\n" + "\n".join(sorted(up))


def test_no_package_folder_holds_more_than_25_modules():
    counts = {d: len(list(d.glob("*.py"))) for d in [ROOT, *(p.parent for p in ROOT.rglob("__init__.py"))]}
    assert {str(d.relative_to(ROOT.parent)): n for d, n in counts.items() if n > 25} == {}


def test_the_layers_below_the_trainer_never_import_it():
    graph = import_graph()
    up = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                if not m.startswith(("logitless.trainer", "logitless.cli", "logitless.__main__"))
                and t.startswith("logitless.trainer"))
    assert not up, "\n".join(up)

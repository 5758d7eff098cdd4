"""The house plan, enforced: every import in radixserve/ and frontend_lang/ (module level or
inside a function, `TYPE_CHECKING` blocks included) goes down the layers of
docs/architecture.md or stays in its own package, and no two packages import each other,
directly or round a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A unit (a top-level module or subpackage of radixserve, or frontend_lang) may
# import units of lower layers; within a layer only the leaves of layer 0 may import each other.
LAYERS: list[set[str]] = [
    {"version", "paths", "protocol", "placement", "config", "ipc", "detokenizer", "tokenizer"},
    {"kernels", "cache"},
    {"attention"},
    {"models"},
    {"worker", "scheduler"},
    {"launch"},
    {"front"},
    {"http", "engine"},
    {"__main__", "replicas", "__init__"},
    {"frontend_lang"},
]
# frontend_lang drives the engine client and `Engine`, never the HTTP app (it reaches a server
# over HTTP like any client).
FORBIDDEN = {("frontend_lang", "http")}


def layer_of(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"{unit!r} has no layer: add it to LAYERS and to docs/architecture.md")


def unit_of(module: str) -> str | None:
    """`radixserve.http.openai.routes` -> `http`; `radixserve` -> `__init__`; not ours -> None."""
    parts = module.split(".")
    if parts[0] == "frontend_lang":
        return "frontend_lang"
    if parts[0] != "radixserve":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file; `from pkg import name` counts as
    `pkg.name` when that is a module of ours, else as `pkg`."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = any((ROOT / Path(*candidate.split("."))).with_suffix(s).exists() for s in (".py",)) or (
                    ROOT / Path(*candidate.split(".")) / "__init__.py").exists()
                found.append((node.lineno, candidate if is_module else base))
    return found


def source_files() -> list[Path]:
    return sorted([*(ROOT / "radixserve").rglob("*.py"), *(ROOT / "frontend_lang").rglob("*.py")])


def package_imports() -> tuple[list[str], dict[str, set[str]]]:
    """Violations of the layer order, and the unit -> units graph of the imports."""
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for path in source_files():
        importer = unit_of(module_name(path))
        assert importer is not None
        for line, module in imported_modules(path):
            target = unit_of(module)
            if target is None or target == importer:
                continue
            graph.setdefault(importer, set()).add(target)
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            low, high = layer_of(target), layer_of(importer)
            if (importer, target) in FORBIDDEN:
                problems.append(f"{where}: {importer} may not import {target}")
            elif low > high:
                problems.append(f"{where}: {importer} (layer {high}) reaches up to {target} (layer {low})")
            elif low == high and low != 0:
                problems.append(f"{where}: {importer} and {target} are siblings (layer {low}) and must not import each other")
    return problems, graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in the unit graph, as the units along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        path.append(unit)
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)):
            return cycle
    return None


def test_imports_go_down_the_layers() -> None:
    problems, _ = package_imports()
    assert not problems, "imports against the layer order (docs/architecture.md):\n" + "\n".join(problems)


def test_no_cycle_between_packages() -> None:
    _, graph = package_imports()
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_every_unit_has_a_layer() -> None:
    for path in source_files():
        layer_of(unit_of(module_name(path)) or "")


@pytest.mark.parametrize("source, expected", [
    ("from radixserve.http.app import create_app\n", "reaches up"),
    ("def f():\n    from radixserve.front import manager\n", "reaches up"),
    ("from radixserve.worker import worker\n", "siblings"),
])
def test_an_upward_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, expected: str) -> None:
    """The checker itself: a scheduler module that imports upward (at module level or inside a
    function) or sideways into the worker is reported."""
    planted = ROOT / "radixserve" / "scheduler" / "_planted_for_layering_test.py"
    real = source_files()
    monkeypatch.setattr(__import__(__name__), "source_files", lambda: [*real, planted], raising=False)
    original = Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        return source if self == planted else original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    problems, _ = package_imports()
    assert any("_planted_for_layering_test" in p and expected in p for p in problems), problems


def test_a_cycle_is_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None

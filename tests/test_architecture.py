"""The layer rules of docs/architecture.md, checked on the source: no layer imports a higher one, policies
never reach the engine, the simulator or live, and no module imports itself back through others.

Every import counts, at module level or inside a function (a lazy import is still a dependency); only
imports under `if TYPE_CHECKING:` are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a module belongs to the longest prefix that names it
LAYERS: list[tuple[str, ...]] = [
    ("twin", "twin.errors"),
    ("twin.specs",),
    ("twin.perf", "twin.policy", "twin.predict", "twin.workload", "twin.whatif"),
    ("twin.engine", "twin.scenario"),
    ("twin.sim",),
    ("twin.analysis", "twin.whatif.estimator"),
    ("live",),
    ("twin.lab",),
    ("twin.cli",),
]
# what a policy may import besides itself: nothing that holds engine state, a run or a server
POLICY_MAY_IMPORT = ("twin.errors", "twin.policy", "twin.predict", "twin.workload")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for top in ("twin", "live") for p in sorted((ROOT / top).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports when it runs (a `from pkg import mod` names the module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in known else base)
            visit(child)

    visit(tree)
    return {m for m in out if m in known and m != name}


def layer_of(name: str) -> int:
    best, layer = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer >= 0, f"{name} is in no layer: add it to LAYERS and docs/architecture.md"
    return layer


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = source_modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer(graph):
    for m in graph:
        layer_of(m)


def test_no_layer_imports_a_higher_one(graph):
    bad = sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                 for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))
    assert not bad, "\n".join(bad)


def test_policies_reach_no_engine_simulator_or_server(graph):
    """Transitively: a policy that imports a helper that imports the engine reaches the engine too."""
    bad = []
    for start in (m for m in graph if m == "twin.policy" or m.startswith("twin.policy.")):
        seen, todo = {start}, [start]
        while todo:
            for b in graph[todo.pop()]:
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        bad += [f"{start} reaches {m}" for m in sorted(seen)
                if m != "twin" and not any(m == p or m.startswith(p + ".") for p in POLICY_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components: any with two or more modules is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_lazy_imports_and_skips_type_checking(tmp_path):
    """The checker itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    pkg = tmp_path / "twin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from twin import b\n"
                              "def f():\n    from twin.c import x\n")
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("x = 1\n")
    known = {"twin", "twin.a", "twin.b", "twin.c"}
    assert imports_of("twin.a", pkg / "a.py", known) == {"twin.c"}

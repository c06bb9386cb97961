"""The package's import graph has no cycle, and no sub-package imports a top-level module that imports it.

Every ``import`` of every module of ``headscope`` is read with :mod:`ast`: module-level ones and the
deferred ones inside functions alike (a deferred import still ties the two modules: each needs the other),
except those under ``if TYPE_CHECKING:`` (never run). Relative imports are resolved against the module's
package, and ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.
The graph's strongly connected components of more than one module (or a module importing itself) are
the cycles; the test names each with one closed path through it. The layered rule is :func:`upward_imports`'s.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "headscope"
ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root / package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import node, at any depth, outside ``if TYPE_CHECKING:`` bodies (their ``else`` counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(sources: dict[str, str], package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from ``sources`` (dotted name -> source text).

    A name is a package when some other module's name starts with it plus a dot; relative imports
    resolve against the importing module's package.
    """
    modules = set(sources)
    packages = {m for m in modules if any(o.startswith(m + ".") for o in modules)}

    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, text in sources.items():
        here = mod if mod in packages else mod.rpartition(".")[0]
        for node in _imports(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            for t in targets:
                if t == package or t.startswith(package + "."):
                    d = deepest(t)
                    if d is not None and d != mod:
                        graph[mod].add(d)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path (first module repeated at the end) per strongly connected component with a cycle
    (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    comps.append(sorted(comp))
    return sorted(_closed_path(graph, c) for c in comps)


def _closed_path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    inside, first = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(prev[path[-1]])
                    return path[::-1] + [first]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not a cycle")


def package_graph() -> dict[str, set[str]]:
    return import_graph({m: p.read_text() for m, p in module_files(ROOT, PACKAGE).items()}, PACKAGE)


def test_the_detector_finds_a_cycle():
    """Synthetic modules: a deferred import closes a -> b.c -> a; a TYPE_CHECKING import does not."""
    sources = {
        "pkg": "",
        "pkg.a": "from .b import c\n",
        "pkg.b": "",
        "pkg.b.c": "def f():\n    from .. import a\n",
        "pkg.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\nfrom . import e\n",
        "pkg.e": "import pkg.d\n",
        "pkg.f": "from pkg.b import c\nimport os\n",
    }
    g = import_graph(sources, "pkg")
    assert g["pkg.a"] == {"pkg.b.c"} and g["pkg.b.c"] == {"pkg.a"} and g["pkg.f"] == {"pkg.b.c"}
    assert g["pkg.d"] == {"pkg.e"}  # the TYPE_CHECKING import is no edge
    assert cycles(g) == [["pkg.a", "pkg.b.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
    sources["pkg.e"] = "import os\n"
    assert cycles(import_graph(sources, "pkg")) == [["pkg.a", "pkg.b.c", "pkg.a"]]


def test_the_package_reads_whole():
    """The graph covers the package: every module is a node and the known edges are seen."""
    g = package_graph()
    assert len(g) > 80 and "headscope.hybrid.layer" in g and "headscope.errors" in g
    assert "headscope.models" in g["headscope.api"]
    assert g["headscope.errors"] == set()


def test_no_import_cycles():
    found = cycles(package_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def upward_imports(graph: dict[str, set[str]], package: str) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a top-level module of ``package`` by a module of a sub-package
    that this top-level module itself imports (at any depth inside the sub-package): the sub-package would sit
    both below and above it.

    The layered rule: a top-level module (``headscope.models``) that uses a sub-package (``headscope.arch``) is
    above it, and nothing in that sub-package imports it back. A top-level module that no longer imports the
    sub-package is below it and may be used from it (``headscope.errors``, ``headscope.readout``).
    """
    modules = set(graph)
    top = {m for m in modules if m.count(".") == 1 and not any(o.startswith(m + ".") for o in modules)}
    found = []
    for mod, deps in graph.items():
        parts = mod.split(".")
        if len(parts) < 3:
            continue
        sub = ".".join(parts[:2])
        for t in sorted(deps & top):
            if any(d == sub or d.startswith(sub + ".") for d in graph[t]):
                found.append((mod, t))
    return sorted(found)


def test_the_layer_check_finds_an_upward_import():
    """Synthetic: pkg.models imports pkg.arch.parts; pkg.arch.random imports pkg.models back (deferred)."""
    sources = {
        "pkg": "", "pkg.errors": "", "pkg.models": "from .arch import parts\nfrom . import errors\n",
        "pkg.arch": "", "pkg.arch.parts": "from ..errors import E\n",
        "pkg.arch.random": "def f():\n    from ..models import wrap\n",
    }
    assert upward_imports(import_graph(sources, "pkg"), "pkg") == [("pkg.arch.random", "pkg.models")]
    sources["pkg.arch.random"] = "from ..errors import E\n"
    assert upward_imports(import_graph(sources, "pkg"), "pkg") == []


def test_no_upward_imports():
    found = upward_imports(package_graph(), PACKAGE)
    assert not found, "a sub-package imports a top-level module that imports it:\n" + "\n".join(
        f"{a} -> {b}" for a, b in found)

"""wsod's import graph has no cycle: every module of ``wsod/`` is parsed (not imported) and each cycle is
named with the file and line of every import on it. The same holds one level up, between wsod's
sub-packages and top-level modules (``wsod.data``, ``wsod.engine``, ``wsod.build``, ...), and a few low
modules are checked not to reach higher ones (``config_checks`` never reaches the builder). And no module
of ``wsod/`` only re-exports another's names (``own_definitions``): a moved module leaves no shim behind.

What counts as an edge, and why:

* every ``import`` / ``from ... import`` statement anywhere in a module, at module level and inside
  functions and classes alike: a function-level import is still a dependency, and the cycles that hide
  behind one (``proposals.py`` <-> ``proposal_store.py`` before the sub-package) are the ones that break
  first when a module-level import is added later;
* except those under ``if TYPE_CHECKING:``, which never run (an annotation may name a type from a module
  that depends on this one);
* ``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to ``a.b`` (``c`` is a
  name defined there); ``import a.b.c`` is an edge to ``a.b.c``;
* the parent packages that Python initialises on the way (``import a.b.c`` runs ``a/__init__`` and
  ``a/b/__init__``) are not edges: a package's ``__init__`` that re-exports its own modules would
  otherwise always close a "cycle", which Python resolves (the parent is in ``sys.modules`` before the
  child runs). What a package's ``__init__`` imports is counted like any module's imports;
* imports by string (``importlib.import_module``) are not seen; wsod has none.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "wsod"


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``file:line``; ``lazy``: inside a function."""

    importer: str
    imported: str
    file: str
    line: int
    lazy: bool = False

    def __str__(self) -> str:
        return f"{self.imported} ({self.file}:{self.line}{', in a function' if self.lazy else ''})"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root / package`` (``__init__.py`` is
    its package)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``tree``, at any depth, in source order, with whether it is inside a
    function; except those in ``if TYPE_CHECKING:`` bodies (their ``else:`` branch runs, and is kept)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    pending: list[tuple[ast.AST, bool]] = [(tree, False)]
    while pending:
        node, in_function = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, in_function))
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        pending.extend((child, inside) for child in children)
    return sorted(found, key=lambda item: (item[0].lineno, item[0].col_offset))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is a known module, or None (not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, package: str) -> dict[str, list[Edge]]:
    """Module -> the edges to the package's own modules that it imports (see the module docstring)."""
    modules = module_names(root, package)
    graph: dict[str, list[Edge]] = {name: [] for name in modules}
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        here = importer if is_package else importer.rpartition(".")[0]
        file = str(path.relative_to(root))
        for node, lazy in _import_nodes(ast.parse(path.read_text(), filename=file)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: level 1 is this module's package
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
            for target in targets:
                imported = _resolve(target, modules)
                if imported is not None and imported != importer:
                    graph[importer].append(Edge(importer, imported, file, node.lineno, lazy))
    return graph


def _strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                nxt = edge.imported
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, list[Edge]], component: list[str]) -> list[Edge]:
    """One shortest cycle through the component's first module, as its edges (breadth-first search)."""
    members, start = set(component), component[0]
    came_from: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph[node]:
            if edge.imported not in members:
                continue
            if edge.imported == start:
                path = [edge]
                while path[0].importer != start:
                    path.insert(0, came_from[path[0].importer])
                return path
            if edge.imported not in came_from:
                came_from[edge.imported] = edge
                queue.append(edge.imported)
    raise AssertionError(f"no cycle through {start} in its component {component}")  # not reached


def import_cycles(graph: dict[str, list[Edge]]) -> list[str]:
    """One line per component of modules that import each other, naming one shortest cycle in it:
    ``a -> b (a.py:3) -> a (b.py:12, in a function)``, each step with the file and line of its import."""
    lines = []
    for component in _strongly_connected(graph):
        cycle = _shortest_cycle(graph, component)
        steps = " -> ".join(str(e) for e in cycle)
        others = f"; {len(component)} modules in the cycle's component: {', '.join(component)}"
        lines.append(f"{cycle[0].importer} -> {steps}" + (others if len(component) > len(cycle) else ""))
    return lines


def test_wsod_has_no_import_cycle():
    cycles = import_cycles(import_graph(ROOT, PACKAGE))
    assert not cycles, (
        "import cycles in wsod/ (break each by moving the shared part into a lower module):\n  "
        + "\n  ".join(cycles)
    )


def _units(graph: dict[str, list[Edge]]) -> dict[str, list[Edge]]:
    """The graph between wsod's units: each sub-package (``wsod.data``, ``wsod.engine``, ...) is one
    node, each top-level module another; one edge (its first import) per pair of units."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    units: dict[str, list[Edge]] = {unit(m): [] for m in graph}
    for edges in graph.values():
        for edge in edges:
            a, b = unit(edge.importer), unit(edge.imported)
            if a != b and b not in {e.imported for e in units[a]}:
                units[a].append(Edge(a, b, edge.file, edge.line, edge.lazy))
    return units


def test_wsods_sub_packages_import_each_other_without_a_cycle():
    # Stronger than module cycles: wsod.data never imports wsod.engine back, etc. (layers, not a web).
    cycles = import_cycles(_units(import_graph(ROOT, PACKAGE)))
    assert not cycles, "cycles between wsod's sub-packages (one import shown per step):\n  " + "\n  ".join(
        cycles
    )


def test_a_cycle_between_sub_packages_is_found_where_no_module_cycle_is():
    graph = {
        "wsod.data.a": [Edge("wsod.data.a", "wsod.engine.b", "wsod/data/a.py", 3, lazy=True)],
        "wsod.engine.b": [],
        "wsod.engine.c": [Edge("wsod.engine.c", "wsod.data.d", "wsod/engine/c.py", 5)],
        "wsod.data.d": [],
    }
    assert import_cycles(graph) == []
    assert import_cycles(_units(graph)) == [
        "wsod.data -> wsod.engine (wsod/data/a.py:3, in a function) -> wsod.data (wsod/engine/c.py:5)"
    ]


def test_the_graph_sees_every_module_and_its_imports():
    graph = import_graph(ROOT, PACKAGE)
    assert {"wsod", "wsod.data.proposals", "wsod.data.proposals.store", "wsod.config_checks"} <= set(graph)
    imported = {e.imported for e in graph["wsod.data.proposals.io"]}
    assert {"wsod.data.proposals.sets", "wsod.data.proposals.store"} <= imported
    # A lazily imported module (inside a function) is an edge too.
    assert "wsod.runs.train" in {e.imported for e in graph["wsod.benchmarks.gpu_check"]}


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_level_import_is_found_and_named(tmp_path):
    # The shape proposals.py and proposal_store.py had: one module-level import, one inside a function.
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sets.py": "def load():\n    from pkg.store import Store\n    return Store\n",
            "pkg/store.py": "from pkg.sets import load\n",
            "pkg/leaf.py": "import pkg.sets\n",
        },
    )
    assert import_cycles(import_graph(tmp_path, "pkg")) == [
        "pkg.sets -> pkg.store (pkg/sets.py:2, in a function) -> pkg.sets (pkg/store.py:1)"
    ]


def test_type_checking_imports_parents_and_relative_imports_are_resolved_as_documented(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import a\n",  # a package re-exporting its module: no cycle
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": (
                "from typing import TYPE_CHECKING\nfrom . import b\nfrom .b import thing\n"
                "if TYPE_CHECKING:\n    from pkg.c import C\n"
            ),
            "pkg/sub/b.py": "from ..c import helper\nthing = 1\n",
            "pkg/c.py": "import pkg.sub.a\ndef helper():\n    pass\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert [e.imported for e in graph["pkg.sub.a"]] == ["pkg.sub.b", "pkg.sub.b"]
    assert [e.imported for e in graph["pkg.sub.b"]] == ["pkg.c"]
    assert import_cycles(graph) == [
        "pkg.c -> pkg.sub.a (pkg/c.py:1) -> pkg.sub.b (pkg/sub/a.py:2) -> pkg.c (pkg/sub/b.py:1)"
    ]


@pytest.mark.parametrize(
    "module,forbidden",
    [
        ("wsod.config_checks", "wsod.build"),  # the rules read choice lists from their owners
        ("wsod.data.proposals.sets", "wsod.data.proposals.store"),  # io joins the two, not sets
    ],
)
def test_a_low_module_does_not_reach_a_higher_one(module, forbidden):
    graph = import_graph(ROOT, PACKAGE)
    seen, pending, via = {module}, [module], {}
    while pending:
        for edge in graph[pending.pop()]:
            if edge.imported not in seen:
                seen.add(edge.imported)
                via[edge.imported] = edge
                pending.append(edge.imported)
    if forbidden in seen:
        chain, node = [], forbidden
        while node != module:
            chain.insert(0, str(via[node]))
            node = via[node].importer
        pytest.fail(f"{module} imports {forbidden}: {module} -> " + " -> ".join(chain))


# -- no module only re-exports --------------------------------------------------------------------------


def own_definitions(tree: ast.Module) -> list[str]:
    """What a module defines itself at its top level, one line each: its functions and classes, its
    assignments of anything but another name (``A = B`` and ``A = module.B`` are aliases, a re-export by
    another spelling), and any other statement (a call, a loop: code of its own). Its docstring, imports,
    ``__all__`` and ``if TYPE_CHECKING:`` blocks do not count; the branches of other ``if`` and ``try``
    statements count like the top level."""
    found: list[str] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring (or a bare constant: nothing defined)
        if isinstance(node, ast.If):  # its branches, in source order, before what follows it
            pending[:0] = node.orelse if _is_type_checking(node.test) else [*node.body, *node.orelse]
            continue
        if isinstance(node, ast.Try):
            handlers = [statement for handler in node.handlers for statement in handler.body]
            pending[:0] = [*node.body, *handlers, *node.orelse, *node.finalbody]
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append(f"{node.name} (line {node.lineno})")
            continue
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["__all__"] or node.value is None or isinstance(node.value, ast.Name | ast.Attribute):
                continue  # the export list, a bare annotation, an alias
            found.append(f"{', '.join(names) or ast.unparse(targets[0])} (line {node.lineno})")
            continue
        found.append(f"{type(node).__name__.lower()} statement (line {node.lineno})")
    return found


def _package_imports_from_outside(tree: ast.Module, package: str) -> list[str]:
    """The module-level ``from ... import`` statements of a package's ``__init__`` that name a module
    outside the package (absolute imports only: wsod has no relative one)."""
    return [
        f"from {node.module} import ... (line {node.lineno})"
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module or "").split(".")[0] == PACKAGE
        and not (node.module == package or (node.module or "").startswith(package + "."))
    ]


def test_no_module_of_wsod_only_re_exports_another_modules_names():
    # A package's __init__ is its face: it may re-export its own modules' names, but none from outside it
    # (that is a shim for a module moved elsewhere). Any other module defines something of its own.
    shims = []
    for name, path in module_names(ROOT, PACKAGE).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        if path.name == "__init__.py":
            outside = _package_imports_from_outside(tree, name)
            if outside:
                shims.append(f"{path.relative_to(ROOT)} (a package) re-exports {'; '.join(outside)}")
        elif not own_definitions(tree):
            shims.append(f"{path.relative_to(ROOT)} defines nothing of its own")
    assert not shims, (
        "modules that only re-export (import the names from where they are defined, and delete these):\n  "
        + "\n  ".join(shims)
    )


def test_a_module_that_only_imports_aliases_and_lists_them_is_a_shim():
    shim = ast.parse(
        '"""Moved."""\nfrom typing import TYPE_CHECKING\nfrom pkg.new import A, B\nimport pkg.new\n'
        "C = pkg.new.C\nD: type = B\n__all__ = ['A', 'B', 'C']\n__all__ += ['D']\n"
        "if TYPE_CHECKING:\n    def hint() -> None: ...\n"
        "try:\n    from pkg.fast import E\nexcept ImportError:\n    E = A\n"
    )
    assert own_definitions(shim) == []
    own = ast.parse("from pkg.new import A\nlogger = make_logger()\nif A:\n    class B: ...\nregister(A)\n")
    assert own_definitions(own) == ["logger (line 2)", "B (line 4)", "expr statement (line 5)"]
    init = ast.parse("from pkg.sub.a import A\nfrom pkg.other import B\nfrom typing import Any\n")
    assert _package_imports_from_outside(init, "pkg.sub") == []  # PACKAGE is wsod: pkg is not ours
    init = ast.parse("from wsod.data.a import A\nfrom wsod.engine.b import B\nimport os\n")
    assert _package_imports_from_outside(init, "wsod.data") == ["from wsod.engine.b import ... (line 2)"]

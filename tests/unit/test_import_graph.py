"""Imports flow one way: the import graph of `rft/` and `megatron_bridge/`, read from the source with `ast`, follows
the layer table of docs/architecture.md (no import goes to a higher layer; the packages of one layer import each
other without a cycle; every module is in a layer), has no cycle, and a function-local import of a project module
says why.

The graph: one node per module (a package's `__init__` is the package's node); an edge for every import, top-level
or inside a function, with relative imports resolved. `import a.b` is an edge to `a.b`; `from a import b` is an
edge to `a` (its `__init__` runs and is read) and, when `a.b` is a module, to `a.b`. Imports under
`if TYPE_CHECKING:` are not edges of that graph (they never run), but they are of the graph in which the modules of
one package (its submodules and its `__init__`) import each other in no circle (KNOWN_CYCLES: those still to
remove). A function-local import of a project module is allowed only for a heavy optional dependency behind it,
with a comment containing the word `heavy` on its line or the line above (`# heavy: megatron.core`); everything
else imports at the top, where a cycle shows at once.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rft", "megatron_bridge")
WHY_MARK = "heavy"
ARCHITECTURE = REPO / "docs" / "architecture.md"
LAYERS_MARK = "<!-- layers: read by tests/unit/test_import_graph.py -->"

@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module
    path: Path
    line: int
    local: bool  # inside a function
    why: bool  # a comment on the line or the line above says `heavy`
    type_checking: bool = False  # under `if TYPE_CHECKING:` (never runs; an edge only for the sibling check)


def project_modules(repo: Path, roots: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the roots (packages named by their `__init__`)."""
    modules = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a project module (None: not a project module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    return {t for t in (_known(n, modules) for n in names) if t}


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> list[Import]:
    """Every import of a project module by `module` (not itself), top-level and function-local; with
    `type_checking`, those under `if TYPE_CHECKING:` too (marked so)."""
    source = path.read_text()
    lines = source.splitlines()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def comment_says_why(line: int) -> bool:
        return any("#" in text and WHY_MARK in text.split("#", 1)[1].lower() for text in lines[max(line - 2, 0):line])

    def walk(node: ast.AST, local: bool, checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                if type_checking:
                    for sub in child.body:
                        walk(ast.Module(body=[sub], type_ignores=[]), local, True)
                for sub in child.orelse:
                    walk(ast.Module(body=[sub], type_ignores=[]), local, checking)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in sorted(_targets(child, package, modules) - {module}):
                    found.append(Import(module, target, path, child.lineno, local, comment_says_why(child.lineno),
                                        checking))
            walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), checking)

    walk(ast.parse(source), False, False)
    return found


def import_graph(repo: Path, roots: tuple[str, ...], type_checking: bool = False) -> list[Import]:
    """Every import edge of the project (with `type_checking`, those under `if TYPE_CHECKING:` too)."""
    modules = project_modules(repo, roots)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules, type_checking)]


def cycles(edges: list[Import]) -> list[list[Import]]:
    """One cycle (as its edges, in order) per strongly connected component with more than one module."""
    graph: dict[str, dict[str, Import]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
    found = []
    for component in _components(graph):
        start = min(component)
        found.append(_cycle_through(start, graph, component))
    return found


def _components(graph: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_through(start: str, graph: dict[str, dict[str, Import]], component: set[str]) -> list[Import]:
    """The shortest path from `start` back to itself inside its component (breadth first)."""
    previous: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w, edge in sorted(graph.get(v, {}).items()):
                if w not in component or w in previous:
                    continue
                previous[w] = edge
                if w == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, previous[path[0].source])
                    return path
                following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component of size > 1 always has one


def describe(cycle: list[Import]) -> str:
    def where(e: Import) -> str:
        return f"{e.path.name}:{e.line}{', local' if e.local else ''}{', TYPE_CHECKING' if e.type_checking else ''}"
    return " -> ".join([cycle[0].source] + [f"{e.target} ({where(e)})" for e in cycle])


def sibling_cycles(edges: list[Import]) -> dict[tuple[str, ...], str]:
    """The cycles among the modules of one package (its submodules and its `__init__`), counting the imports under
    `if TYPE_CHECKING:`: one per strongly connected component, keyed by its modules (sorted), with one cycle through
    it described. A module that imports a sibling for its annotations while that sibling imports it back (directly
    or around a circle of siblings) is one module cut in files, whatever the runtime graph says."""
    def parent(module: str) -> str:
        return module.rpartition(".")[0]

    packages: dict[str, dict[str, dict[str, Import]]] = {}
    for e in edges:
        for package in {parent(e.source), e.source}:
            if all(m == package or parent(m) == package for m in (e.source, e.target)):
                packages.setdefault(package, {}).setdefault(e.source, {}).setdefault(e.target, e)
    return {tuple(sorted(component)): describe(_cycle_through(min(component), graph, component))
            for graph in packages.values() for component in _components(graph)}


def unknown_and_stale(found: dict[tuple[str, ...], str], known: dict[tuple[str, ...], str]) -> list[str]:
    """One line per cycle found that `known` does not name exactly, and per entry of `known` no longer found."""
    return ([f"sibling modules import each other (through TYPE_CHECKING too): {found[c]}" for c in found
             if c not in known] +
            [f"KNOWN_CYCLES names {', '.join(c)}, which is no cycle any more: remove the entry" for c in known
             if c not in found])


@dataclass(frozen=True)
class Layer:
    name: str
    rank: int  # 0 = the bottom layer
    packages: tuple[str, ...]


def read_layers(text: str) -> list[Layer]:
    """The layer table: the fenced block after LAYERS_MARK, one line per layer, top layer first; on each line the
    layer's name, then its packages (words that start with a project root), then what they do."""
    after = text.split(LAYERS_MARK, 1)[1]
    block = after.split("```", 2)[1]
    rows = []
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        packages = tuple(w for w in words[1:] if w.split(".")[0] in ROOTS)
        assert packages, f"layer {words[0]!r} in {ARCHITECTURE.name} lists no package"
        rows.append((words[0], packages))
    return [Layer(name, len(rows) - 1 - i, packages) for i, (name, packages) in enumerate(rows)]


def package_of(module: str, layers: list[Layer]) -> tuple[str, Layer] | None:
    """The listed package holding `module` (the longest listed name that is the module or a package above it; a
    bare root such as `rft` holds only its own `__init__`) and its layer; None when no layer lists it."""
    best = None
    for layer in layers:
        for package in layer.packages:
            holds = module == package or ("." in package and module.startswith(package + "."))
            if package in ROOTS and package != "rft":
                holds = module == package or module.startswith(package + ".")
            if holds and (best is None or len(package) > len(best[0])):
                best = (package, layer)
    return best


def layer_violations(edges: list[Import], layers: list[Layer], repo: Path) -> list[str]:
    """One line per import that goes to a higher layer, per module no layer lists, and per cycle between the
    packages of one layer."""
    found, unlisted = [], set()
    package_edges: dict[str, dict[str, Import]] = {}
    for e in edges:
        source, target = package_of(e.source, layers), package_of(e.target, layers)
        for module, where in ((e.source, source), (e.target, target)):
            if where is None and module not in unlisted:
                unlisted.add(module)
                found.append(f"{module}: in no layer of docs/architecture.md")
        if source is None or target is None:
            continue
        (source_package, source_layer), (target_package, target_layer) = source, target
        if target_layer.rank > source_layer.rank:
            found.append(f"{e.path.relative_to(repo)}:{e.line}: {e.source} "
                         f"(layer {source_layer.name}) imports {e.target} (layer {target_layer.name}, above it)")
        elif target_layer.rank == source_layer.rank and source_package != target_package:
            package_edges.setdefault(source_package, {}).setdefault(
                target_package, Import(source_package, target_package, e.path, e.line, e.local, e.why))
    for component in _components(package_edges):
        cycle = _cycle_through(min(component), package_edges, component)
        found.append("packages of one layer import each other in a cycle: " + describe(cycle))
    return found


def test_imports_follow_the_layer_table_of_the_architecture_doc():
    layers = read_layers(ARCHITECTURE.read_text())
    found = layer_violations(import_graph(REPO, ROOTS), layers, REPO)
    assert not found, "imports against the layers of docs/architecture.md:\n" + "\n".join(found)


def test_the_layer_check_finds_an_upward_import_an_unlisted_module_and_a_cycle_within_a_layer(tmp_path):
    _write(tmp_path, {
        "rft/__init__.py": "",
        "rft/low/__init__.py": "",
        "rft/low/a.py": "import os\n\ndef f():\n    # heavy: reaching up\n    from rft.high.b import g\n",
        "rft/low/c.py": "from rft.side import d\n",
        "rft/side/__init__.py": "",
        "rft/side/d.py": "from rft.low.c import x\n",
        "rft/high/__init__.py": "",
        "rft/high/b.py": "from rft.low.a import f\nfrom rft.stray import s\n",
        "rft/stray.py": "s = 1\n",
    })
    table = f"{LAYERS_MARK}\n```\nhigh  rft.high   the top\nlow   rft rft.low rft.side   the bottom\n```\n"
    layers = read_layers(table)
    assert [(layer.name, layer.rank) for layer in layers] == [("high", 1), ("low", 0)]
    found = layer_violations(import_graph(tmp_path, ("rft",)), layers, tmp_path)
    assert "rft/low/a.py:5: rft.low.a (layer low) imports rft.high.b (layer high, above it)" in found
    assert "rft.stray: in no layer of docs/architecture.md" in found
    assert any(line.startswith("packages of one layer import each other in a cycle: rft.low -> rft.side")
               for line in found)
    assert len(found) == 3, found


def test_project_imports_form_no_cycle():
    found = cycles(import_graph(REPO, ROOTS))
    assert not found, "import cycles:\n" + "\n".join(describe(c) for c in found)


# The circles among sibling modules that exist today, each behind `if TYPE_CHECKING:` in one direction, and who removes
# them. The list only shrinks: a new circle fails, and so does an entry whose circle is gone (or changed).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {
}


def test_sibling_modules_import_each_other_in_no_circle_even_for_types():
    problems = unknown_and_stale(sibling_cycles(import_graph(REPO, ROOTS, type_checking=True)), KNOWN_CYCLES)
    assert not problems, "\n".join(problems)


def test_the_sibling_check_sees_circles_behind_type_checking_and_stale_entries(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nfrom pkg.b import B\nif TYPE_CHECKING:\n    from pkg import C\n",
        "pkg/b.py": "from pkg.c import f\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import f\n",  # one way
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from pkg.d import x\n",  # another package's module: not a sibling of pkg.d
    })
    edges = import_graph(tmp_path, ("pkg",), type_checking=True)
    assert not cycles([e for e in edges if not e.type_checking])  # the runtime graph has no cycle
    found = sibling_cycles(edges)
    assert found == {
        ("pkg", "pkg.a"): "pkg -> pkg.a (__init__.py:1) -> pkg (a.py:4, TYPE_CHECKING)",
        ("pkg.b", "pkg.c"): "pkg.b -> pkg.c (b.py:1) -> pkg.b (c.py:3, TYPE_CHECKING)",
    }
    assert unknown_and_stale(found, {("pkg.b", "pkg.c"): "known", ("pkg.a", "pkg.d"): "gone"}) == [
        "sibling modules import each other (through TYPE_CHECKING too): "
        "pkg -> pkg.a (__init__.py:1) -> pkg (a.py:4, TYPE_CHECKING)",
        "KNOWN_CYCLES names pkg.a, pkg.d, which is no cycle any more: remove the entry"]


def test_function_local_imports_of_project_modules_say_why():
    unexplained = [e for e in import_graph(REPO, ROOTS) if e.local and not e.why]
    assert not unexplained, (f"function-local imports of project modules (move them to the top, or say `# {WHY_MARK}: "
                             "<dependency>` for a heavy optional dependency):\n"
                             + "\n".join(f"{e.path.relative_to(REPO)}:{e.line}: {e.source} -> {e.target}"
                                         for e in unexplained))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_cycle_through_a_function_local_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from .a import f  # dodging the cycle\n    return f\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
        "pkg/d.py": "def h():\n    # heavy: pkg.c pulls in a large optional library\n    import pkg.c\n",
    })
    edges = import_graph(tmp_path, ("pkg",))
    [cycle] = cycles(edges)
    assert describe(cycle) == "pkg.a -> pkg.b (a.py:1) -> pkg.a (b.py:2, local)"
    assert not [e for e in edges if e.source == "pkg.c" and e.target == "pkg.a"]  # TYPE_CHECKING is no edge
    assert [(e.source, e.target, e.why) for e in edges if e.local] == [("pkg.b", "pkg.a", False),
                                                                      ("pkg.d", "pkg.c", True)]


def test_a_package_init_importing_a_submodule_that_reads_the_package_is_a_cycle(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "from pkg import b  # through the package, not the sibling\n\ndef f():\n    return b\n",
        "pkg/b.py": "",
        "ok/__init__.py": "from ok.a import f\n",
        "ok/a.py": "import ok.b as b\n\ndef f():\n    return b\n",
        "ok/b.py": "",
    })
    found = cycles(import_graph(tmp_path, ("pkg", "ok")))
    assert [describe(c) for c in found] == ["pkg -> pkg.a (__init__.py:1) -> pkg (a.py:1)"]


def test_no_core_module_imports_the_dashboard():
    """`rft dashboard` (FastAPI, uvicorn) is a tool beside the run: `rft run` starts it as a process, and no module
    outside rft.dashboard imports it (the dispatcher names it by an import path, imported only when called)."""
    outside = [e for e in import_graph(REPO, ROOTS)
               if e.target.startswith("rft.dashboard") and not e.source.startswith("rft.dashboard")]
    assert not outside, [f"{e.path.relative_to(REPO)}:{e.line} imports {e.target}" for e in outside]

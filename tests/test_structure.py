"""The package's shape, kept: no import circles among erase_tune's modules (lazy imports inside
functions count), the engine module stays small, the library (runtime, measure, workloads)
imports nothing of the service or its dependencies, and the functions over 60 lines or with more
than 8 parameters stay as few as they are now: none over 60 lines, five wide (the workload
factories, whose keyword arguments are the user's ``--arg key=value``, are marked exceptions).

Run as a script (``python tests/test_structure.py``) it prints every import circle it finds.

The graph: one node per module of erase_tune (``erase_tune/x/__init__.py`` is ``erase_tune.x``);
an edge for every import statement anywhere in a module's source (top level, inside functions,
under ``if TYPE_CHECKING``), relative imports resolved. ``from p import name`` is an edge to the
submodule ``p.name`` when there is one, else to ``p``. Parent packages that Python runs on the way
to a submodule are not edges of their own, nor are imports by name in a string (importlib).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "erase_tune"

LIBRARY = ("erase_tune.runtime", "erase_tune.measure", "erase_tune.workloads")
NOT_IN_LIBRARY = ("optuna", "ray", "sqlalchemy", "alembic", "erase_tune.tune", "erase_tune.store", "erase_tune.cli")
ENGINE_LINES = 400
LONG_LINES = 60
"""A function longer than this (``end_lineno - lineno + 1``, docstring and decorators' lines
below the ``def`` included) is long."""
WIDE_PARAMETERS = 8
"""A function with more parameters than this (positional-only, positional and keyword-only;
``self``/``cls``, ``*args`` and ``**kwargs`` not counted) is wide."""
MAX_LONG = 0
"""Long functions allowed, at most: none (issue 28 left export_plan; the benchmarks' cases and
export_plan are split into named steps since)."""
MAX_WIDE = 1
"""Wide functions allowed besides the workload factories, at most (issue 28): EraseEngine.__init__
(the runtime's public keyword API, marked ``# wide:``). export_plan takes its confirmation
settings as one ConfirmSettings, estimate's job_phases a TrialShape and a JobShape, and the
store's record_outcome, record_confirmation and record_quality one typed record each."""
FACTORY_MARK = "# wide: the workload's user-facing arguments (--arg key=value)"


def module_files() -> dict[str, Path]:
    """Every module of erase_tune by its dotted name."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_names(name: str, path: Path, files: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """Every module the source of ``name`` imports, absolute, with the line it is on:
    ``from p import a`` is ``p.a`` when that is a module of erase_tune, else ``p``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in files else source), node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """erase_tune's modules, each with the erase_tune modules it imports (and the line of the first import)."""
    files = module_files()
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        targets: dict[str, int] = {}
        for target, line in imported_names(name, path, files):
            if target in files and target != name:
                targets.setdefault(target, line)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: the shortest circle through each module that is on one (Tarjan's
    strongly connected groups, then a breadth-first search in each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)

    found: list[list[str]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for group in groups:
        members = set(group)
        for start in group:
            circle = _shortest_circle(graph, start, members)
            edges = frozenset(zip(circle, circle[1:]))
            if edges not in seen:
                seen.add(edges)
                found.append(circle)
    return found


def _shortest_circle(graph: dict[str, dict[str, int]], start: str, members: set[str]) -> list[str]:
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in members and w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])
    ) + f" -> {circle[-1]}"


def test_no_import_circles():
    graph = import_graph()
    assert "erase_tune.runtime.engine" in graph and graph["erase_tune.runtime.engine"]
    found = cycles(graph)
    assert not found, "import circles among erase_tune's modules:\n" + "\n".join(describe(c, graph) for c in found)


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..other import helper\n"
        "from erase_tune.pkg import sub, NAME\n"
        "if TYPE_CHECKING:\n"
        "    import erase_tune.typed\n"
        "def f():\n"
        "    from erase_tune.lazy import thing\n"
    )
    files = {n: source for n in ("erase_tune.a.b.sibling", "erase_tune.a.other", "erase_tune.pkg",
                                 "erase_tune.pkg.sub", "erase_tune.typed", "erase_tune.lazy")}
    found = {name for name, _ in imported_names("erase_tune.a.b.mod", source, files)}
    assert {"erase_tune.a.b.sibling", "erase_tune.a.other", "erase_tune.pkg.sub", "erase_tune.pkg",
            "erase_tune.typed", "erase_tune.lazy"} <= found
    graph = import_graph()
    assert {"erase_tune.runtime.capture", "erase_tune.runtime.reduce"} <= set(graph["erase_tune.runtime.engine"])


def test_a_circle_is_found_and_shown():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert describe(["a", "b", "c", "a"], graph) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_engine_module_stays_small():
    lines = len((PACKAGE / "runtime" / "engine.py").read_text().splitlines())
    assert lines < ENGINE_LINES, f"erase_tune/runtime/engine.py has {lines} lines; keep it under {ENGINE_LINES}"


def test_the_library_imports_nothing_of_the_service():
    files = module_files()
    bad = []
    for name, path in files.items():
        if not name.startswith(LIBRARY):
            continue
        for target, line in imported_names(name, path, files):
            if any(target == banned or target.startswith(banned + ".") for banned in NOT_IN_LIBRARY):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "the library (runtime, measure, workloads) must not import the service:\n" + "\n".join(sorted(set(bad)))


def functions() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, list[str]]]:
    """Every function and method of erase_tune: (``path:line name``, its node, its file's lines)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node, lines


def length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return node.end_lineno - node.lineno + 1


def width(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    return sum(x.arg not in ("self", "cls") for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))


def is_workload_factory(where: str, node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    """A workload's factory (``workload(...)`` in erase_tune/workloads/), marked as the justified
    exception it is: its keyword arguments are the user's ``--arg key=value``."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return (where.startswith("erase_tune/workloads/") and node.name == "workload" and first >= 2
            and lines[first - 2].strip() == FACTORY_MARK)


def test_long_functions_do_not_grow_back():
    long = [f"{where} ({length(node)} lines)" for where, node, _ in functions() if length(node) > LONG_LINES]
    assert len(long) <= MAX_LONG, (f"{len(long)} functions are over {LONG_LINES} lines (at most {MAX_LONG}): split "
                                   "the new one into well-named steps\n" + "\n".join(long))


def test_wide_functions_do_not_grow_back():
    wide = [f"{where} ({width(node)} parameters)" for where, node, lines in functions()
            if width(node) > WIDE_PARAMETERS and not is_workload_factory(where, node, lines)]
    assert len(wide) <= MAX_WIDE, (f"{len(wide)} functions take more than {WIDE_PARAMETERS} parameters (at most "
                                   f"{MAX_WIDE}): group arguments that travel together into a small frozen "
                                   "dataclass\n" + "\n".join(wide))


def test_the_workload_factories_are_marked_and_the_measures_count_what_they_say():
    factories = [where for where, node, lines in functions() if is_workload_factory(where, node, lines)]
    assert len(factories) >= 5, factories  # ctr, dlrm, gpt, deepfm, mlp
    tree = ast.parse("def f(a, /, b, *args, c, d=1, **kw):\n    pass\n\n\nclass C:\n    def m(self, x):\n"
                     "        return x\n")
    f, m = tree.body[0], tree.body[1].body[0]
    assert (width(f), length(f), width(m), length(m)) == (4, 2, 1, 2)


if __name__ == "__main__":
    graph = import_graph()
    found = cycles(graph)
    for circle in found:
        print(describe(circle, graph))
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(found)} circles")
    sys.exit(1 if found else 0)


SET_UP_SCRIPTS = {"setup.sh", "install-browser.sh", "install-torchrec.sh"}


def test_scripts_holds_only_the_set_up_scripts():
    """Benchmarks and campaigns are cases and suites of erase_tune.benchmarks (issue 28): scripts/
    keeps what sets a machine up, nothing else."""
    found = {p.name for p in (ROOT / "scripts").iterdir()}
    assert found == SET_UP_SCRIPTS, f"scripts/ should hold only {sorted(SET_UP_SCRIPTS)}; also: " \
                                    f"{sorted(found - SET_UP_SCRIPTS)} (a benchmark is a case of erase_tune/benchmarks)"


def _module_level_imports(path: Path) -> Iterator[tuple[str, int]]:
    """Imports that run when the module is imported: top level and under plain ``if``/``try``,
    not inside functions or classes, not under ``if TYPE_CHECKING``."""
    def walk(body):
        for node in body:
            if isinstance(node, ast.Import):
                yield from ((a.name, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                yield node.module or "", node.lineno
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body)
                for h in node.handlers:
                    yield from walk(h.body)

    yield from walk(ast.parse(path.read_text(), str(path)).body)


def test_the_benchmarks_import_the_service_only_when_a_case_runs():
    bad = []
    for path in sorted((PACKAGE / "benchmarks").glob("*.py")):
        for target, line in _module_level_imports(path):
            if any(target == banned or target.startswith(banned + ".") for banned in NOT_IN_LIBRARY):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "erase_tune/benchmarks imports the service at module import time:\n" + "\n".join(bad)

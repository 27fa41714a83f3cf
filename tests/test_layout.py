"""The package's shape: imports point one way down the stack, no module imports itself back, help is quick,
and the core's modules stay small. Imports are read from the source (every `import`, at module top or inside a
function), so a lazy import that points up is caught as well as an eager one."""
from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddscope"
# Lower layers never import higher ones. The top layer's rooms may use each other, but no module may loop back.
LAYERS = {"util": 0, "config": 1, "models": 2, "speculative": 3, "structured": 3, "policy": 4, "engine": 5, "server": 6,
          "bench": 7, "training": 7, "peers": 7, "cli": 8, "": 8}
# Inside bench/, the rooms follow the experiment and point one way too: each imports only the ones before it.
# judging reads collected rows and runs nothing; running drives the server and hands its rows to judging.
BENCH_ORDER = ("errors", "synthetic_models", "limit", "collecting", "judging", "running", "cli")
BENCH_ROOM_FILES = 8  # a room a newcomer can read at a glance
CORE_LIMIT = 300  # lines, outside the rooms that sit on top (bench, training, server)
HELP_BUDGET_S = 0.5


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if "assets" in rel.parts:  # plugins that run inside a peer's own interpreter
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every ddscope module `path` imports (a `from pkg import name` counts pkg.name where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ddscope"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ddscope":
            for a in node.names:
                child = f"{node.module}.{a.name}"
                found.add(child if child in MODULES else node.module)
    return found & set(MODULES)


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def layer(module: str) -> int:
    room = module.split(".")[1] if "." in module else ""
    return LAYERS[room]


def test_every_module_has_a_layer():
    unknown = sorted(m for m in MODULES if ("." in m and m.split(".")[1] not in LAYERS))
    assert not unknown, f"modules in no layer of LAYERS: {unknown}"


def test_imports_point_down_the_stack():
    up = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() for dep in deps if layer(dep) > layer(m))
    assert not up, "imports that point up the stack util -> config -> models -> speculative -> policy -> engine -> " \
                   "server -> bench/training/peers -> cli:\n" + "\n".join(up)


def bench_rank(module: str) -> int:
    """A bench module's place in BENCH_ORDER: its room, or the file itself at bench/'s top (the package is cli's)."""
    parts = module.split(".")
    return BENCH_ORDER.index(parts[2] if len(parts) > 2 else "cli")


def test_bench_rooms_point_one_way():
    bench = [m for m in MODULES if m.startswith("ddscope.bench.")]
    unknown = sorted(m for m in bench if m.split(".")[2] not in BENCH_ORDER)
    assert not unknown, f"bench modules in no room of BENCH_ORDER: {unknown}"
    up = sorted(f"{m} -> {dep}" for m in bench for dep in GRAPH[m]
                if dep.startswith("ddscope.bench.") and bench_rank(dep) > bench_rank(m))
    assert not up, "bench imports that point against " + " -> ".join(BENCH_ORDER) + ":\n" + "\n".join(up)


def test_bench_rooms_are_small():
    rooms = [d for d in (PACKAGE / "bench").iterdir() if d.is_dir() and d.name != "__pycache__"]
    big = {d.name: n for d in rooms if (n := len(list(d.glob("*.py")))) > BENCH_ROOM_FILES}
    assert rooms and not big, f"bench rooms over {BENCH_ROOM_FILES} files: {big}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # a package's __init__ importing its own submodules is how Python packages work, not a loop
    graph = {m: {d for d in deps if not (MODULES[m].name == "__init__.py" and d.startswith(m + "."))}
             for m, deps in GRAPH.items()}
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_the_checks_catch_what_they_guard():
    """The cycle finder and the layer rule fail on a planted loop and a planted upward import."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("ddscope.models.target") < layer("ddscope.engine.runner") < layer("ddscope.server.app")
    assert "ddscope.engine.limits" in GRAPH["ddscope.cli"]  # lazy imports inside functions are read too
    assert bench_rank("ddscope.bench.limit.floor") < bench_rank("ddscope.bench.collecting.backends") \
        < bench_rank("ddscope.bench.judging.analyze") < bench_rank("ddscope.bench.running.sweep") \
        < bench_rank("ddscope.bench.cli") == bench_rank("ddscope.bench")


def test_core_modules_are_small():
    big = {m: n for m, p in MODULES.items()
           if m.split(".")[1:2] not in (["bench"], ["training"], ["server"])
           and (n := len(p.read_text().splitlines())) > CORE_LIMIT}
    assert not big, f"modules over {CORE_LIMIT} lines outside bench/, training/ and server/: {big}"


def test_no_test_only_code_in_the_package():
    """Test helpers live in tests/support: nothing in the package imports pytest or the tests' own modules."""
    def imports_tests(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("pytest", "support", "conftest") for n in names):
                return True
        return False

    assert not [m for m, p in MODULES.items() if imports_tests(p)]


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]])
def test_help_is_quick_and_imports_no_torch(argv):
    """Import and parser build, timed in a fresh interpreter: the best of three, against a generous bound."""
    code = ("import sys, time; t = time.perf_counter(); import ddscope.cli as c; p = c.build_parser(); "
            "dt = time.perf_counter() - t; print(dt, 'torch' in sys.modules, 'transformers' in sys.modules)")
    best, heavy = float("inf"), None
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        best, heavy = min(best, float(out[0])), out[1:]
    assert heavy == ["False", "False"], "building the parser imported torch or transformers"
    assert best < HELP_BUDGET_S, f"{best:.2f} s to build the parser"
    t0 = time.perf_counter()
    shown = subprocess.run([sys.executable, "-m", "ddscope.cli", *argv], capture_output=True, text=True, check=True)
    assert "usage:" in shown.stdout and time.perf_counter() - t0 < 10 * HELP_BUDGET_S

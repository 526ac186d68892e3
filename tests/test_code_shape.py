"""The shape of the code a newcomer reads: no import circle between qdeploy's modules (tests/test_layering.py checks
the order of the stages, this the modules within them), no function longer than a screen or two, and comments that
say what the code does and why rather than when it was written."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "qdeploy"
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, modules: dict) -> str:
    while name and name not in modules:  # a name imported from a module: the module
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for mod, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("qdeploy"):
                for a in node.names:  # `from qdeploy.pkg import submodule` needs the submodule
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in modules else _resolve(node.module, modules))
            elif isinstance(node, ast.Import):
                deps.update(_resolve(a.name, modules) for a in node.names if a.name.startswith("qdeploy."))
        deps.discard(mod)
        deps.discard("")
        graph[mod] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    """A module never needs, directly or through others, a module that needs it. Function-local imports count: a
    circle hidden inside a function is still two modules that each know the other."""
    graph = import_graph()
    assert "qdeploy.optimize.search" in graph and graph["qdeploy.optimize.search"], "the import graph was not read"
    assert circles(graph) == [], "modules that import each other (directly or through others)"


def test_no_function_is_longer_than_a_hundred_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these functions: " + "; ".join(long)


# a comment or docstring that dates itself (an ordinal or "this"/"last" before "session", or "issue N" + "'s run")
# instead of citing its evidence (a docs/results file). The examples below are split literals so that the issue's own
# `grep -rEn` over tests/ finds nothing here either.
NARRATION = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last) session\b"
                       r"|\bissue [0-9]+'s\b", re.IGNORECASE)


def test_the_code_does_not_narrate_its_history():
    assert NARRATION.search("measured in the eighth " "session") and NARRATION.search("issue 36" "'s Xeon rows")
    hits = [f"{p.relative_to(ROOT)}:{i}" for folder in (PACKAGE, ROOT / "tests") for p in folder.rglob("*.py")
            if p.name != Path(__file__).name
            for i, line in enumerate(p.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert not hits, "say what the code does and why, and cite docs/results for a measurement: " + ", ".join(hits)


def test_the_search_runs_steps_and_stays_short():
    """optimize/search.py runs the steps its target lists; a new kind of candidate goes into a step (optimize/steps/)."""
    from qdeploy.optimize.candidates import TARGETS
    from qdeploy.optimize.steps import STEPS

    assert len((PACKAGE / "optimize" / "search.py").read_text().splitlines()) <= 400
    for target in TARGETS.values():
        assert target.steps and set(target.steps) <= set(STEPS), target.name

"""No import circle between qdeploy's modules: a module never needs, directly or through others, a module that
needs it. Function-local imports count: a circle hidden inside a function is still one module knowing another's
privates from both sides (tests/test_layering.py checks the order of the stages, this the modules within them)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "qdeploy"


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
    graph = import_graph()
    assert "qdeploy.optimize.search" in graph and graph["qdeploy.optimize.search"], "the import graph was not read"
    assert circles(graph) == [], "modules that import each other (directly or through others)"

"""The package is a pipeline whose folders are its stages: no module imports from a later stage."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "qdeploy"

# Stage order (docs/ARCHITECTURE.md). Cross-cutting helpers come first; a module may import its own
# stage or earlier ones, never a later one.
LAYERS = [
    {"__init__", "errors", "utils", "sysinfo"},
    {"tasks"},
    {"config"},
    {"facts"},
    {"models"},
    {"data"},
    {"export"},
    {"lint"},
    {"quantize"},
    {"artifacts"},
    {"preflight"},
    {"engines"},
    {"evaluate", "benchmark"},
    {"report"},
    {"pipeline"},
    {"optimize"},
    {"api", "cli", "demo", "__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _stage(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imported_stages(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):  # function-local imports count too
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "qdeploy":
                if len(parts) > 1:
                    out.add(parts[1])
                else:  # from qdeploy import x: x is a stage module or __init__'s own name
                    out.update(a.name if a.name in RANK else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "qdeploy" and len(parts) > 1:
                    out.add(parts[1])
    return out


def test_every_module_belongs_to_a_stage():
    stages = {_stage(p) for p in PACKAGE.rglob("*.py")}
    assert stages <= set(RANK), f"unplaced modules: {sorted(stages - set(RANK))} (add them to LAYERS and ARCHITECTURE.md)"


def test_no_module_imports_from_a_later_stage():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        stage = _stage(path)
        for imported in _imported_stages(ast.parse(path.read_text(), str(path))):
            if RANK.get(imported, -1) > RANK[stage]:
                violations.append(f"{path.relative_to(PACKAGE)} ({stage}) imports qdeploy.{imported}")
    assert not violations, "\n".join(violations)


def test_the_check_catches_a_backward_import():
    tree = ast.parse("def f():\n    from qdeploy.pipeline import run\n")
    assert _imported_stages(tree) == {"pipeline"} and RANK["pipeline"] > RANK["models"]

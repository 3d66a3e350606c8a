"""Every module of imerge_hooks imports, none imports Lightning, and their imports form no cycle.

Function-local imports count: a cycle hidden in a function body is still a cycle. Imports only
for type checking (``if TYPE_CHECKING:``) and a module's program block (``if __name__ ==
"__main__":``) are not part of importing it as a library.
"""

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "imerge_hooks"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _skipped_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    return test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or test.replace("'", '"') == '__name__ == "__main__"'


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if _skipped_block(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("imerge_hooks."):
            found.add(node.module.split(".")[1])
        found |= _imports(node)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        deps = _imports(ast.parse((PACKAGE / f"{name}.py").read_text()))
        graph[name] = {d for d in deps if d in MODULES and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_without_lightning(name):
    importlib.import_module(f"imerge_hooks.{name}")
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m.split(".")[0] for m in imported} & {"lightning", "pytorch_lightning"}, name


LAB = PACKAGE.parent / "benchmarks"
LAB_MAY_IMPORT = {"imerge_hooks", "imerge_hooks.simulate", "imerge_hooks.timeline_report",
                  "imerge_hooks.transport_check", "imerge_hooks.internals"}


def lab_imports(tree: ast.AST) -> set[str]:
    """The ``imerge_hooks`` modules a lab file imports (``from imerge_hooks import x`` counts as
    ``imerge_hooks.x`` where x is a module or package of the library)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "imerge_hooks":
                names += [f"imerge_hooks.{alias.name}" for alias in node.names
                          if (PACKAGE / f"{alias.name}.py").exists() or (PACKAGE / alias.name).is_dir()]
        found |= {n for n in names if n == "imerge_hooks" or n.startswith("imerge_hooks.")}
    return found


def test_the_lab_uses_the_public_api_and_the_one_seam():
    """benchmarks/ imports IMerge's internals only through ``imerge_hooks.internals``."""
    wrong = {}
    for path in sorted(LAB.rglob("*.py")):
        bad = sorted(lab_imports(ast.parse(path.read_text())) - LAB_MAY_IMPORT)
        if bad:
            wrong[str(path.relative_to(LAB.parent))] = bad
    assert not wrong, wrong


def test_the_lab_check_sees_private_imports():
    tree = ast.parse("from imerge_hooks import session, Config\nimport imerge_hooks.engine\n"
                     "from imerge_hooks.plan.choice import choose_plan\nfrom imerge_hooks.internals import MPI\n")
    assert lab_imports(tree) - LAB_MAY_IMPORT == {"imerge_hooks.session", "imerge_hooks.engine",
                                                  "imerge_hooks.plan.choice"}

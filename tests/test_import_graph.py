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

"""Every module of imerge_hooks (every subpackage) imports, none imports Lightning, and their imports
form no cycle, with or without the imports made only for type checking.

Function-local imports count: a cycle hidden in a function body is still a cycle. A module's program
block (``if __name__ == "__main__":``) is not part of importing it as a library.
"""

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "imerge_hooks"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}
MODULES = sorted(FILES)


def _skipped_block(node: ast.AST, type_only: bool) -> bool:
    """A module's program block never counts; ``if TYPE_CHECKING:`` counts only for ``type_only``."""
    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    if test.replace("'", '"') == '__name__ == "__main__"':
        return True
    return not type_only and test in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if FILES[module].name == "__init__.py" else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.AST, module: str, type_only: bool) -> set[str]:
    """The imerge_hooks modules ``module`` imports (a name imported from a package counts as its module
    where it is one), function bodies included."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if _skipped_block(node, type_only):
            continue
        if isinstance(node, ast.ImportFrom):
            target = _absolute(node, module)
            if target.startswith("imerge_hooks"):
                found.add(target)
                found |= {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in FILES}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("imerge_hooks")}
        found |= _imports(node, module, type_only)
    return found


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports; ``type_only``: with the imports made only for type checking."""
    graph = {}
    for name in MODULES:
        deps = _imports(ast.parse(FILES[name].read_text()), name, type_only)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: a package's modules depend on it, not it on them.
        graph[name] = {d for d in deps if d in FILES and d != name and not name.startswith(d + ".")}
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


@pytest.mark.parametrize("type_only", [False, True], ids=["imports", "with-type-only-imports"])
def test_no_import_cycle(type_only):
    cycle = find_cycle(import_graph(type_only))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_imports_across_subpackages():
    graph = import_graph()
    assert "imerge_hooks.cluster.session" in graph["imerge_hooks.worker.engine"]
    assert "imerge_hooks.core.errors" in graph["imerge_hooks.frontends.optimizer"]


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_without_lightning(name):
    if name.endswith(".__main__"):
        return  # running it is the program (python -m imerge_hooks.server)
    importlib.import_module(name)
    tree = ast.parse(FILES[name].read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m.split(".")[0] for m in imported} & {"lightning", "pytorch_lightning"}, name


LAB = PACKAGE.parent / "benchmarks"
LAB_MAY_IMPORT = {"imerge_hooks", "imerge_hooks.simulate", "imerge_hooks.tools.timeline_report",
                  "imerge_hooks.tools.transport_check", "imerge_hooks.internals"}


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
    tree = ast.parse("from imerge_hooks import cluster, Config\nimport imerge_hooks.worker.engine\n"
                     "from imerge_hooks.plan.choice import choose_plan\nfrom imerge_hooks.internals import MPI\n")
    assert lab_imports(tree) - LAB_MAY_IMPORT == {"imerge_hooks.cluster", "imerge_hooks.worker.engine",
                                                  "imerge_hooks.plan.choice"}

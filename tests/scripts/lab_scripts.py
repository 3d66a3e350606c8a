"""Every lab script under benchmarks/ runs: each with a ``__main__`` block answers ``--help`` (exit 0,
a usage line), and every import any of them makes, function-local ones included, resolves.

Usage: python lab_scripts.py   (from the repository root; prints one JSON object: script -> problem)
"""

import ast
import contextlib
import importlib
import io
import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from benchmarks...``/``from imerge_hooks...`` import in the file."""
    found = []
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [module]).strip(".")
            if module.split(".")[0] in ("benchmarks", "imerge_hooks"):
                found.append((module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] in ("benchmarks",
                                                                                             "imerge_hooks")]
    return found


def unresolved(path: Path) -> list[str]:
    missing = []
    for module, names in imports(path):
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        for name in names:
            if not hasattr(loaded, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"cannot import name {name!r} from {module}")
    return missing


def answers_help(path: Path) -> str | None:
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(path), "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(path), run_name="__main__")
        return "ran without --help ending it"
    except SystemExit as done:
        if done.code not in (0, None) or "usage:" not in out.getvalue():
            return f"--help exited {done.code!r}: {out.getvalue()[-300:]}"
        return None
    except BaseException as exc:  # noqa: BLE001 - any failure is the finding
        return f"--help raised {exc!r}"
    finally:
        sys.argv = argv


problems: dict[str, list[str]] = {}
scripts = sorted(p for p in (REPO / "benchmarks").rglob("*.py") if p.name != "__init__.py")
for path in scripts:
    found = unresolved(path)
    if '__name__ == "__main__"' in path.read_text():
        failed = answers_help(path)
        found += [failed] if failed else []
    if found:
        problems[str(path.relative_to(REPO))] = found
print(json.dumps({"checked": len(scripts), "problems": problems}))

"""Every logger of the library and the plugin is ``imerge`` (or a child of it), the one logger
``IMERGE_LOG_LEVEL`` sets: a line logged elsewhere would never show."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def logger_names() -> dict[str, str]:
    """``file:line`` -> the constant name of every ``logging.getLogger(NAME)`` call."""
    found = {}
    for path in sorted([*(REPO / "imerge_hooks").rglob("*.py"), *(REPO / "lightning_plugin").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "logging.getLogger" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                found[f"{path.relative_to(REPO)}:{node.lineno}"] = node.args[0].value
    return found


def test_every_logger_is_imerge():
    names = logger_names()
    assert len(names) > 10, names  # the scan sees the library's loggers
    wrong = {where: name for where, name in names.items() if name != "imerge" and not name.startswith("imerge.")}
    assert not wrong, wrong

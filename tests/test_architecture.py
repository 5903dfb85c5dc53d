"""Boundaries of the package that a refactor must keep: no reach into another module's private
names, and no module-level mutable state outside :mod:`decentadam.shutdown`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "decentadam"
MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "WeakSet",
    "WeakValueDictionary",
    "deque",
}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(source: str) -> list[str]:
    """``from decentadam.x import _y`` and ``x._y`` on an imported decentadam module."""
    tree = ast.parse(source)
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decentadam"):
            found += [f"from {node.module} import {a.name}" for a in node.names if private(a.name)]
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names if "decentadam" in a.name)
    for node in ast.walk(tree):
        is_module = (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        )
        if is_module and private(node.attr):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def mutable_globals(source: str) -> list[int]:
    """Line numbers of module-level names bound to a mutable container (``__all__`` aside)."""
    lines = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        value, mutable = node.value, isinstance(node.value, MUTABLE_LITERALS)
        if isinstance(value, ast.Call):
            func = value.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            mutable = name in MUTABLE_CALLS
        if mutable:
            lines.append(node.lineno)
    return lines


def test_the_checks_find_offences() -> None:
    source = (
        "import decentadam.shutdown as s\nfrom decentadam.buckets import _new_bucket, views_like\ns._OPEN\n"
    )
    assert private_reaches(source) == ["from decentadam.buckets import _new_bucket", "s._OPEN"]
    assert private_reaches("from decentadam import shutdown\nshutdown.close_all()\nx._y\n") == []
    source = (
        "__all__ = []\nA = {}\nB: list[int] = []\nC = weakref.WeakSet()\nD = MappingProxyType({})\nE = (1,)\n"
    )
    assert mutable_globals(source) == [2, 3, 4]


def test_no_module_imports_private_names_of_another() -> None:
    found = {str(p.relative_to(PACKAGE)): private_reaches(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}


def test_module_level_mutable_state_lives_in_shutdown_only() -> None:
    found = {str(p.relative_to(PACKAGE)): mutable_globals(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {path: lines for path, lines in found.items() if lines} == {"shutdown.py": [30]}

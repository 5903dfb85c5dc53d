"""Boundaries of the package that a refactor must keep: no reach into another module's private
names nor into torch's, no module-level mutable state outside :mod:`decentadam.shutdown`,
asynchronous training (:mod:`decentadam.asynchronous`) built without the synchronous optimizer,
and no circle in the imports of the repository's packages (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "decentadam"
TOP_PACKAGES = ("decentadam", "benchmarks", "recipes", "eval", "examples")
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
FOREACH = "_foreach_"
"""The one torch private prefix allowed: the multi-tensor ops (``torch._foreach_add_``, ...) that
torch.optim's own ``foreach`` implementations run on, with no public equivalent of their speed."""
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


def torch_private_reaches(source: str) -> list[str]:
    """Private torch names: ``import torch._C``, ``from torch.x import _y`` (or from a private
    module), ``<torch name>.a._b`` and ``getattr(<torch name>, "_b")`` on a name bound by a torch import."""
    tree = ast.parse(source)
    found, names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                if any(private(part) for part in alias.name.split(".")):
                    found.append(f"import {alias.name}")
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            for alias in node.names:
                if private(alias.name) or any(private(part) for part in module.split(".")):
                    found.append(f"from {module} import {alias.name}")
                names.add(alias.asname or alias.name)

    def root(node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if private(node.attr) and not node.attr.startswith(FOREACH) and root(node) in names:
                found.append(ast.unparse(node))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr", "delattr"}
            and len(node.args) >= 2
            and root(node.args[0]) in names
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            found.append(ast.unparse(node))
    return sorted(found)


def decentadam_imports(path: Path) -> set[str]:
    """The decentadam modules that the file at ``path`` imports (``from decentadam import m`` names m)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "decentadam")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "decentadam":
            module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                found.add(child if module_path(child) is not None else module)
    return found


def module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_by(module: str) -> set[str]:
    """The decentadam modules that ``module`` reaches through its imports, transitively. The parent
    packages that Python runs first (``decentadam/__init__.py`` gathers the public names of both
    optimizers) are not followed: only what the module itself needs."""
    seen, frontier = set(), [module]
    while frontier:
        path = module_path(frontier.pop())
        if path is None:
            continue
        for name in decentadam_imports(path):
            if name not in seen and name != "decentadam":
                seen.add(name)
                frontier.append(name)
    return seen


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


def test_the_torch_check_finds_each_form() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch._C\n"
        "from torch.distributed import distributed_c10d\n"
        "from torch.distributed.distributed_c10d import _world\n"
        "from torch._dynamo import config\n"
        "torch.distributed.distributed_c10d._get_default_store()\n"
        "dist._x\ndistributed_c10d._y\n"
        "getattr(dist.distributed_c10d, '_get_default_store', None)\n"
    )
    assert torch_private_reaches(source) == sorted(
        [
            "import torch._C",
            "from torch.distributed.distributed_c10d import _world",
            "from torch._dynamo import config",
            "torch.distributed.distributed_c10d._get_default_store",
            "dist._x",
            "distributed_c10d._y",
            "getattr(dist.distributed_c10d, '_get_default_store', None)",
        ]
    )
    public = (
        "import torch\nimport torch.distributed as dist\nfrom torch.optim import Optimizer\n"
        "dist.TCPStore\nself._x\nx.__class__\ntorch.Tensor.__init__\ngetattr(torch, 'float32')\n"
        "getattr(self, '_y')\ntorch._foreach_add_(xs, ys)\n"
    )
    assert torch_private_reaches(public) == []


def test_no_module_reaches_torch_private_names() -> None:
    found = {str(p.relative_to(PACKAGE)): torch_private_reaches(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}


def test_asynchronous_training_does_not_import_the_synchronous_optimizer() -> None:
    modules = [f"decentadam.asynchronous.{p.stem}" for p in (PACKAGE / "asynchronous").glob("*.py")]
    assert "decentadam.asynchronous.a2cid2" in modules
    assert {m: "decentadam.decentralized" in imported_by(m) for m in modules} == dict.fromkeys(modules, False)
    assert "decentadam.decentralized" in imported_by("decentadam.checkpoint")  # the check sees imports


def test_the_asynchronous_optimizer_has_one_import_path() -> None:
    import decentadam
    from decentadam.asynchronous import A2CiD2, Graph

    assert (decentadam.A2CiD2, decentadam.Graph) == (A2CiD2, Graph)
    assert [m for m in ("a2cid2", "graph", "pairing") if module_path(f"decentadam.{m}") is not None] == []


def test_no_module_imports_private_names_of_another() -> None:
    found = {str(p.relative_to(PACKAGE)): private_reaches(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}


def test_module_level_mutable_state_lives_in_shutdown_only() -> None:
    found = {str(p.relative_to(PACKAGE)): mutable_globals(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {path: lines for path, lines in found.items() if lines} == {"shutdown.py": [30]}


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def repository_imports(source: str) -> set[str]:
    """The modules of TOP_PACKAGES that ``source`` imports anywhere (in functions too); ``from a.b
    import c`` names ``a.b.c`` where that is a module, else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in TOP_PACKAGES)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module.split(".")[0] in TOP_PACKAGES:
                for alias in node.names:
                    child = f"{module}.{alias.name}"
                    found.add(child if module_path(child) is not None else module)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    source = "import decentadam\ndef f() -> None:\n    from benchmarks.parity import workers\nimport torch\n"
    assert repository_imports(source) == {"decentadam", "benchmarks.parity.workers"}


def test_the_repository_imports_have_no_circle() -> None:
    modules = {module_name(p): p for top in TOP_PACKAGES for p in (ROOT / top).rglob("*.py")}
    graph = {
        m: {i for i in repository_imports(p.read_text()) if i in modules and i != m}
        for m, p in modules.items()
    }
    assert "benchmarks.parity.workers" in graph["benchmarks.parity.workers_table"]  # the graph sees imports
    assert circles(graph) == []

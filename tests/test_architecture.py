"""The import structure of the package: no import cycles, and compatibility paths are façades.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
anywhere in a module counts, those under ``if TYPE_CHECKING:`` and inside functions included.
``from package import name`` points at the submodule ``package.name`` when there is one, else at
the package. A package's ``__init__`` runs before its submodules, but an import of a submodule
is an arrow to that submodule only (the package's ``__init__`` is its face, not a dependency).
A lazy re-export (``__getattr__ = lazy_attributes(__name__, {name: owner})``) is an arrow to
each owner.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: laplace-torch's module paths that only re-export names from the modules that own them.
#: Nothing in the package but another façade imports them (``import laplace`` loads them all, as
#: laplace-torch's does).
FACADES = (
    "laplace",
    "laplace.baselaplace",
    "laplace.utils",
    "laplace.utils.utils",
    "laplace.utils.metrics",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: its dotted name, its file and whether it is a package."""
    modules = {}
    for path in sorted((SRC / "laplace").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = (path, is_package)
    return modules


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package's modules that module ``name`` imports."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in MODULES else source)
        elif _is_lazy_re_export(node):
            owners = node.args[1]
            targets.update(value.value for value in owners.values)
    return {target for target in targets if target in MODULES}


def _is_lazy_re_export(node: ast.AST) -> bool:
    """Whether ``node`` is a call ``lazy_attributes(__name__, {name: "owner", ...})``."""
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "lazy_attributes"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Dict)
        and all(isinstance(value, ast.Constant) for value in node.args[1].values)
    )


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _describe(cycle: frozenset[str]) -> str:
    arrows = [f"{a} -> {b}" for a in sorted(cycle) for b in sorted(GRAPH[a] & cycle)]
    return "; ".join(arrows)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(sorted, _cycles(graph))) == [["a", "b", "c"], ["e"]]


def test_no_import_cycles_between_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + " | ".join(map(_describe, cycles))


@pytest.mark.parametrize("facade", FACADES)
def test_nothing_in_the_package_imports_a_facade(facade):
    importers = sorted(
        name for name, targets in GRAPH.items() if facade in targets and name not in FACADES
    )
    assert not importers, (
        f"{importers} import the façade {facade}: import the module that owns the name instead"
    )


@pytest.mark.parametrize("facade", FACADES)
def test_facades_only_re_export(facade):
    tree = ast.parse(MODULES[facade][0].read_text())
    for statement in tree.body[1:]:  # after the docstring
        is_import = isinstance(statement, ast.Import | ast.ImportFrom)
        is_all = isinstance(statement, ast.Assign) and [
            getattr(target, "id", None) for target in statement.targets
        ] == ["__all__"]
        binds = {
            node.id
            for node in ast.walk(statement)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
        }
        is_version = isinstance(statement, ast.Try) and binds == {"__version__"}
        is_typing_import = (
            isinstance(statement, ast.If)
            and getattr(statement.test, "id", None) == "TYPE_CHECKING"
            and all(isinstance(s, ast.Import | ast.ImportFrom) for s in statement.body)
            and not statement.orelse
        )
        is_lazy = (
            isinstance(statement, ast.Assign)
            and [getattr(target, "id", None) for target in statement.targets] == ["__getattr__"]
            and _is_lazy_re_export(statement.value)
        )
        # the re-exported classes report the façade as their module (pickles, qualified names)
        is_public_path = (
            isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Call)
            and getattr(statement.value.func, "id", None) == "at_public_path"
        )
        assert (
            is_import or is_all or is_version or is_typing_import or is_lazy or is_public_path
        ), f"{facade} defines something (line {statement.lineno})"

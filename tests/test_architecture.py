"""The structure of the package: layers, no import cycles, façades, and the map in the docs.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
anywhere in a module counts, those under ``if TYPE_CHECKING:`` and inside functions included.
``from package import name`` points at the submodule ``package.name`` when there is one, else at
the package. A package's ``__init__`` runs before its submodules, but an import of a submodule
is an arrow to that submodule only (the package's ``__init__`` is its face, not a dependency).
A lazy re-export (``__getattr__ = lazy_attributes(__name__, {name: owner})``) is an arrow to
each owner.

A module imports modules of its own layer or of the layers below it (``LAYERS``, the order
``docs/architecture.md`` draws); the few arrows that run up are listed with their reason in
``UPWARD_IMPORTS``. Every module name and source path the architecture document names exists.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

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


#: The layers, bottom to top (``docs/architecture.md``): a module belongs to the layer of the
#: longest prefix that names it (a prefix names itself and its submodules); the façades are
#: their own top layer. Modules of one layer may import each other.
LAYERS = (
    ("foundations", ("laplace.utils",)),
    ("likelihoods", ("laplace.likelihoods",)),
    ("the native curvature engine", ("laplace.curvature.engine",)),
    ("curvature adapters", ("laplace.curvature",)),
    ("curvature solvers", ("laplace.curvature.solvers",)),
    ("structures", ("laplace.structures",)),
    ("parameter subsets", ("laplace.core.subsets",)),
    ("passes", ("laplace.core.passes",)),
    ("core", ("laplace.core",)),
    ("approximations", ("laplace.parametric", "laplace.functional", "laplace.evaluation")),
    ("laplace-torch's modules of public classes", ("laplace.lllaplace", "laplace.subnetlaplace")),
    ("entry points", ("laplace.laplace", "laplace.marglik_training")),
    ("façades", FACADES),
)

#: The arrows that run up a layer, each with its reason: laplace-torch's ``laplace.utils`` paths
#: ``subnetmask`` and ``functional_utils`` keep their names where laplace-torch users import them,
#: though what they use lives higher up.
UPWARD_IMPORTS = {
    ("laplace.utils.subnetmask", "laplace.likelihoods"): (
        "laplace-torch's subnetmask path: the SWAG mask trains with the likelihood's loss"
    ),
    ("laplace.utils.subnetmask", "laplace.parametric.diag_laplace"): (
        "laplace-torch's subnetmask path: LargestVarianceDiagLaplaceSubnetMask takes a DiagLaplace"
        " (a type annotation, under TYPE_CHECKING)"
    ),
    ("laplace.utils.functional_utils", "laplace.core.transaction"): (
        "laplace-torch's functional_utils path re-exports preserve_model_gradients"
    ),
    ("laplace.utils.functional_utils", "laplace.likelihoods"): (
        "laplace-torch's functional_utils path reads targets as the likelihood objects do"
    ),
}


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


def _layer(name: str) -> int:
    """The index in ``LAYERS`` of module ``name``'s layer."""
    if name in FACADES:
        return len(LAYERS) - 1
    named = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS[:-1])
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    if not named:
        raise LookupError(f"{name} is in no layer: add it to LAYERS")
    return max(named)[1]


def _upward(graph: dict[str, set[str]], layer=_layer) -> list[tuple[str, str]]:
    """The arrows ``(importer, imported)`` from a module to a module of a higher layer."""
    return [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]


def _describe(cycle: frozenset[str]) -> str:
    arrows = [f"{a} -> {b}" for a in sorted(cycle) for b in sorted(GRAPH[a] & cycle)]
    return "; ".join(arrows)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(sorted, _cycles(graph))) == [["a", "b", "c"], ["e"]]


def test_no_import_cycles_between_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + " | ".join(map(_describe, cycles))


def test_the_layer_check_finds_an_upward_import():
    graph = {"low": {"high"}, "high": {"low", "peer"}, "peer": {"high"}}
    layers = {"low": 0, "high": 1, "peer": 1}
    assert _upward(graph, layers.__getitem__) == [("low", "high")]


def test_every_module_has_a_layer():
    assert {name: _layer(name) for name in MODULES}  # raises for a module in no layer


def test_no_module_imports_a_higher_layer():
    upward = [arrow for arrow in _upward(GRAPH) if arrow not in UPWARD_IMPORTS]
    described = [
        f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]})" for a, b in upward
    ]
    assert not upward, "imports that run up a layer: " + "; ".join(described)


def test_every_listed_upward_import_is_still_made():
    stale = sorted(set(UPWARD_IMPORTS) - set(_upward(GRAPH)))
    assert not stale, f"UPWARD_IMPORTS lists arrows the package no longer has: {stale}"


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


def _documented(pattern: str) -> list[str]:
    """The backticked names of ``docs/architecture.md`` that match ``pattern`` entirely."""
    tokens = re.findall(r"`([^`\n]+)`", ARCHITECTURE_DOC.read_text())
    return sorted({token for token in tokens if re.fullmatch(pattern, token)})


DOCUMENTED_NAMES = _documented(r"laplace(\.[A-Za-z_]\w*)+")
DOCUMENTED_PATHS = _documented(r"[\w./-]+\.py")


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then get the rest as attributes."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # not a module: a shorter prefix is
            raise
        for attribute in parts[end:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)


def test_the_document_names_modules_and_paths():
    assert len(DOCUMENTED_NAMES) > 20 and len(DOCUMENTED_PATHS) > 5


@pytest.mark.parametrize("dotted", DOCUMENTED_NAMES)
def test_every_name_the_document_gives_exists(dotted):
    try:
        _resolve(dotted)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"docs/architecture.md names `{dotted}`, which does not exist: {error}")


@pytest.mark.parametrize("path", DOCUMENTED_PATHS)
def test_every_source_path_the_document_gives_exists(path):
    # ``structures/kronecker.py`` or ``src/laplace/structures/kronecker.py`` (or ``tests/...``)
    assert (SRC / "laplace" / path).is_file() or (ROOT / path).is_file(), (
        f"docs/architecture.md names `{path}`, which is no file under src/laplace"
    )

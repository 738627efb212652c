"""Imports go one way, bottom to top (README, "Layout"), and nothing imports in a circle.

The import graph is read from the source with ``ast``: every ``import`` statement counts,
including those inside functions (lazy imports) and ``TYPE_CHECKING`` blocks, and so does every
module named in an ``_EXPORTS`` table or a ``LazyRegistry`` (the lazy exports and registries of
:mod:`headlab._lazy`). A
module may import modules of its own layer or below; a package's ``__init__`` may import its own
modules and takes the highest layer among them. ``headlab.cli`` finds its command modules by
name (``COMMAND_MODULES``), a registry of plug-ins rather than an import; so do the callable
packages (``headlab.importance(...)`` calls ``headlab.api.importance``: :func:`headlab._lazy.callable_module`),
a name resolved at call time, like the command modules.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("headlab._version", "headlab._lazy", "headlab.errors", "headlab.options", "headlab.plugins", "headlab.numbers",
     "headlab.compiled"),
    # Training options are plain values (the Hard Concrete gates' defaults live with them).
    ("headlab.heads", "headlab.display", "headlab.markup", "headlab.resume", "headlab.preflight", "headlab.lock",
     "headlab.outdir", "headlab.shard", "headlab.stored_weights", "headlab.portable_code",
     "headlab.nmt.config", "headlab.training.config", "headlab.pruning.config"),
    ("headlab.adapters",),
    # Hard Concrete gates are gates (headlab exports them) that live with the pruning they serve.
    ("headlab.capture", "headlab.attention", "headlab.gates", "headlab.surgery", "headlab.prune_check", "headlab.loading",
     "headlab.language_model",
     "headlab.headspec", "headlab.checkpoint", "headlab.device_options", "headlab.portable",
     "headlab.pruning.hard_concrete", "headlab.model_description"),
    # What the features share: data and batches, and the training engine (every trainer's loop and losses).
    ("headlab.data", "headlab.training"),
    ("headlab.importance", "headlab.functions", "headlab.aggregate", "headlab.pruning", "headlab.nmt", "headlab.lm",
     "headlab.parse"),
    ("headlab.pipeline", "headlab.report", "headlab.api"),
    ("headlab.cli", "headlab.__main__", "headlab.commands", "headlab.demo", "*.cli"),
)
"""Bottom to top; a module belongs to the layer of its longest matching prefix."""

FOUNDATION = 3
"""``import headlab`` (the package itself) may import layers 0..FOUNDATION only."""

API = ("headlab.api",)
"""...and the one-call API, exported lazily: ``import headlab`` does not load it (test_import_headlab_is_light)."""


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in sorted((SRC / "headlab").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(name: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The headlab modules an import statement loads (a submodule when it names one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = name.split(".")[: len(name.split(".")) - (node.level - (1 if is_package else 0))]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]


def _imports(name: str) -> set[str]:
    path, is_package = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        # The lazy tables: a package's _EXPORTS ({"module": names}), a LazyRegistry({name: "module.Name"}).
        lazy = []
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            lazy = getattr(node.value, "keys", [])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "LazyRegistry" and node.args:
            lazy = getattr(node.args[0], "values", [])
        for value in lazy:
            if isinstance(value, ast.Constant):
                target = value.value
                while target not in MODULES and "." in target:  # "module.Name" -> module
                    target = target.rsplit(".", 1)[0]
                found.add(target)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _resolve(name, is_package, node):
                while target not in MODULES and "." in target:  # `import headlab.x.y` of a name
                    target = target.rsplit(".", 1)[0]
                if target.startswith("headlab") and target in MODULES and target != name:
                    found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _own_layer(name: str) -> int | None:
    best, layer = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.startswith("*."):
                matches = name.endswith(prefix[1:])
            else:
                matches = name == prefix or name.startswith(prefix + ".")
            length = 1000 if prefix.startswith("*.") else len(prefix)
            if matches and length > best:
                best, layer = length, index
    return layer


def layer_of(name: str) -> int:
    """A module's layer; a package ``__init__``: the highest layer of what it imports."""
    if MODULES[name][1] and name != "headlab":
        own = _own_layer(name)
        return max([own if own is not None else 0] + [layer_of(m) for m in GRAPH[name] if m.startswith(name + ".")])
    layer = _own_layer(name)
    assert layer is not None, f"{name} is in no layer: add it to LAYERS in tests/test_layers.py"
    return layer


def test_every_module_has_a_layer():
    missing = [name for name in MODULES if name != "headlab" and not MODULES[name][1] and _own_layer(name) is None]
    assert not missing, f"modules in no layer (add them to LAYERS): {missing}"


def test_no_upward_import():
    upward = []
    for name, targets in GRAPH.items():
        if name == "headlab":
            continue
        for target in sorted(targets):
            if target == "headlab":
                upward.append(f"{name} imports the package headlab: import from the module that defines the name")
            elif layer_of(target) > layer_of(name) and not (MODULES[name][1] and target.startswith(name + ".")):
                upward.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_package_headlab_imports_the_foundation_only():
    heavy = [m for m in GRAPH["headlab"] if layer_of(m) > FOUNDATION and m not in API]
    assert not heavy, f"`import headlab` would load {heavy}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_cycle():
    assert not _cycles(GRAPH), f"import cycles: {_cycles(GRAPH)}"


def _group(name: str) -> str:
    """The top-level package (or module) a module belongs to; command-line modules form one group."""
    if _own_layer(name) == len(LAYERS) - 1 and not MODULES[name][1]:
        return "cli"
    parts = name.split(".")
    return ".".join(parts[:2])


def test_no_package_cycle():
    """Importing any module runs its package's __init__: packages must not import in a circle
    either (headlab.aggregate -> headlab.functions -> headlab.aggregate failed that way)."""
    groups: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        if name == "headlab":
            continue
        source = _group(name)
        groups.setdefault(source, set()).update(_group(t) for t in targets if _group(t) != source and t != "headlab")
    assert not _cycles(groups), f"package cycles: {_cycles(groups)}"


def test_graph_sees_lazy_imports():
    """The walk must see imports inside functions and lazy tables, or it would miss what it is there to catch."""
    assert "headlab.loading" in GRAPH["headlab.pipeline.pipeline"]  # imported inside a method
    assert "headlab.importance.lrp" in GRAPH["headlab.importance.registry"]  # a LazyRegistry entry
    assert "headlab.gates" in GRAPH["headlab"]  # a lazy package export
    assert layer_of("headlab.importance.cli") == len(LAYERS) - 1


@pytest.mark.parametrize("statement", ["import headlab"])
def test_import_headlab_is_light(statement):
    """No training loop, no plotting library, no Accelerate behind ``import headlab``."""
    code = (f"{statement}\nimport sys\n"
            "heavy = [m for m in sys.modules if m.startswith(('matplotlib', 'accelerate', 'sacrebleu', "
            "'headlab.nmt', 'headlab.pruning.train', 'headlab.importance', 'headlab.functions', 'headlab.api'))]\n"
            "print(','.join(heavy))")
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "", f"`{statement}` loads {out.stdout.strip()}"


def test_the_readmes_layer_table_is_this_tests():
    """README's table of layers names exactly the modules of LAYERS, each in its layer."""
    import re

    readme = (SRC.parent / "README.md").read_text(encoding="utf-8")
    table = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d) \| (.*) \|$", readme, re.M)}
    assert sorted(table) == list(range(len(LAYERS)))
    for index, prefixes in enumerate(LAYERS):
        named = set(re.findall(r"`([^`]+)`", table[index]))
        expected = {p.removeprefix("headlab.") for p in prefixes}
        assert named == expected, (index, sorted(named ^ expected))


def _imported_names(path: Path) -> set[str]:
    """Every module an ``import`` statement of ``path`` names (absolute imports; any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_headlab_never_imports_the_reproduction():
    """The paper's reproduction (``reproduction/`` at the repository root, not installed) uses
    headlab; headlab, which users install without it, must not import it, not even lazily."""
    offenders = sorted(f"{name} imports {target}" for name, (path, _) in MODULES.items()
                       for target in _imported_names(path) if target.split(".")[0] == "reproduction")
    assert not offenders, offenders
    assert (SRC.parent / "reproduction" / "__init__.py").is_file()  # the reproduction is where this test says


def test_the_reproduction_is_not_installed_with_headlab():
    """pyproject finds the wheel's packages under src/ only: ``reproduction`` stays in the checkout."""
    import re

    from setuptools import find_packages

    pyproject = (SRC.parent / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'\[tool\.setuptools\.packages\.find\]\nwhere = \["src"\]\n', pyproject)
    packages = find_packages(where=str(SRC))
    assert "headlab" in packages and not [p for p in packages if p.split(".")[0] in ("reproduction", "tests")]

"""tfm's modules import one way: no cycle among the module-level imports, no import of a tfm
module inside a function (where it would hide a cycle) outside a short, explained allow-list, and
each package imports only packages on floors below its own (FLOORS, the map docs/DESIGN.md draws).
Code reads no `_private` attribute of another module's objects, and tfm imports no `unittest`.

Read with `ast`, without importing anything: relative imports are resolved, only tfm.* edges count,
and `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfm"

# Function-level tfm imports that are lazy for a reason other than a cycle: {(module, imported): why}.
LAZY_ALLOWED: dict = {
    ("tfm.ops.pallas", "tfm.kernels.flash_hopper"): "Mosaic GPU's modules (0.3 s of every import of tfm.train) "
                                                    "load only where the Hopper driver runs",
}

# tfm's packages (and top-level modules) by floor, the lowest first: a package imports only packages on
# floors below its own, never one beside or above it. The root package (`tfm/__init__.py`, lazy) is none.
FLOORS = (
    {"kernels", "parallel", "data"},   # Pallas kernels and their tiles; meshes and rules; input pipelines
    {"capabilities"},                  # what each attention backend and MoE implementation supports
    {"config", "ops"},                 # ModelConfig and friends; attention entry point and backends
    {"layers"},                        # norms, embeddings, attention, feed-forward, the block
    {"models"},                        # the families and their typed outputs
    {"train", "decode", "convert"},    # the loop; generation; Hugging Face import and export
    {"preflight"},                     # compiles a Trainer's step for chips it does not have
)

# `_private` attributes read outside their module, by the expression read: {expression: why}.
PRIVATE_ALLOWED = {"os._exit": "the documented exit without interpreter teardown (experiments.common.fail)"}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public despite the underscore


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: pathlib.Path) -> dict:
    """{dotted name: path} of every module under `package`."""
    return {_module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]  # a module's package; a package is its own
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node, module: str, is_package: bool, modules: dict) -> list:
    """The tfm modules an import statement loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        source = _absolute(node, module, is_package)
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    return sorted({n for n in names if n == "tfm" or n.startswith("tfm.")})


def _imports(modules: dict):
    """({module: set of tfm modules imported at module level}, [(module, line, target) imported in a function])."""
    graph, nested = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set()
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        in_function = {id(n) for f in functions for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(node, name, is_package, modules)
            if id(node) in in_function:
                nested += [(name, node.lineno, t) for t in targets]
            else:  # module level, including `if TYPE_CHECKING:` / try blocks: they run at import
                graph[name].update(t for t in targets if t != name)
    return graph, nested


def _with_parents(graph: dict, modules: dict) -> dict:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: an edge to each parent package, less
    the module's own ancestors (already importing when it runs). An explicit import of an ancestor
    (`from tfm.convert import CONVERTERS` inside tfm.convert.export) stays an edge: that is a cycle."""
    full = {}
    for name, deps in graph.items():
        parents = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)}
        parents = {p for p in parents if p in modules and not name.startswith(p + ".")}
        full[name] = (set(deps) | parents) - {name}
    return full


def find_cycle(graph: dict):
    """One import cycle as [m0, m1, ..., m0], or None (iterative DFS)."""
    state = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack, path = [(start, iter(sorted(graph.get(start, ()))))], [start]
        state[start] = 1  # on the path
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2  # done
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def test_no_import_cycle():
    modules = _modules(PACKAGE)
    graph, _ = _imports(modules)
    cycle = find_cycle(_with_parents(graph, modules))
    assert cycle is None, "import cycle in tfm: " + " -> ".join(cycle)


def test_no_function_level_tfm_imports():
    """A function-level import of a tfm module is either a cycle dodged or a cost hidden; moving it
    to the top must be possible (test_no_import_cycle then proves it one way), unless allow-listed."""
    _, nested = _imports(_modules(PACKAGE))
    found = [f"{module}:{line} imports {target}" for module, line, target in nested
             if (module, target) not in LAZY_ALLOWED]
    assert not found, "function-level tfm imports (move them to module top):\n  " + "\n  ".join(found)


def test_cycle_detection_catches_a_planted_cycle(tmp_path):
    """The checks fail on what they look for: a two-module cycle, hidden through a parent package,
    and a function-level import."""
    pkg = tmp_path / "tfm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tfm.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    modules = _modules(pkg)
    graph, nested = _imports(modules)
    assert nested == [("tfm.sub.b", 2, "tfm.a")]
    assert find_cycle(_with_parents(graph, modules)) is None
    (pkg / "sub" / "b.py").write_text("from ..a import x\n")  # the same import at module top
    graph, _ = _imports(modules)
    cycle = find_cycle(_with_parents(graph, modules))
    assert cycle is not None and {"tfm.a", "tfm.sub.b"} <= set(cycle)
    (pkg / "sub" / "b.py").write_text("from tfm.sub import helper\n")  # a name of its own package
    graph, _ = _imports(modules)
    assert find_cycle(_with_parents(graph, modules)) == ["tfm.sub", "tfm.sub.b", "tfm.sub"]
    (pkg / "sub" / "b.py").write_text("import tfm.c\n")  # through another module's parent package
    (pkg / "c.py").write_text("from tfm.sub import something\n")
    modules = _modules(pkg)
    graph, _ = _imports(modules)
    assert find_cycle(_with_parents(graph, modules)) is not None


@pytest.mark.parametrize("module", ["tfm.convert", "tfm.convert.export", "tfm.config"])
def test_modules_import_on_their_own(module):
    """Each entry point imports in a fresh interpreter (an order-dependent cycle would fail here)."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _floor(module: str) -> int:
    """The floor of a tfm module (its package's); len(FLOORS) for the root package."""
    package = module.split(".")[1] if "." in module else None
    return next((i for i, floor in enumerate(FLOORS) if package in floor), len(FLOORS))


def floor_violations(modules: dict) -> list:
    """"module imports target" for each import (module- or function-level) of a package on the
    importer's floor or above; "package has no floor" for a package FLOORS does not place."""
    graph, nested = _imports(modules)
    edges = [(m, t) for m, targets in graph.items() for t in targets] + [(m, t) for m, _, t in nested]
    placed = set().union(*FLOORS)
    found = sorted({f"{m.split('.')[1]} has no floor (add it to FLOORS)" for m in modules
                    if "." in m and m.split(".")[1] not in placed})
    for module, target in sorted(set(edges)):
        if module == "tfm" or module.split(".")[:2] == target.split(".")[:2]:
            continue  # the lazy root; within one package
        if _floor(target) >= _floor(module):
            found.append(f"{module} (floor {_floor(module)}) imports {target} (floor {_floor(target)})")
    return found


def _own_names(tree) -> set:
    """Every name a module defines or binds: functions, classes, assignments, attributes it sets."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.attr)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
    return names


def private_reads(paths) -> list:
    """"path:line: expression" for each read of a `_private` attribute (not a dunder) that the file
    itself does not define, on anything but `self`/`cls`: another module's object or class."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        own = _own_names(tree)
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr.startswith("_")
                    and not n.attr.startswith("__")):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            text = ast.unparse(n)
            if n.attr not in own and n.attr not in NAMEDTUPLE_API and text not in PRIVATE_ALLOWED:
                found.append(f"{path}:{n.lineno}: {text}")
    return found


def unittest_imports(modules: dict) -> list:
    """"module:line" for each import of unittest (or a submodule), at any level."""
    found = []
    for name, path in modules.items():
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else (
                [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else [])
            if any(x == "unittest" or x.startswith("unittest.") for x in names):
                found.append(f"{name}:{n.lineno}")
    return found


def test_packages_import_only_floors_below_their_own():
    found = floor_violations(_modules(PACKAGE))
    assert not found, "imports against tfm's floors (tests/test_imports.py FLOORS):\n  " + "\n  ".join(found)


def test_no_private_attribute_is_read_outside_its_module():
    """tfm, the experiments and the benchmarks (tests are exempt: they may inspect internals)."""
    paths = [p for top in ("tfm", "experiments", "benchmarks") for p in sorted((ROOT / top).rglob("*.py"))]
    found = private_reads(paths)
    assert not found, "private attributes read outside their module (give them a public API):\n  " + \
        "\n  ".join(found)


def test_tfm_imports_no_unittest():
    found = unittest_imports(_modules(PACKAGE))
    assert not found, "unittest imported by tfm (test code belongs in tests/):\n  " + "\n  ".join(found)


def _plant(root: pathlib.Path, files: dict) -> dict:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return _modules(root / "tfm")


def test_the_checks_catch_planted_violations(tmp_path):
    """Each check fails on what it looks for, and only on that."""
    modules = _plant(tmp_path, {
        "tfm/__init__.py": "", "tfm/kernels/__init__.py": "", "tfm/ops/__init__.py": "", "tfm/config.py": "",
        "tfm/layers/__init__.py": "", "tfm/layers/block.py": "from tfm.ops import x\nfrom . import common\n",
        "tfm/layers/common.py": "from tfm import kernels, config\n",
        "tfm/ops/xla.py": "import tfm.kernels\n"})
    assert floor_violations(modules) == []  # downward, and within a package
    (tmp_path / "tfm/kernels/flash.py").write_text("def f():\n    from tfm.ops import xla\n")  # upward, lazily
    (tmp_path / "tfm/config.py").write_text("from tfm.ops import attention\n")  # beside: the same floor
    (tmp_path / "tfm/extras.py").write_text("")
    assert floor_violations(_modules(tmp_path / "tfm")) == [
        "extras has no floor (add it to FLOORS)",
        "tfm.config (floor 2) imports tfm.ops (floor 2)",
        "tfm.kernels.flash (floor 0) imports tfm.ops.xla (floor 2)"]

    reader = tmp_path / "reader.py"
    reader.write_text("class A:\n    def f(self, other):\n        return self._x, other._x, cls._y\n\n"
                      "    _x = 1\n\n_helper = 2\nA()._helper\nos._exit(0)\nt._replace(a=1)\n")
    assert private_reads([reader]) == []  # its own names, self/cls, allowed, namedtuple API
    reader.write_text("def check(trainer):\n    return trainer._step, trainer.__class__\n")
    assert private_reads([reader]) == [f"{reader}:2: trainer._step"]

    modules = _plant(tmp_path / "u", {"tfm/__init__.py": "import unittesting\n",
                                      "tfm/data.py": "import os\n\ndef f():\n    from unittest import mock\n"})
    assert unittest_imports(modules) == ["tfm.data:4"]
    (tmp_path / "u/tfm/__init__.py").write_text("import unittest.mock as m\n")
    assert unittest_imports(_modules(tmp_path / "u/tfm")) == ["tfm:1", "tfm.data:4"]

"""The package's imports run one way, from the ground up (docs/design.md, "Module map and layers"): every module of
``xpar_zoo`` (with ``plans/`` and ``converters/``, installed as ``xpar_zoo.plans`` and ``xpar_zoo.converters``) is
parsed, every import it makes is an edge — at module level and inside functions, relative imports resolved — and the
graph has no upward edge, no cycle (between modules, nor between folders), and no edge into the test harness. No module
reaches a private attribute that another folder puts on an object by naming it in a string (``getattr(model,
"_xpar")``, ``vars(m)``, ``m.__dict__``): the import graph cannot see such a back door, so it is its own check.

The checks are plain functions over a graph; the tests at the end prove on a synthetic graph that they do catch an
upward edge, a cycle (also one through a function-level import, and one between folders), an import of the harness and
an attribute-string back door."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]

# The layer of each folder or module (the longest matching prefix wins). A module imports only from its own layer
# or a lower one.
LAYERS: dict[str, int] = {
    # 0: the base everything may use
    "xpar_zoo.errors": 0, "xpar_zoo.compat": 0, "xpar_zoo.version": 0, "xpar_zoo.environment": 0, "xpar_zoo.interrupts": 0,
    # 1: facts and ranks: plans as data, meshes and coordination
    "xpar_zoo.zoo": 1, "xpar_zoo.plans": 1, "xpar_zoo.parallel": 1,
    # 2: what parallelize installs (styles incl. LoRA, losses, kernels), durable files, the hub format and adapter files
    "xpar_zoo.kernels": 2, "xpar_zoo.styles": 2, "xpar_zoo.loss": 2, "xpar_zoo.io": 2, "xpar_zoo.hub": 2,
    # 3: the orchestrator
    "xpar_zoo.parallelize": 3,
    # 4: loading a parallelized model (from_pretrained), checkpoints, the sizer
    "xpar_zoo.loader": 4, "xpar_zoo.checkpoint": 4, "xpar_zoo.sizing": 4,
    # 5: what a user runs
    "xpar_zoo.integrations": 5, "xpar_zoo.train": 5, "xpar_zoo.converters": 5, "xpar_zoo.commands": 5,
    "xpar_zoo.testing": 5,
    # 6: the public API's entry points
    "xpar_zoo": 6, "xpar_zoo.__main__": 6, "xpar_zoo.train.__main__": 6,
}

# Folders that import each other by design. ``plans/`` is the zoo's data, one file per architecture written in
# ``zoo/plan.py``'s types and read by ``zoo/registry.py``; it is a package of its own only so that adding an
# architecture is adding a file.
FOLDER_PAIRS = {frozenset({"xpar_zoo.zoo", "xpar_zoo.plans"})}

HARNESS = "xpar_zoo.testing"
# The modules outside the harness that may import it: ``xpar-zoo demo`` is a run of the parity harness, and the model
# cards (``xpar-zoo list``, MODEL_CARDS.md) print the zoo's proof table (``testing/proofs.py``).
HARNESS_USERS = {"xpar_zoo.commands.demo", "xpar_zoo.commands.model_cards"}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{package name: folder}`` of the installed packages whose folder is not their dotted path (pyproject's
    ``package-dir``), plus ``xpar_zoo`` itself."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {"xpar_zoo": root / "xpar_zoo"} | {name: root / folder for name, folder in setup["package-dir"].items()}


def discover(dirs: Mapping[str, Path]) -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package)}`` for every ``.py`` file under the package folders."""
    out = {}
    for prefix, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            name = ".".join([prefix, *(parts[:-1] if package else parts)])
            out[name] = (path, package)
    return out


def imports_of(name: str, source: str, is_package: bool, modules: Iterable[str]) -> list[tuple[str, int]]:
    """Every ``(module, line)`` of ``modules`` that ``source`` (the module ``name``) imports, wherever the import
    statement is (module level, a function, a branch); relative imports resolved. ``from pkg import sub`` counts as an
    import of the module ``pkg.sub`` when there is one, else of ``pkg``."""
    known = set(modules)
    package = name if is_package else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known]
            targets = subs + ([module] if len(subs) < len(node.names) else [])
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.append((target, node.lineno))
    return edges


@functools.lru_cache
def import_graph(root: Path = ROOT) -> dict[str, list[tuple[str, int]]]:
    """``{module: [(imported module, line), ...]}`` of the whole package (parsed once per test session; read only)."""
    modules = discover(package_dirs(root))
    return {name: imports_of(name, path.read_text(), package, modules) for name, (path, package) in modules.items()}


def layer_of(module: str, layers: Mapping[str, int] = LAYERS) -> int | None:
    while module:
        if module in layers:
            return layers[module]
        module = module.rpartition(".")[0]
    return None


def unplaced(graph: Mapping[str, object], layers: Mapping[str, int] = LAYERS) -> list[str]:
    return sorted(m for m in graph if layer_of(m, layers) is None)


def upward_edges(graph: Mapping[str, list[tuple[str, int]]], layers: Mapping[str, int] = LAYERS) -> list[str]:
    """Each import of a higher layer, as ``"a (layer 1) imports b (layer 3), line 12"``."""
    out = []
    for src, edges in sorted(graph.items()):
        for dst, line in edges:
            low, high = layer_of(src, layers), layer_of(dst, layers)
            if low is not None and high is not None and high > low:
                out.append(f"{src} (layer {low}) imports {dst} (layer {high}), line {line}")
    return out


def harness_imports(graph: Mapping[str, list[tuple[str, int]]], harness: str = HARNESS,
                    users: Iterable[str] = HARNESS_USERS) -> list[str]:
    inside = lambda m: m == harness or m.startswith(harness + ".")  # noqa: E731
    return [f"{src} imports {dst}, line {line}" for src, edges in sorted(graph.items()) if not inside(src)
            and src not in set(users) for dst, line in edges if inside(dst)]


def cycles(graph: Mapping[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The import cycles: one path ``[a, b, ..., a]`` per strongly connected component of more than one module."""
    succ = {m: sorted({d for d, _ in edges if d in graph}) for m, edges in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def connect(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(_cycle_in(sorted(component), succ))

    for v in sorted(succ):
        if v not in index:
            connect(v)
    return out


def _cycle_in(component: list[str], succ: Mapping[str, list[str]]) -> list[str]:
    """A path from the component's first module back to itself, inside the component (breadth first)."""
    members, start = set(component), component[0]
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in succ[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def folder_of(module: str) -> str:
    """The folder a module lives in (``xpar_zoo.hub.writer`` -> ``xpar_zoo.hub``); a top-level module
    (``xpar_zoo.parallelize``) and an entry script that nothing imports (``xpar_zoo.train.__main__``) are their own."""
    return module if module.endswith(".__main__") else ".".join(module.split(".")[:2])


def folder_cycles(graph: Mapping[str, list[tuple[str, int]]], allowed: Iterable[frozenset] = ()) -> list[str]:
    """The cycles between folders (but the ``allowed`` pairs), each as its folders and, per hop, one module edge that
    makes it: ``"a -> b -> a (a.x imports b.y, line 3; b.z imports a.w, line 9)"``."""
    edges: dict[str, dict[str, str]] = {}
    allowed = set(allowed)
    for src, targets in sorted(graph.items()):
        for dst, line in targets:
            a, b = folder_of(src), folder_of(dst)
            if a != b and dst in graph and frozenset({a, b}) not in allowed:
                edges.setdefault(a, {}).setdefault(b, f"{src} imports {dst}, line {line}")
    folders = {f: [(g, 0) for g in sorted(edges.get(f, {}))] for f in {folder_of(m) for m in graph}}
    out = []
    for cycle in cycles(folders):
        hops = "; ".join(edges[a][b] for a, b in zip(cycle, cycle[1:]))
        out.append(f"{' -> '.join(cycle)} ({hops})")
    return out


_STRING_ACCESS = {"getattr", "hasattr", "setattr", "delattr"}


def _literal(node: ast.AST, constants: Mapping[str, str]) -> str | None:
    """The private attribute name ``node`` spells: a string literal, or a module-level constant holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value
    elif isinstance(node, ast.Name):
        name = constants.get(node.id)
    else:
        return None
    return name if name and name.startswith("_") and not name.startswith("__") else None


def _is_dict_of(node: ast.AST) -> bool:
    """``x.__dict__`` or ``vars(x)``."""
    return ((isinstance(node, ast.Attribute) and node.attr == "__dict__")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"))


def _class_names(node: ast.ClassDef) -> set[str]:
    """The methods and class attributes a class body defines."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _reached_by_string(node: ast.AST, constants: Mapping[str, str]) -> tuple[str | None, bool]:
    """``(name, writes)``: the private attribute ``node`` reaches by a string, and whether it puts it there."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in _STRING_ACCESS and len(node.args) >= 2:
            return _literal(node.args[1], constants), func.id == "setattr"
        if isinstance(func, ast.Attribute) and func.attr == "get" and _is_dict_of(func.value) and node.args:
            return _literal(node.args[0], constants), False
    elif isinstance(node, ast.Subscript) and _is_dict_of(node.value):
        return _literal(node.slice, constants), isinstance(node.ctx, ast.Store)
    elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
          and _is_dict_of(node.comparators[0])):
        return _literal(node.left, constants), False
    return None, False


def attribute_uses(source: str) -> tuple[set[str], list[tuple[str, int]]]:
    """``(defined, reached)`` of one module: the attribute names it puts on objects (``x._a = ...``,
    ``setattr(x, "_a", ...)``, ``x.__dict__["_a"] = ...``, a method or class attribute), and every private
    ``(name, line)`` it reaches by a string (``getattr``/``hasattr``/``setattr``/``delattr``, ``x.__dict__.get``,
    ``x.__dict__[...]``, ``"_a" in vars(x)``, also through a module-level constant) or, for the package's own
    ``_xpar*`` names, as a plain attribute."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    defined, reached = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            defined |= _class_names(node)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_xpar"):
            reached.append((node.attr, node.lineno))
        else:
            name, writes = _reached_by_string(node, constants)
            if name and writes:
                defined.add(name)
            elif name:
                reached.append((name, node.lineno))
    return defined, reached


def attribute_back_doors(sources: Mapping[str, str]) -> list[str]:
    """Each private attribute a module reaches by name (:func:`attribute_uses`) where only other folders put it on
    objects, as ``"a.b reads _x by name, line 4 (put there by c.d)"``. Names the package never defines (torch's,
    transformers') are :mod:`xpar_zoo.compat`'s business, not this check's."""
    uses = {m: attribute_uses(src) for m, src in sources.items()}
    owners: dict[str, set[str]] = {}
    for module, (defined, _) in uses.items():
        for name in defined:
            owners.setdefault(name, set()).add(module)
    out = []
    for module, (_, reached) in sorted(uses.items()):
        for name, line in reached:
            by = owners.get(name, set())
            if by and folder_of(module) not in {folder_of(m) for m in by}:
                out.append(f"{module} reads {name} by name, line {line} (put there by {', '.join(sorted(by))})")
    return out


def package_sources(root: Path = ROOT) -> dict[str, str]:
    return {name: path.read_text() for name, (path, _) in discover(package_dirs(root)).items()}


# --- the package --------------------------------------------------------------------------------------------------

def test_every_module_has_a_layer():
    assert not unplaced(import_graph()), "modules with no layer in LAYERS (place them): " + ", ".join(
        unplaced(import_graph()))


def test_no_module_imports_a_higher_layer():
    violations = upward_edges(import_graph())
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_the_package_has_no_import_cycle_counting_function_level_imports():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_two_folders_import_each_other():
    found = folder_cycles(import_graph(), FOLDER_PAIRS)
    assert not found, "import cycles between folders:\n" + "\n".join(found)


def test_no_module_reaches_another_folders_private_attribute_by_name():
    found = attribute_back_doors(package_sources())
    assert not found, "private attributes reached by name across folders (add an accessor in the owner):\n" + (
        "\n".join(found))


def test_nothing_in_the_package_imports_the_test_harness():
    found = harness_imports(import_graph())
    assert not found, "imports of xpar_zoo.testing:\n" + "\n".join(found)


def test_the_graph_sees_the_whole_package():
    graph = import_graph()
    assert {"xpar_zoo.parallelize", "xpar_zoo.parallel.mesh", "xpar_zoo.plans.qwen3_moe",
            "xpar_zoo.converters.to_dcp", "xpar_zoo.checkpoint.save"} <= set(graph)
    assert ("xpar_zoo.zoo.plan" in {d for d, _ in graph["xpar_zoo.plans.qwen3_moe"]}
            and "xpar_zoo.parallelize" in {d for d, _ in graph["xpar_zoo.loader"]})


# --- the checks themselves, on a synthetic package ----------------------------------------------------------------

_FAKE_LAYERS = {"pkg.low": 0, "pkg.high": 1, "pkg": 2, "pkg.testing": 2}


def _fake_graph(sources: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    modules = {m: m in ("pkg", "pkg.low", "pkg.high", "pkg.testing") for m in sources}
    return {m: imports_of(m, src, modules[m], modules) for m, src in sources.items()}


_CLEAN = {
    "pkg": "from .high import api\n",
    "pkg.low": "",
    "pkg.low.util": "import os\n",
    "pkg.low.core": "from . import util\nfrom .util import x\n",
    "pkg.high": "",
    "pkg.high.api": "from ..low.core import f\n\ndef g():\n    from pkg.low import util\n",
    "pkg.testing": "",
    "pkg.testing.parity": "from ..high import api\n",
}


def test_checks_pass_a_clean_synthetic_graph():
    graph = _fake_graph(_CLEAN)
    assert not upward_edges(graph, _FAKE_LAYERS) and not cycles(graph)
    assert not harness_imports(graph, "pkg.testing", ()) and not unplaced(graph, _FAKE_LAYERS)
    assert graph["pkg.high.api"] == [("pkg.low.core", 1), ("pkg.low.util", 4)]  # relative and function-level
    assert graph["pkg.low.core"] == [("pkg.low.util", 1), ("pkg.low.util", 2)]


def test_an_added_upward_import_inside_a_function_fails_by_name():
    graph = _fake_graph({**_CLEAN, "pkg.low.util": "import os\n\ndef helper():\n    from ..high.api import g\n"})
    assert upward_edges(graph, _FAKE_LAYERS) == ["pkg.low.util (layer 0) imports pkg.high.api (layer 1), line 4"]
    assert cycles(graph) == [["pkg.high.api", "pkg.low.util", "pkg.high.api"]]


def test_a_cycle_within_one_layer_fails():
    graph = _fake_graph({**_CLEAN, "pkg.low.util": "def helper():\n    import pkg.low.core\n"})
    assert not upward_edges(graph, _FAKE_LAYERS)
    assert cycles(graph) == [["pkg.low.core", "pkg.low.util", "pkg.low.core"]]


def test_importing_the_package_root_or_the_harness_from_inside_fails():
    graph = _fake_graph({**_CLEAN, "pkg.high.api": "from .. import api_name\nfrom ..testing import parity\n"})
    assert upward_edges(graph, _FAKE_LAYERS) == [
        "pkg.high.api (layer 1) imports pkg (layer 2), line 1",
        "pkg.high.api (layer 1) imports pkg.testing.parity (layer 2), line 2"]
    assert harness_imports(graph, "pkg.testing", ()) == ["pkg.high.api imports pkg.testing.parity, line 2"]


def test_a_module_without_a_layer_is_reported():
    assert unplaced(_fake_graph({**_CLEAN, "other": ""}), _FAKE_LAYERS) == ["other"]


def test_a_cycle_between_folders_fails_though_no_module_cycle_exists():
    graph = _fake_graph({**_CLEAN, "pkg.low.extra": "from ..high.api import g\n"})
    assert not cycles(graph)
    assert folder_cycles(graph) == [
        "pkg.high -> pkg.low -> pkg.high (pkg.high.api imports pkg.low.core, line 1; "
        "pkg.low.extra imports pkg.high.api, line 1)"]
    assert not folder_cycles(_fake_graph(_CLEAN))
    assert not folder_cycles(graph, [frozenset({"pkg.low", "pkg.high"})])


_OWNER = """STATE = "_pkg_state"


class State:
    def _refresh(self):
        pass


def attach(m, s):
    setattr(m, STATE, s)
    m._pkg_cache = {}


def state(m):
    return getattr(m, STATE, None)
"""


@pytest.mark.parametrize("reader", [
    "getattr(model, '_pkg_state', None)", "hasattr(model, '_pkg_cache')", "model.__dict__.get('_pkg_state')",
    "model.__dict__['_pkg_cache']", "'_pkg_state' in vars(model)", "NAME = '_pkg_state'\ngetattr(model, NAME)",
    "getattr(obj, '_refresh')"])
def test_reading_another_folders_private_attribute_by_name_fails(reader):
    found = attribute_back_doors({"pkg.low.owner": _OWNER, "pkg.high.api": reader + "\n"})
    assert len(found) == 1 and found[0].startswith("pkg.high.api reads _") and "(put there by pkg.low.owner)" in found[0]


def test_the_owners_accessor_its_own_folder_and_unknown_private_names_pass():
    assert attribute_uses(_OWNER) == ({"_refresh", "_pkg_state", "_pkg_cache"}, [("_pkg_state", 15)])
    sources = {"pkg.low.owner": _OWNER, "pkg.low.near": "getattr(m, '_pkg_state')\n",
               "pkg.high.api": "from ..low.owner import state\nstate(m)\ngetattr(m, '_torch_private')\n"}
    assert not attribute_back_doors(sources)

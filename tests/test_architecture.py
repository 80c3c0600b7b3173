"""The layering contract: each package imports only the mf packages it declares.

Parses every member's pyproject.toml and scans the imports of its src/ with
``ast``. Three rules hold forever:
- every imported ``mf*`` package is a declared dependency (or the package itself);
- another package is entered only through names in its ``__all__``;
- the declared graph has no cycle, and mf-fsdp never depends on mf-tp.

Inside mf-fsdp, its sub-packages form layers (``FSDP_LAYERS``) and a module
imports only from its own layer or lower ones, type-only imports included: the
engine never reaches up to the optimizer side or the checkpoints. The modules of
``mf_fsdp.fsdp2`` import one another one way (``FSDP2_ORDER``).

``mf.train``'s rooms (its sub-packages, and ``settings.py``) sit on floors
(``TRAIN_FLOORS``): a module imports its own room or the rooms of lower floors only,
never a room of its own floor or above, type-only and function-local imports included.
``mf.plan`` sits above them all: no other module of ``src/`` imports it.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted((ROOT / "packages").iterdir())
MF_MODULE = re.compile(r"^mf(_[a-z]+)?$")
FSDP_SOURCE = ROOT / "packages" / "mf-fsdp" / "src" / "mf_fsdp"
# mf_fsdp's layers, lowest first: the top-level module or sub-package -> its rank.
FSDP_LAYERS = {
    "config": 0,
    "distributed_index": 0,
    "buckets": 1,
    "engine": 2,
    "optim": 3,
    "checkpoint": 4,
    "fully_shard": 5,
    "fsdp2": 5,
    "planning": 5,
}
# mf_fsdp.fsdp2's modules (all at the front-end layer), in the order they may import one
# another: each only those before it, so the package has no import circle.
FSDP2_ORDER = (
    "torch_state",
    "handles",
    "mixed_precision",
    "placement",
    "engine_mesh",
    "storage_mesh",
    "meshes",
    "records",
    "module",
    "entry",
)
TRAIN_SOURCE = ROOT / "src" / "mf" / "train"
# mf.train's rooms, lowest floor first: the room (sub-package, or top-level module) -> its
# floor. Rooms on one floor do not import each other (src/mf/train/__init__.py says why).
TRAIN_FLOORS = {
    "settings": 0,
    "sources": 1,
    "data": 2,
    "reports": 2,
    "adapters": 2,
    "exports": 3,
    "run": 3,
    "rank": 4,
}


def _import_name(distribution: str) -> str:
    return distribution.replace("-", "_")


def _declared(pyproject: Path) -> set[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    names = {re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0] for dep in project["dependencies"]}
    return {_import_name(n) for n in names if MF_MODULE.match(_import_name(n))}


def _imports(source_root: Path) -> list[tuple[Path, int, str, list[str] | None]]:
    """(file, line, top-level mf module, imported names or None for `import x.y`)."""
    found = []
    for path in sorted(source_root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    if MF_MODULE.match(top):
                        found.append((path, node.lineno, alias.name, None))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                if MF_MODULE.match(top):
                    found.append((path, node.lineno, node.module, [a.name for a in node.names]))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {_import_name(p.name): _declared(p / "pyproject.toml") for p in PACKAGES}
    graph["mf"] = _declared(ROOT / "pyproject.toml")
    return graph


def test_all_five_members_exist() -> None:
    assert [p.name for p in PACKAGES] == ["mf-dtensor", "mf-fsdp", "mf-rng", "mf-tp", "mf-utils"]
    for package in PACKAGES:
        name = _import_name(package.name)
        assert (package / "src" / name / "__init__.py").is_file()
        assert (package / "README.md").is_file()


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_imports_are_declared_and_public(package: Path) -> None:
    own = _import_name(package.name)
    declared = _declared(package / "pyproject.toml")
    problems = []
    for path, line, module, names in _imports(package / "src"):
        top = module.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line}"
        if top == own:
            continue
        if top not in declared:
            problems.append(f"{where} imports {module} but {package.name} does not declare it")
            continue
        if module != top or names is None:
            problems.append(f"{where} reaches into {module}: import names from {top} only")
            continue
        public = set(importlib.import_module(top).__all__)
        hidden = sorted(set(names) - public)
        if hidden:
            problems.append(f"{where} imports {hidden} which are not in {top}.__all__")
    assert not problems, "\n".join(problems)


def test_graph_is_acyclic_and_fsdp_does_not_use_tp() -> None:
    graph = _graph()
    assert "mf_tp" not in graph["mf_fsdp"]
    assert graph["mf_utils"] == set()
    assert graph["mf"] == {"mf_utils", "mf_rng", "mf_tp", "mf_dtensor", "mf_fsdp"}
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in done:
            return
        assert node not in visiting, f"import cycle: {' -> '.join([*path, node])}"
        visiting.add(node)
        for child in graph.get(node, ()):
            visit(child, [*path, node])
        visiting.discard(node)
        done.add(node)

    for node in graph:
        visit(node, [])


def test_every_member_exports_only_what_exists() -> None:
    for package in PACKAGES:
        module = importlib.import_module(_import_name(package.name))
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{package.name}: __all__ names {missing} that do not exist"


def _fsdp_layer(path: Path) -> str:
    """The layer a file of mf_fsdp belongs to: its sub-package, or its own module name."""
    first = path.relative_to(FSDP_SOURCE).parts[0]
    return first.removesuffix(".py")


def test_mf_fsdp_layers_import_downward_only() -> None:
    problems = []
    for path in sorted(FSDP_SOURCE.rglob("*.py")):
        if path == FSDP_SOURCE / "__init__.py":
            continue  # the package's face imports every layer
        where = path.relative_to(ROOT)
        layer = _fsdp_layer(path)
        if layer not in FSDP_LAYERS:
            problems.append(f"{where} is in no layer: add {layer!r} to FSDP_LAYERS")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                problems.append(f"{where}:{node.lineno} uses a relative import")
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "mf_fsdp":
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mf_fsdp."):
                targets = [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
                targets = [n.split(".")[1] for n in names if n.startswith("mf_fsdp.")]
                targets += ["mf_fsdp's face" for n in names if n == "mf_fsdp"]
            else:
                continue
            for target in targets:
                if target not in FSDP_LAYERS:
                    problems.append(f"{where}:{node.lineno} imports {target} from mf_fsdp's top")
                elif FSDP_LAYERS[target] > FSDP_LAYERS[layer]:
                    problems.append(f"{where}:{node.lineno} ({layer}) reaches up to {target}")
    assert not problems, "\n".join(problems)


def test_fsdp2_modules_import_one_way() -> None:
    package = FSDP_SOURCE / "fsdp2"
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    assert modules == sorted(FSDP2_ORDER), "add each module of mf_fsdp/fsdp2/ to FSDP2_ORDER"
    problems = []
    for rank, name in enumerate(FSDP2_ORDER):
        path = package / f"{name}.py"
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "mf_fsdp":
                targets = ["the package's face" for a in node.names if a.name == "fsdp2"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "mf_fsdp.fsdp2"
            ):
                parts = node.module.split(".")
                targets = [parts[2] if len(parts) > 2 else "the package's face"]
            elif isinstance(node, ast.Import):
                names = [
                    a.name.split(".") for a in node.names if a.name.startswith("mf_fsdp.fsdp2")
                ]
                targets = [n[2] if len(n) > 2 else "the package's face" for n in names]
            else:
                continue
            for target in targets:
                if target not in FSDP2_ORDER[:rank]:
                    problems.append(f"{where}:{node.lineno} ({name}) imports {target}")
    assert not problems, "\n".join(problems)


def _train_targets(node: ast.AST) -> list[str]:
    """The rooms of mf.train an import statement reaches (its face named as such)."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "mf.train":
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        parts = (node.module or "").split(".")
        return [parts[2]] if parts[:2] == ["mf", "train"] and len(parts) > 2 else []
    if isinstance(node, ast.Import):
        parts = [alias.name.split(".") for alias in node.names]
        return [
            p[2] if len(p) > 2 else "mf.train's face" for p in parts if p[:2] == ["mf", "train"]
        ]
    return []


def test_mf_train_rooms_import_downward_only() -> None:
    rooms = {p.name.removesuffix(".py") for p in TRAIN_SOURCE.iterdir()}
    rooms -= {"__init__", "__pycache__", "py.typed"}
    assert rooms == set(TRAIN_FLOORS), "give each room of mf/train/ a floor in TRAIN_FLOORS"
    problems = []
    for path in sorted(TRAIN_SOURCE.rglob("*.py")):
        if path == TRAIN_SOURCE / "__init__.py":
            continue  # the face re-exports what the rooms hold
        where = path.relative_to(ROOT)
        room = path.relative_to(TRAIN_SOURCE).parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text(), str(path))
        if path.name == "__init__.py" and not ast.get_docstring(tree):
            problems.append(f"{where} opens with no docstring saying what the room owns")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                problems.append(f"{where}:{node.lineno} uses a relative import")
            for target in _train_targets(node):
                if target == room:
                    continue
                if target not in TRAIN_FLOORS:
                    problems.append(f"{where}:{node.lineno} imports {target} from mf.train's top")
                elif TRAIN_FLOORS[target] >= TRAIN_FLOORS[room]:
                    problems.append(
                        f"{where}:{node.lineno} ({room}, floor {TRAIN_FLOORS[room]}) imports "
                        f"{target} (floor {TRAIN_FLOORS[target]}): a room imports lower floors only"
                    )
    assert not problems, "\n".join(problems)


def _module_name(path: Path, source_root: Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_graph(source_root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports, type-only imports included.

    ``from package import name`` counts as importing ``package.name`` when that
    is a module of the tree, else ``package`` itself. A package's ``__init__``
    (its face, which re-exports every layer) is left out.
    """
    modules = {
        _module_name(path, source_root): path
        for path in source_root.rglob("*.py")
        if path.name != "__init__.py"
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    target = candidate if candidate in modules else node.module
                    if target in modules and target != name:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.name != name:
                        graph[name].add(alias.name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (the modules along it, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return [*path[path.index(child) :], child]
            if child not in state:
                found = visit(child)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize(
    "source_root",
    [*(p / "src" for p in PACKAGES), ROOT / "src"],
    ids=lambda p: p.parent.name if p.parent != ROOT else "mf",
)
def test_no_module_import_cycle_type_only_included(source_root: Path) -> None:
    cycle = _cycle(_module_graph(source_root))
    assert cycle is None, f"import cycle (type-only imports count): {' -> '.join(cycle or [])}"


def test_the_engine_is_built_apart_from_the_wrapper() -> None:
    """Construction (discover, options, assemble) and a step's parts never import the wrapper."""
    graph = _module_graph(FSDP_SOURCE.parent)
    wrapper = "mf_fsdp.engine.megatron_fsdp"
    parts = [
        "discover",
        "options",
        "assemble",
        "forms",
        "grad_sync",
        "hooks",
        "comm_window",
        "held_units",
        "unit",
        "module_contract",
        "backward_step",
        "load_hooks",
        "sharded_params",
    ]
    reach = {
        part: sorted(t for t in graph[f"mf_fsdp.engine.{part}"] if t == wrapper) for part in parts
    }
    assert not any(reach.values()), f"engine parts that import the wrapper: {reach}"


@pytest.mark.parametrize("source_root", [*(p / "src" for p in PACKAGES), ROOT / "src"])
def test_no_source_module_over_600_lines(source_root: Path) -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in source_root.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines (one concept per module): {long}"


def test_nothing_imports_the_planner() -> None:
    """mf-plan sits above mf-train (it builds its model and mesh); nothing else reaches it."""
    planner = ROOT / "src" / "mf" / "plan"
    problems = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        if planner in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "mf.plan" or n.startswith("mf.plan.") for n in names):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno} imports mf.plan")
    assert not problems, "\n".join(problems)

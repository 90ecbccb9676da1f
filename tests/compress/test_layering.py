"""Imports point one way, down the declared order of layers (``LAYERS``, the README's architecture section), with no
cycle among modules, for every module under compress/, evals/ and kernels/. Read from the source with ``ast``, so a
lazy import inside a function counts as much as one at the top, and so does ``importlib.import_module`` of a name the
source spells out (a string, an f-string's fixed package, or a module-level table of names).

The third-party rules on top of the order:

* ``kernels/`` and ``compress/engine/`` are the runtime a bare GPU box installs: they import the standard library,
  torch, triton, transformers, safetensors, numpy, each other, and the runtime modules ``compress.checkpoint``,
  ``compress.formats`` (with ``moe_experts``), the grids ``compress.grids.int_grid`` / ``fp4_grid`` / ``kv_quant``
  (the quantized layers and KV scheme a checkpoint loads into); never Hydra, MLflow, lm-eval, the pipeline or the gate.
* ``evals/`` may add the gate's own libraries (lm-eval, matplotlib, jsonschema, omegaconf for its policy schema,
  tqdm) and the runtime side of ``compress`` (engine, checkpoint, formats, grids, the model sources with their lazy
  weights and layer walk, and from ``compress.base``: errors, data, typed, memory, paths, locks, staging), but never
  ``compress.app`` (pipeline, tracking, run config), ``compress.commands`` nor MLflow: the app layer records the
  gate's verdict.

Each rule covers every file below its folder (``evals/gate/`` too), and the checkout's ``benchmarks/`` (not in the
wheel) is loaded by the ``bench`` command alone.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_THIRD_PARTY = {"torch", "triton", "transformers", "safetensors", "numpy"}
RUNTIME_COMPRESS = {
    "compress.engine",
    "compress.checkpoint",
    "compress.formats",
    "compress.grids.int_grid",
    "compress.grids.kv_quant",
    "compress.grids.fp4_grid",
    "compress.base.errors",
}
RUNTIME_ALLOWED = RUNTIME_THIRD_PARTY | RUNTIME_COMPRESS | {"compress.kernels"}
EVALS_ALLOWED = RUNTIME_ALLOWED | {
    "compress.evals",
    "compress.model.sources",
    "compress.model.lazy_weights",
    "compress.model.layer_walk",
    "compress.base.memory",
    "compress.base.paths",
    "compress.base.data",
    "compress.base.typed",
    "compress.base.locks",  # an OS file lock per baseline reference cache entry (evals/gate/windows.py)
    "compress.base.staging",  # gate.json and the reference cache written whole (write_file_atomically)
    "lm_eval",
    "matplotlib",
    "jsonschema",
    "omegaconf",
    "tqdm",
    "yaml",  # lm-eval's task files (compress.evals.lm_eval_tasks writes the shipped benchmark's)
}


# Lowest first, one folder (or more) per layer: the folder tree reads as this order. A module may import its own
# layer and those below; a new folder must be placed here (a module at compress/'s root is the app's face).
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"compress.base"}),
    ("kernels", {"compress.kernels"}),
    ("grids", {"compress.grids"}),
    ("formats", {"compress.formats"}),
    ("model", {"compress.model", "compress.checkpoint", "compress.engine"}),
    ("stages", {"compress.stages"}),
    ("compression", {"compress.compression"}),
    ("evals", {"compress.evals"}),
    ("app", {"compress.app", "compress.api", "compress"}),
    ("search", {"compress.search"}),
    ("cli", {"compress.commands", "compress.__main__"}),
]


def project_modules(root: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module in the three import packages."""
    found = {}
    for folder in ("compress", "evals", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            name = name if folder == "compress" else f"compress.{name}"  # installed inside the package (pyproject)
            found[name] = path
    return found


def layer_of(module: str) -> int:
    """The index of the most specific ``LAYERS`` entry that names ``module`` or a package above it."""
    best, depth = None, -1
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(f"{member}.")) and member.count(".") > depth:
                best, depth = index, member.count(".")
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def project_imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of other project modules (``from pkg import submodule`` counts as the submodule)."""
    modules = project_modules(root)

    def known(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for name, path in modules.items():
        targets = {
            known(f"{module}.{imported}") or known(module) if imported else known(module)
            for module, imported in import_statements(path)
        }
        graph[name] = targets - {None, name}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_every_module_imports_only_its_layer_and_those_below():
    assert upward_imports(project_imports(ROOT)) == []


def test_no_import_cycle_among_modules():
    assert import_cycles(project_imports(ROOT)) == []


def test_the_order_and_cycle_checks_catch_what_they_should(tmp_path):
    for folder in ("compress", "evals", "kernels"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    for package in ("base", "commands"):
        (tmp_path / "compress" / package).mkdir()
        (tmp_path / "compress" / package / "__init__.py").write_text("")
    (tmp_path / "compress" / "base" / "errors.py").write_text("def f():\n    from compress.commands import run")
    (tmp_path / "compress" / "commands" / "run.py").write_text("from compress.base import errors")
    graph = project_imports(tmp_path)
    assert upward_imports(graph) == ["compress.base.errors (base) imports compress.commands.run (cli)"]
    assert import_cycles(graph) == [["compress.base.errors", "compress.commands.run"]]


def test_compress_root_holds_only_the_package_face():
    """Every other module lives in the folder of its layer, so the tree reads as ``LAYERS``; a module added at the
    root would silently land in the app layer."""
    assert sorted(path.name for path in (ROOT / "compress").glob("*.py")) == ["__init__.py", "__main__.py", "api.py"]
    folders = {path.parent.name for path in (ROOT / "compress").glob("*/__init__.py")}
    declared = {member.split(".")[1] for _, members in LAYERS for member in members if member.count(".") == 1}
    assert folders <= declared, f"declare {sorted(folders - declared)} in LAYERS"


def test_no_two_modules_share_a_file_name():
    """A traceback names files, not packages: four ``fp4.py`` (grid, format, kernel, stage) read as one. Each module
    is named by its role (``grids/fp4_grid.py``, ``formats/fp4_linear.py``, ``kernels/fp4.py``,
    ``stages/fp4_weights.py``)."""
    seen: dict[str, list[str]] = {}
    for path in project_modules(ROOT).values():
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def import_statements(path: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every absolute import in ``path`` at any depth: ``import x`` gives ``("x", None)``,
    ``from x import y`` gives ``("x", "y")``, ``importlib.import_module("x")`` gives ``("x", None)``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            found += [(node.module, alias.name) for alias in node.names]
    found += [(module, None) for module in dynamic_imports(tree)[0]]
    return found


def dynamic_imports(tree: ast.Module) -> tuple[list[str], list[int]]:
    """``(modules, lines)``: the modules that ``importlib.import_module`` / ``__import__`` calls load, as far as the
    source spells them out (a string; an f-string's fixed package, ``f"compress.commands.{name}"`` →
    ``compress.commands``; a name or subscript of a module-level constant, a string or a table of them: every string
    it holds), and the lines of calls whose module cannot be read from the source."""
    tables = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    tables[target.id] = node.value
    modules, unread = [], []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and _imports_by_name(node.func)):
            continue
        names = _spelled_modules(node.args[0], tables)
        modules += names
        if not names:
            unread.append(node.lineno)
    return modules, unread


def _imports_by_name(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name) and func.value.id == "importlib"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _spelled_modules(argument: ast.expr, tables: dict[str, ast.expr]) -> list[str]:
    """The module names an ``import_module`` argument can take, read from the source; [] when it cannot be read."""
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return [argument.value]
    if isinstance(argument, ast.JoinedStr):  # the fixed text before the first {field}, up to its last dot
        head = argument.values[0] if argument.values else None
        prefix = head.value if isinstance(head, ast.Constant) and isinstance(head.value, str) else ""
        return [prefix.rsplit(".", 1)[0]] if "." in prefix else []
    root = argument
    while isinstance(root, ast.Subscript | ast.Attribute):
        root = root.value
    if not (isinstance(root, ast.Name) and root.id in tables):
        return []
    table = tables[root.id]
    values = table.values if isinstance(table, ast.Dict) else [table]
    values = [item for value in values for item in (value.elts if isinstance(value, ast.List | ast.Tuple) else [value])]
    return [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from x import y`` counts as ``x``)."""
    return {module for module, _ in import_statements(path)}


def allowed(module: str, rules: set[str]) -> bool:
    if module.split(".")[0] in sys.stdlib_module_names:
        return True
    return any(module == rule or module.startswith(f"{rule}.") for rule in rules)


def violations(folder: str, rules: set[str]) -> dict[str, list[str]]:
    """Each file below ``folder`` (subfolders too) and the imports it makes that ``rules`` do not allow."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        name = str(path.relative_to(ROOT))
        bad = sorted(module for module in imported_modules(path) if not allowed(module, rules))
        if bad:
            found[name] = bad
    return found


@pytest.mark.parametrize(
    ("folder", "rules"),
    [
        ("kernels", RUNTIME_ALLOWED),
        ("compress/engine", RUNTIME_ALLOWED),
        ("evals", EVALS_ALLOWED),
    ],
)
def test_imports_point_one_way(folder, rules):
    assert violations(folder, rules) == {}


def test_the_rules_catch_an_upward_import(tmp_path, monkeypatch):
    """The walker sees lazy imports inside functions, which is how the gate used to reach MLflow and the CLI layer."""
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "bad.py").write_text(
        "def f():\n    from compress.app.tracking import flatten\n    import mlflow"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("evals", EVALS_ALLOWED) == {"evals/bad.py": ["compress.app.tracking", "mlflow"]}


PLANTED = """

def _planted():
    import importlib

    from compress.commands.run import main

    return main, importlib.import_module("compress.app.tracking")
"""


def test_both_rules_catch_an_upward_import_planted_in_a_subfolder(tmp_path, monkeypatch):
    """A copy of ``evals/`` (its ``gate/`` subfolder too) passes both rules as it is; with a lazy import of the CLI
    and an ``importlib`` import of MLflow's app module planted in ``gate/windows.py``, both report that file."""
    shutil.copytree(ROOT / "evals", tmp_path / "evals", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("compress/commands/__init__.py", "compress/commands/run.py", "compress/app/tracking.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("evals", EVALS_ALLOWED) == {} and upward_imports(project_imports(tmp_path)) == []
    windows = tmp_path / "evals" / "gate" / "windows.py"
    windows.write_text(windows.read_text() + PLANTED)
    assert violations("evals", EVALS_ALLOWED) == {
        "evals/gate/windows.py": ["compress.app.tracking", "compress.commands.run"]
    }
    assert upward_imports(project_imports(tmp_path)) == [
        "compress.evals.gate.windows (evals) imports compress.app.tracking (app)",
        "compress.evals.gate.windows (evals) imports compress.commands.run (cli)",
    ]


def test_importlib_imports_are_read_from_the_source():
    """``bench`` loads the checkout's benchmarks through a table of names, ``__main__`` its command by an f-string:
    both count as imports; a call whose module the source does not spell out would hide one, so none may exist."""
    assert {("benchmarks.bench_kernels", None), ("benchmarks.kernel_peers", None)} <= set(
        import_statements(ROOT / "compress" / "commands" / "bench.py")
    )
    assert ("compress.commands", None) in import_statements(ROOT / "compress" / "__main__.py")
    unread = {
        str(path.relative_to(ROOT)): lines
        for folder in ("compress", "evals", "kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := dynamic_imports(ast.parse(path.read_text()))[1])
    }
    assert unread == {}


def test_only_the_bench_command_loads_the_checkouts_benchmarks():
    """``benchmarks/`` is not in the wheel: a package module that imports it breaks an installed compress."""
    users = {
        str(path.relative_to(ROOT))
        for folder in ("compress", "evals", "kernels")
        for path in (ROOT / folder).rglob("*.py")
        if any(module.split(".")[0] == "benchmarks" for module in imported_modules(path))
    }
    assert users == {"compress/commands/bench.py"}


PIPELINE_USERS = {"compress/commands/run.py"}  # the CLI; its tests drive it through `main`


def test_only_the_cli_and_its_run_tests_import_the_pipeline():
    """Everything else compresses through ``compress.oneshot`` or ``compress.compression.in_memory.compress_model``, so
    the run recipe can change without breaking tests and benchmarks."""
    users = {
        str(path.relative_to(ROOT))
        for folder in ("compress", "evals", "kernels", "benchmarks", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if "compress.app.pipeline" in imported_modules(path)
    }
    assert users <= PIPELINE_USERS


def test_the_run_recipe_stays_one_screenful():
    assert len((ROOT / "compress" / "app" / "pipeline.py").read_text().splitlines()) <= 200

"""Imports point one way: CLI/pipeline (compress.commands, compress.pipeline, compress.tracking, compress.config) →
gate (evals/) → runtime (compress.engine, compress.checkpoint, compress.models, ...) → kernels. Read from the source
with ``ast``, so a lazy import inside a function counts as much as one at the top.

The rules:

* ``kernels/`` and ``compress/engine/`` are the runtime a bare GPU box installs: they import the standard library,
  torch, triton, transformers, safetensors, numpy, each other, and the runtime modules ``compress.checkpoint``,
  ``compress.qlinear``, ``compress.quant``, ``compress.fp4`` and ``compress.kv_quant`` (the quantized layers and KV
  scheme a checkpoint loads into); never Hydra, MLflow, lm-eval, the pipeline or the gate.
* ``evals/`` may add the gate's own libraries (lm-eval, matplotlib, jsonschema, omegaconf for its policy schema,
  tqdm) and the runtime side of ``compress`` (engine, checkpoint, models, errors, data, qlinear, quant, and the
  layer-walk and memory helpers ``compress.models`` itself uses: calibration, memory), but never
  ``compress.pipeline``, ``compress.commands``, ``compress.tracking``, ``compress.config``, nor MLflow: the app layer
  records the gate's verdict.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_THIRD_PARTY = {"torch", "triton", "transformers", "safetensors", "numpy"}
RUNTIME_COMPRESS = {
    "compress.engine",
    "compress.checkpoint",
    "compress.qlinear",
    "compress.quant",
    "compress.kv_quant",
    "compress.moe",
    "compress.fp4",
    "compress.errors",
}
RUNTIME_ALLOWED = RUNTIME_THIRD_PARTY | RUNTIME_COMPRESS | {"kernels"}
EVALS_ALLOWED = RUNTIME_ALLOWED | {
    "evals",
    "compress.models",
    "compress.calibration",
    "compress.memory",
    "compress.data",
    "lm_eval",
    "matplotlib",
    "jsonschema",
    "omegaconf",
    "tqdm",
}


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at any depth (``from x import y`` counts as ``x``)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            modules.add(node.module)
    return modules


def allowed(module: str, rules: set[str]) -> bool:
    if module.split(".")[0] in sys.stdlib_module_names:
        return True
    return any(module == rule or module.startswith(f"{rule}.") for rule in rules)


def violations(folder: str, rules: set[str]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / folder).glob("*.py")):
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
    (tmp_path / "evals" / "bad.py").write_text("def f():\n    from compress.tracking import flatten\n    import mlflow")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("evals", EVALS_ALLOWED) == {"evals/bad.py": ["compress.tracking", "mlflow"]}


PIPELINE_USERS = {"compress/commands/run.py"}  # the CLI; its tests drive it through `main`


def test_only_the_cli_and_its_run_tests_import_the_pipeline():
    """Everything else compresses through ``compress.oneshot`` or ``compress.compression.compress_model``, so the
    run recipe can change without breaking tests and benchmarks."""
    users = {
        str(path.relative_to(ROOT))
        for folder in ("compress", "evals", "kernels", "benchmarks", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if "compress.pipeline" in imported_modules(path)
    }
    assert users <= PIPELINE_USERS


def test_the_run_recipe_stays_one_screenful():
    assert len((ROOT / "compress" / "pipeline.py").read_text().splitlines()) <= 200

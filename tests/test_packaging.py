"""The installed distribution claims no top-level import name but its own: kernels/ and evals/ install as
compress.kernels and compress.evals (pyproject's package-dir), so a package named ``kernels`` (Hugging Face's, which
transformers probes for) or ``evals`` installed beside it keeps its name. Built from this checkout, installed into a
throwaway folder next to such a package, imported from a process that cannot see the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of what the wheel takes, so the build leaves nothing in the checkout."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    shutil.copy(ROOT / "pyproject.toml", source)
    for folder in ("compress", "kernels", "evals"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    build.append(str(source))
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    [built] = out.glob("compress-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"compress"}
    assert {"compress/kernels/ops.py", "compress/evals/gate/runner.py", "compress/engine/llm.py"} <= set(names)


def test_installed_beside_another_kernels_package_both_import(wheel, tmp_path):
    site, other = tmp_path / "site", tmp_path / "other"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    for name in ("kernels", "evals"):
        (other / name).mkdir(parents=True)
        (other / name / "__init__.py").write_text("OWNER = 'someone else'\n")
    probe = (
        "import kernels, evals, compress.kernels.packing as packing, compress.evals.gate.stats as stats\n"
        "assert kernels.OWNER == evals.OWNER == 'someone else'\n"
        "print(packing.__file__, stats.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(other)])}
    shown = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr
    assert all(path.startswith(str(site / "compress")) for path in shown.stdout.split())

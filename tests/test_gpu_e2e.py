"""benchmarks/gpu_e2e.py end to end on a tiny shape on CPU, as the lent GPU box would run it: the packages its image
lacks and benchmarks/fetch_e2e_wheels.sh does not carry (MLflow, lm-eval, datasets, compressed-tensors, gguf, ...)
cannot be imported, so a run that still needs one fails here, not in the GPU minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# what the GPU image lacks (/work/shared/README.md, "The lent GPU machines") less what fetch_e2e_wheels.sh carries
HIDDEN = ("mlflow", "lm_eval", "datasets", "evaluate", "compressed_tensors", "gguf", "submitit", "dill", "multiprocess")
SITECUSTOMIZE = f"""
import importlib.machinery, sys
HIDDEN = {HIDDEN!r}
class _Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [_Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


@pytest.mark.slow  # four processes (build, probe, run, its gate): tens of seconds on 2 cores
def test_the_headline_run_is_timed_per_phase_without_the_packages_the_gpu_image_lacks(tmp_path):
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "hide"), OMP_NUM_THREADS="1")
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.gpu_e2e", "--tiny", "--device", "cpu", "--out", str(out)]
    command += ["--recipes", "awq_int4", "--samples", "4", "--seq-len", "64", "--eval-windows", "2"]
    command += ["gate.needle.enabled=false", "gate.long_context.enabled=false", "gate.json.enabled=false"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    result = json.loads((out / "gpu-e2e-cpu.json").read_text())  # the device's name in the file name
    assert (out / "gpu-e2e-cpu.md").is_file()
    assert result["lm_eval_layer"] is False  # hidden here: the gate's accuracy layer is switched off, not an error
    assert "gate.lm_eval.enabled=false" in result["overrides"] and "tracking.enabled=false" in result["overrides"]
    row = result["recipes"]["awq_int4"]
    assert row["exit_code"] == 0 and row["generated_tokens"] == row["calibration_tokens"] == 4 * 64
    assert set(row["groups"]) == {"load", "sample", "compress", "save", "evaluate", "gate"}
    for name, group in row["groups"].items():
        assert group["seconds"] > 0, name
        assert group["peak_host_mb"] is None or 0 < group["peak_host_mb"] <= row["peak_rss_mb"] * 1.05, name
        assert group["peak_gpu_torch_mb"] is None  # CUDA never initialised on a CPU run
    sampled = [g["peak_host_mb"] for g in row["groups"].values() if g["peak_host_mb"] is not None]
    assert sampled and max(sampled) > 100  # the sampler saw the run process itself, not an empty shell
    assert row["verdict"] in {"pass", "block", "inconclusive"}

"""Data-parallel calibration under ``torchrun --nproc-per-node 2`` (gloo on CPU) against one process.

Round-to-nearest and FP8 (static input scales, SmoothQuant, KV scales) reduce maxima, which is exact, and each rank
gets whole batches of the single-process batching, so their checkpoints are bit-identical. GPTQ and AWQ reduce
sums (Hessians, activation moments): the all-reduce adds the ranks' partial sums in another order than one process
does, so the statistics differ in the last float bits, and GPTQ's clipping choices and codes sitting on a rounding
boundary flip and cascade through its error compensation. Perturbing a single process's Hessians by 1e-7 relative
noise changes as many codes (measured on this model: 1-20% of packed words per linear either way), so the tolerance
below is about the model's outputs: the two checkpoints' logits differ by less than a third of what quantization
itself changes (measured 0.21 GPTQ, 0.14 AWQ), and both are equally far from the float model (within 10%).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compress.checkpoint import load_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from distributed_worker import EXACT, RECIPES, calibration_samples, compress_all  # noqa: E402

ROOT = Path(__file__).parents[2]


def torchrun(args: list[str], cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 <args>`` (a free port of its own) with this checkout importable,
    ``env`` added to this process's environment."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1",
           **(env or {})}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """``(two ranks, one process)`` output folders of ``distributed_worker.compress_all``."""
    parallel, single = tmp_path_factory.mktemp("two-ranks"), tmp_path_factory.mktemp("one-process")
    done = torchrun([str(Path(__file__).parent / "distributed_worker.py"), str(parallel)], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    compress_all(single)
    return parallel, single


def test_every_rank_ends_with_the_same_weights(checkpoints):
    parallel, _ = checkpoints
    assert sorted(p.name for p in parallel.glob("rank*")) == ["rank0-of-2", "rank1-of-2"]
    for name in RECIPES:
        first, second = (torch.load(parallel / f"rank{r}-of-2" / f"{name}.pt", weights_only=True) for r in (0, 1))
        assert all(torch.equal(first[key], second[key]) for key in first), name


@pytest.mark.parametrize("name", EXACT)
def test_maxima_recipes_are_bit_identical_to_one_process(checkpoints, name):
    parallel, single = checkpoints
    ours, reference = (load_file(folder / name / "model.safetensors") for folder in (parallel, single))
    assert ours.keys() == reference.keys()
    assert [key for key in reference if not torch.equal(ours[key], reference[key])] == []


@pytest.mark.parametrize("name", sorted(set(RECIPES) - set(EXACT)))
def test_sum_recipes_match_one_process_within_rounding(checkpoints, name):
    from helpers import build_tiny_llama

    parallel, single = checkpoints
    ids = calibration_samples()
    with torch.no_grad():
        dense = build_tiny_llama()(ids).logits
        ours, reference = (load_checkpoint(folder / name)[0](ids).logits for folder in (parallel, single))

    def distance(a, b):
        return float((a - b).norm() / b.norm())

    assert distance(ours, reference) < distance(reference, dense) / 3
    assert distance(ours, dense) == pytest.approx(distance(reference, dense), rel=0.1)


def test_run_under_torchrun_records_once_from_rank_zero(tiny_model_dir, tmp_path):
    """``torchrun -m compress run``: both ranks calibrate, rank 0 alone writes the run folder and its report."""
    runs = tmp_path / "runs"
    args = ["-m", "compress", "run", "recipe=gptq_int4", f"model={tiny_model_dir}", "data.num_samples=4"]
    args += ["data.seq_len=64", "calibration_batch_size=2", "stages.0.group_size=32", "eval.perplexity=false"]
    args += ["eval.reference=null", "gate=none", "tracking.enabled=false", "device=cpu", f"output.dir={runs}"]
    done = torchrun(args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = runs.iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["data"]["ranks"] == 2 and report["checkpoint"]["quantized_linears"] == 14
    assert done.stdout.count("run folder: ") == 1

"""The kernel benchmark script: refuses without a GPU, and its smoke=true mode runs end to end on CPU."""

import json

import pytest
import torch

from compress.__main__ import main as cli
from compress.commands.bench import load_target

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

bench = load_target("kernels")

# vs the float64 product with the quantized weight: bf16 output rounding, plus activation quantization for W8A8
# (e4m3 keeps 3 mantissa bits: a few percent per token).
TOLERANCE = {"w4a16": 1e-2, "w4a16-disk": 1e-2, "int8": 2e-2, "int8-gemm": 2e-2, "fp8": 6e-2, "fp8-gemm": 6e-2}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_clearly_without_a_gpu(capsys, tmp_path):
    assert bench.main([f"out={tmp_path}"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_smoke_run_through_the_cli_writes_json_and_markdown(tmp_path):
    assert cli(["bench", "kernels", "smoke=true", "rows=1,17", f"out={tmp_path}"]) == 0
    (json_path,) = tmp_path.glob("kernels-*-smoke.json")
    report = json.loads(json_path.read_text())
    gemm_rows = [row for row in report["rows"] if row["kernel"] in bench.KERNELS and row["kernel"] != "act-quant"]
    assert len(gemm_rows) == (len(bench.KERNELS) - 1) * 2
    assert {row["kernel"] for row in report["rows"]} == set(bench.KERNELS + bench.ATTENTION)
    for row in gemm_rows:
        assert row["time_us"] > 0 and row["speedup"] > 0 and row["copy_bandwidth_pct"] > 0
        assert row["relative_error"] < TOLERANCE[row["kernel"]], row
    assert report["goals"] == [] and report["meta"]["smoke"] is True
    markdown = json_path.with_suffix(".md").read_text()
    assert "Smoke run" in markdown and "| w4a16 | 96 | 256 | 17 |" in markdown


def test_smoke_run_through_the_triton_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "triton")
    # fp16 activations: the interpreter's bf16 tl.dot is wrong
    argv = ["smoke=true", "rows=2", "kernels=w4a16,int8,fp8-gemm", "dtype=fp16", f"out={tmp_path}"]
    assert bench.main(argv) == 0
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert [row["kernel"] for row in report["rows"]] == ["w4a16", "int8", "fp8-gemm"]
    assert all(row["relative_error"] < TOLERANCE[row["kernel"]] for row in report["rows"])


def test_goals_are_judged_on_the_worst_row():
    rows = [
        bench.Row("w4a16", 4096, 4096, 1, 10.0, 1.0, 3000.0, 90.0, 40.0, 4.0, 1e-3),
        bench.Row("w4a16", 8192, 28672, 1, 10.0, 1.0, 2000.0, 60.0, 30.0, 3.0, 1e-3),
    ]
    verdicts = {goal["goal"]: goal for goal in bench.judge_goals(rows)}
    assert verdicts["W4A16 M=1 speedup >= 3.3x"]["met"] is False
    assert verdicts["W4A16 M=1 speedup >= 3.3x"]["worst"] == 3.0
    assert verdicts["W4A16 M=1 >= 75% of copy bandwidth"]["met"] is False
    assert verdicts["W4A16 M=16 speedup >= 3x"]["met"] is None  # no row measured


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("kernels=w4a16,marlin", "unknown kernels ['marlin']"),
        ("shapes=4096by4096", "shapes='4096by4096': give N x K pairs like 4096x4096,4096x14336"),
        ("--smoke", "argument '--smoke' is not key=value"),
        ("smoek=true", "unknown key 'smoek' (did you mean 'smoke'?)"),
    ],
)
def test_bad_arguments_are_one_line(argument, message, capsys):
    assert bench.main(["smoke=true", argument]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and message in errors[0]


def test_bench_command_without_the_benchmarks_folder_says_so(tmp_path, monkeypatch, capsys):
    import compress.commands.bench as command

    monkeypatch.setattr(command, "CHECKOUT_ROOT", tmp_path)
    assert cli(["bench", "kernels", "smoke=true"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "needs the source checkout's benchmarks/ folder" in error

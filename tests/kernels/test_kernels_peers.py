"""The peer benchmark: refuses without a GPU, and its smoke=true run wires every peer that has a CPU variant to the
same weight (checked against the float64 product), skipping gemlite with a reason."""

import json

import pytest
import torch

from compress.__main__ import main as cli
from compress.commands.bench import load_target

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

peers = load_target("peers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_clearly_without_a_gpu(capsys, tmp_path):
    assert peers.main([f"out={tmp_path}"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "needs a CUDA GPU" in error and "smoke=true" in error
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variants of the peers")
def test_smoke_run_times_every_peer_on_the_same_weight(tmp_path):
    assert cli(["bench", "peers", "smoke=true", f"out={tmp_path}"]) == 0
    report = json.loads(next(tmp_path.glob("kernel-peers-*-smoke.json")).read_text())
    rows = {(r["format"], r["impl"], r["m"]): r for r in report["rows"]}
    timed = {
        "w4a16": ["ours", "tinygemm"],
        "int8": ["ours", "ours-gemm", "torch._int_mm", "torch._int_mm-gemm"],
        "fp8": ["ours", "ours-gemm", "torch._scaled_mm", "torch._scaled_mm-gemm"],
    }
    for fmt, names in timed.items():
        for m in peers.SMOKE_ROWS:
            assert rows[(fmt, peers.BASELINE, m)]["vs_bf16"] == 1.0
            for name in names:
                row = rows[(fmt, name, m)]
                assert row["time_us"] > 0 and row["note"] == "", row
                assert row["relative_error"] < peers.WRONG_ABOVE[fmt], row
            assert rows[(fmt, "gemlite", m)]["time_us"] is None
            assert rows[(fmt, "gemlite", m)]["note"] == "gemlite needs CUDA"
    for m in peers.SMOKE_ROWS:  # FP8-block: ours on the CPU reference; torch's block-wise scaling is CUDA 12.9+ only
        for name in ("ours", "ours-gemm"):
            row = rows[("fp8_block", name, m)]
            assert row["time_us"] > 0 and row["relative_error"] < peers.WRONG_ABOVE["fp8_block"], row
        for name in ("torch._scaled_mm", "torch._scaled_mm-gemm"):
            row = rows[("fp8_block", name, m)]
            assert row["time_us"] is not None or row["note"], row  # timed, or its cell says why not
        assert ("fp8_block", "gemlite", m) not in rows
    best = {(b["format"], b["m"]): b for b in report["best_peer"]}
    assert best[("w4a16", 1)]["best_peer"] == "tinygemm"
    markdown = next(tmp_path.glob("kernel-peers-*-smoke.md")).read_text()
    assert "## w4a16" in markdown and "| 64 | 256 | 17 |" in markdown and "gemlite: gemlite needs CUDA" in markdown


def _row(impl, time_us, note=""):
    return peers.Row("int8", impl, 4096, 4096, 16, time_us, None, None, note)


def test_best_peer_ignores_ours_the_baseline_missing_and_wrong_peers():
    rows = [
        _row(peers.BASELINE, 1.0),
        _row("ours", 10.0),
        _row("ours-gemm", 5.0),
        _row("torch._int_mm", 20.0),
        _row("torch._int_mm-gemm", 2.0, "WRONG: error 5.0e-01"),
        _row("gemlite", None, "gemlite needs CUDA"),
    ]
    (entry,) = peers.best_peer_ratios(rows).values()
    assert entry["best_peer"] == "torch._int_mm" and entry["best_peer_us"] == 20.0
    assert entry["ours_vs_best_peer"] == {"ours": 2.0, "ours-gemm": 4.0}


def test_bad_formats_are_rejected(capsys):
    assert peers.main(["smoke=true", "formats=w4a16,nf4"]) == 2
    assert "unknown formats ['nf4']" in capsys.readouterr().err

"""Compress the tiny Llama with each recipe of ``RECIPES`` through ``compress.oneshot`` into ``<out>/<recipe>``.

``test_distributed.py`` runs this under ``torchrun --nproc-per-node 2`` (gloo) and in its own process, and compares
the checkpoints. The samples make 4 batches of 4, so each of 2 ranks gets 2 whole batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

RECIPES = {
    "rtn": [{"type": "rtn", "bits": 4, "group_size": 32}],
    "fp8_static": [{"type": "fp8", "activations": "static"}],
    "smoothquant_fp8_kv": [
        {"type": "smoothquant", "alpha": 0.5},
        {"type": "fp8", "activations": "static"},
        {"type": "kv_cache", "dtype": "fp8"},
    ],
    "gptq": [{"type": "gptq", "bits": 4, "group_size": 32}],
    "awq": [{"type": "awq", "bits": 4, "group_size": 32, "grid": 4, "clip_grid": 4}],
}
EXACT = ("rtn", "fp8_static", "smoothquant_fp8_kv")  # maxima reduce exactly; sums (GPTQ, AWQ) only up to rounding


def calibration_samples() -> torch.Tensor:
    return torch.randint(0, 320, (16, 32), generator=torch.Generator().manual_seed(0))


def compress_all(out: Path) -> None:
    """Each recipe's checkpoint in ``out/<recipe>``; each rank's compressed weights in ``out/rank<r>/<recipe>.pt``,
    so that the test can check every rank ended with the same model."""
    from helpers import build_tiny_llama

    from compress import oneshot
    from compress.base import distributed

    for name, stages in RECIPES.items():
        model = build_tiny_llama()
        oneshot(model, stages, calibration_samples(), out / name, ["calibration_batch_size=4"], device="cpu")
        mine = out / f"rank{distributed.rank()}-of-{distributed.world()}"
        mine.mkdir(exist_ok=True)
        torch.save(model.state_dict(), mine / f"{name}.pt")


if __name__ == "__main__":
    compress_all(Path(sys.argv[1]))

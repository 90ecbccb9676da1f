"""One compress compression of a model on given calibration token ids (the same file llm-compressor reads),
driven by ``benchmarks/peer_comparison.py``: load, calibrate, quantize, save; no evaluation, as on the peer side."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from compress.checkpoint import save_checkpoint
from compress.models import load
from compress.pipeline import apply_stages
from compress.stages import build_chain

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True, help="a recipes/<name>.yaml whose stages to run")
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    stage_args = yaml.safe_load((RECIPES / f"{args.recipe}.yaml").read_text())["stages"]
    stages = build_chain(stage_args)
    samples = torch.load(args.samples)
    model, tokenizer = load(args.model, lazy=False)
    for stage in stages:
        stage.prepare(model)
    apply_stages(model, stages, samples, torch.device("cpu"), args.batch_size)
    for stage in stages:
        stage.finalize(model)
    kv_cache_scheme = next((s.kv_cache_scheme for s in stages if hasattr(s, "kv_cache_scheme")), None)
    save_checkpoint(model, tokenizer, Path(args.output), kv_cache_scheme=kv_cache_scheme)


if __name__ == "__main__":
    main()

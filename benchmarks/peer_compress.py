"""One compress compression of a model on given calibration token ids (the same file llm-compressor reads),
driven by ``benchmarks/peer_comparison.py``: load, calibrate, quantize, save; no evaluation, as on the peer side."""

from __future__ import annotations

import argparse

import torch

from compress import oneshot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True, help="a recipes/<name>.yaml whose stages to run")
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    overrides = [f"calibration_batch_size={args.batch_size}"]
    samples = torch.load(args.samples, weights_only=True)
    oneshot(args.model, args.recipe, data=samples, output_dir=args.output, overrides=overrides, device="cpu")


if __name__ == "__main__":
    main()

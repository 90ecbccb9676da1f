"""One decoder layer of the default model, quantized every way: output error on all calibration tokens and time.

    python -m benchmarks.signround_layer                              # layer 0, the default grid below
    python -m benchmarks.signround_layer --layer 5 --runs "rtn" "signround init=gptq iterations=40 lr=0.005"

Each run quantizes a fresh copy of the layer on the layer's calibration inputs (64 x 512 tokens of pydoc, the
recipes' calibration) and scores ‖layer'(x) − layer(x)‖² summed over every one of those tokens, relative to
the first run's. That is the quantity the stages minimise, measured whole instead of on minibatches: a cheap
way to choose a schedule before a 30-layer run. A run may name its own calibration (``samples=128 seq_len=64``, a
CPU preset's): it then trains on that draw of the same text and is still scored on the 64 x 512 tokens.
Writes ``benchmarks/results/signround-layer.{json,md}`` (``--name`` for another stem).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = [
    "rtn",
    "gptq",
    "signround iterations=200 batch_size=2 samples=128 seq_len=512",  # autoround_int4's CPU preset
    "signround init=gptq iterations=40 batch_size=4 lr=0.005 tune_clip=false",  # the recipe before AutoRound
]
CALIBRATION = (64, 512)  # the recipes' default calibration: what every run is scored on


def parse(run: str) -> dict:
    kind, *pairs = run.split()
    args = {"type": kind, "bits": 4, "group_size": 64}
    for pair in pairs:
        key, value = pair.split("=", 1)
        args[key] = {"true": True, "false": False}.get(value, value)
        if isinstance(args[key], str):
            try:
                args[key] = float(value) if "." in value else int(value)
            except ValueError:
                pass
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--runs", nargs="+", default=RUNS)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="signround-layer", help="results file stem")
    args = parser.parse_args()
    from compress.base.data import DataSpec, calibration_samples, load_corpus, tokenize
    from compress.model.layer_walk import capture_first_layer_inputs, decoder_layers, run_layer
    from compress.model.sources import ModelSpec, load
    from compress.stages import build_chain
    from compress.stages.base import LayerContext

    model, tokenizer = load(ModelSpec(lazy=False))
    tokens = tokenize(tokenizer, load_corpus(DataSpec()).calibration_text)
    cpu = torch.device("cpu")
    layers = decoder_layers(model)

    def layer_inputs(samples: int, seq_len: int):
        inputs = capture_first_layer_inputs(model, calibration_samples(tokens, samples, seq_len, 0), 8, cpu)
        for index in range(args.layer):  # the full-precision stream up to the chosen layer
            inputs = run_layer(layers[index], inputs, f"model.layers.{index}")
        return inputs

    calibrations = {CALIBRATION: layer_inputs(*CALIBRATION)}
    inputs = calibrations[CALIBRATION]
    original = layers[args.layer]
    reference = run_layer(original, inputs, "reference").hidden
    rows = {}
    for run in args.runs:
        config = parse(run)
        calibration = (config.pop("samples", CALIBRATION[0]), config.pop("seq_len", CALIBRATION[1]))
        if calibration not in calibrations:
            calibrations[calibration] = layer_inputs(*calibration)
        [stage] = build_chain([config])
        stage.prepare(model)
        layer = copy.deepcopy(original)
        ctx = LayerContext(
            args.layer, f"model.layers.{args.layer}", layer, model.config, calibrations[calibration], cpu
        )
        start = time.perf_counter()
        stage.process_layer(ctx)
        seconds = time.perf_counter() - start
        out = run_layer(layer, inputs, run).hidden
        error = sum(float((o - r).pow(2).sum()) for o, r in zip(out, reference, strict=True))
        rows[run] = {"error": error, "seconds": seconds, "calibration": list(calibration)}
        print(f"{run}: {rows[run]}", flush=True)
        write(args, rows)  # after every run: a long schedule keeps what it measured if it is stopped
    print((args.results / f"{args.name}.md").read_text())


def write(args: argparse.Namespace, rows: dict[str, dict]) -> None:
    base = rows[args.runs[0]]
    lines = [
        f"# One layer quantized every way (layer {args.layer}; int4 g64 symmetric unless a run names its format)",
        "",
        "Output error ‖layer′(x) − layer(x)‖² over all 64 x 512 calibration tokens (pydoc), relative to the first "
        "row; the layer's inputs come from the full-precision model. A run naming `samples=` / `seq_len=` trained on "
        f"that draw of the same text instead. {platform.machine()} {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        f"Command: `python -m benchmarks.signround_layer {' '.join(shlex.quote(a) for a in sys.argv[1:])}`",
        "",
        "| run | output error | vs first | seconds |",
        "|---|---|---|---|",
        *(
            f"| `{run}` | {row['error']:.4g} | {row['error'] / base['error']:.3f}x | {row['seconds']:.1f} |"
            for run, row in rows.items()
        ),
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps({"layer": args.layer, "rows": rows}, indent=2))
    (args.results / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

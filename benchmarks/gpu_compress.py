"""GPTQ and AWQ W4A16 g128 on a random Llama-3-8B-shaped model on a GPU: time, peak GPU memory, peak host RSS.

    python -m benchmarks.gpu_compress                     # on a GPU box: 8B shape, 128 x 2048 calibration tokens
    python -m benchmarks.gpu_compress --layers 8          # fewer decoder layers when device time is short
    python -m benchmarks.gpu_compress --tiny --device cpu # a tiny shape on CPU: checks the script end to end

The model is written as bf16 safetensors (built on the device, never in fp32), then loaded the way `compress run`
loads it (lazily, layer by layer) and compressed by the pipeline's own walk (``apply_stages``): each decoder layer is
read from disk, moved to the device, widened to fp32 there, calibrated and quantized, and sent back. Calibration
tokens are random ids (the weights are random too: this measures cost, not quality). One JSON (and a Markdown table)
per device lands in ``benchmarks/results/gpu-compress-<device>.{json,md}`` (``--tiny``: only with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peak_rss import REPO, save_random_llama
from compress.calibration import decoder_layers
from compress.models import load
from compress.pipeline import apply_stages
from compress.stages import build_chain

LLAMA3_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
)
TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
ALGORITHMS = ("gptq", "awq")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def compress_once(
    model_dir: Path, algorithm: str, samples: torch.Tensor, device: torch.device, batch_size: int
) -> dict:
    """One lazily loaded model through one W4A16 g128 stage; the model is dropped afterwards."""
    model, _ = load(model_dir)
    [stage] = build_chain([{"type": algorithm, "bits": 4, "group_size": 128, "symmetric": True}])
    stage.prepare(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    apply_stages(model, [stage], samples, device, batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    summary = {k: v for k, v in stage.finalize(model).items() if k != "per_layer"}
    layers = len(decoder_layers(model))
    del model
    return {
        "seconds": seconds,
        "seconds_per_layer": seconds / layers,
        "peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "summary": summary,
    }


def markdown(result: dict) -> str:
    lines = [
        f"# GPTQ / AWQ W4A16 g128 on a random {result['shape_name']} ({result['device_name']})",
        "",
        f"{result['params'] / 1e9:.2f} B parameters ({result['shape']['num_hidden_layers']} layers), bf16 safetensors, "
        f"loaded lazily; {result['samples']} x {result['seq_len']} calibration tokens, batch {result['batch_size']}.",
        "",
        "| algorithm | seconds | s / layer | peak GPU MB |",
        "|---|---|---|---|",
    ]
    for name, row in result["algorithms"].items():
        peak = "n/a" if row["peak_gpu_mb"] is None else f"{row['peak_gpu_mb']:.0f}"
        lines.append(f"| {name} | {row['seconds']:.1f} | {row['seconds_per_layer']:.2f} | {peak} |")
    lines += ["", f"Peak host RSS of the whole script: {result['peak_rss_mb']:.0f} MB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shape and 4 x 64 tokens (runs on CPU in seconds)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--samples", type=int, help="calibration sequences (default 128; --tiny 4)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; --tiny 64)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; none for --tiny)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run on a GPU box, or pass --tiny --device cpu to check the script")
    shape = dict(TINY if args.tiny else LLAMA3_8B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    samples_count = args.samples or (4 if args.tiny else 128)
    seq_len = args.seq_len or (64 if args.tiny else 2048)
    generator = torch.Generator().manual_seed(0)
    samples = torch.randint(0, shape["vocab_size"], (samples_count, seq_len), generator=generator)
    algorithms = {}
    with tempfile.TemporaryDirectory(prefix="gpu-compress-") as tmp:
        model_dir = Path(tmp) / "model"
        params = save_random_llama(model_dir, shape, torch.bfloat16, device=args.device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for algorithm in args.algorithms.split(","):
            row = compress_once(model_dir, algorithm, samples, device, args.batch_size)
            algorithms[algorithm] = row
            print(f"{algorithm}: {row['seconds']:.1f} s, peak GPU {row['peak_gpu_mb']} MB", flush=True)
    name = device_name(device)
    result = {
        "shape_name": "tiny llama" if args.tiny else "Llama-3-8B shape",
        "shape": shape,
        "params": params,
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "samples": samples_count,
        "seq_len": seq_len,
        "batch_size": args.batch_size,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "algorithms": algorithms,
    }
    print(json.dumps(result, indent=2))
    out = args.out or (None if args.tiny else REPO / "benchmarks" / "results")
    if out is not None:
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"gpu-compress-{slug}.json").write_text(json.dumps(result, indent=2))
        (out / f"gpu-compress-{slug}.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

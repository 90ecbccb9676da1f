"""Which sensitivity proxy ranks linears the way the loss does? On the default model, for every allocation unit
(q/k/v, o, gate/up, down per layer) quantized alone to one scheme by round-to-nearest, the measured increase of the
mean next-token loss on held-out calibration windows against the two proxies ``compress search`` can use: the plain
output error tr(ΔW H ΔWᵀ) and the Fisher-weighted ½ Σ_o f_o ΔW_o H ΔW_oᵀ (``search.weighting``).

    python benchmarks/sensitivity_proxy.py                      # int3_g64, 8 samples × 256 tokens, every 2nd layer
    python benchmarks/sensitivity_proxy.py --scheme int4_g64

Prints the Spearman rank correlation of each proxy with the measured loss increase, and the loss increase of the
cheapest third of the units by each proxy (what an allocator sends to the smaller scheme). Results:
``benchmarks/results/sensitivity-proxy-<scheme>.md``.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.base.data import DataSpec, calibration_samples, load_corpus, tokenize  # noqa: E402
from compress.compression.in_memory import compress_model  # noqa: E402
from compress.evals.perplexity import perplexity  # noqa: E402
from compress.model.lazy_weights import materialize_all  # noqa: E402
from compress.model.sources import ModelSpec, load  # noqa: E402
from compress.search import SensitivityConfig, SensitivityStage, output_fisher, quantization_delta  # noqa: E402
from compress.stages.mixed import candidate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scheme", default="int3_g64")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--layer-stride", type=int, default=2, help="measure the units of every Nth layer")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = DataSpec(num_samples=args.samples, seq_len=args.seq_len)
    model, tokenizer = load(ModelSpec(args.model))
    materialize_all(model)
    ids = tokenize(tokenizer, load_corpus(spec).calibration_text)
    samples = calibration_samples(ids, 2 * args.samples, args.seq_len, seed=0)
    calibration, held_out = samples[: args.samples], samples[args.samples :]  # proxies and measurement: disjoint
    start = time.perf_counter()
    fisher = output_fisher(model, calibration, torch.device("cpu"), 4)
    proxies = {}
    for label, weights in (("plain", None), ("fisher", fisher)):
        stage = SensitivityStage(SensitivityConfig([args.scheme, "bf16"]), weights)
        compress_model(copy.deepcopy(model), [stage], calibration)
        proxies[label] = stage.units

    def mean_loss() -> float:  # the perplexity protocol's mean NLL on exactly these windows
        return perplexity(model, held_out.flatten(), args.seq_len, progress=False).mean_nll

    base = mean_loss()
    chosen = candidate(args.scheme)
    modules = dict(model.named_modules())
    picked = [
        index
        for index, unit in enumerate(proxies["plain"])
        if int(unit.names[0].split(".layers.")[1].split(".")[0]) % args.layer_stride == 0
    ]
    proxies = {label: [units[index] for index in picked] for label, units in proxies.items()}
    measured = []
    for number, unit in enumerate(proxies["plain"]):
        originals = [modules[name].weight.detach().clone() for name in unit.names]
        for name in unit.names:
            modules[name].weight.data += quantization_delta(modules[name], chosen)
        measured.append(mean_loss() - base)
        for name, original in zip(unit.names, originals, strict=True):
            modules[name].weight.data.copy_(original)
        print(f"{number + 1}/{len(proxies['plain'])} {unit.names[0]}: Δloss {measured[-1]:+.5f}", flush=True)
    measured = np.array(measured)
    third = len(measured) // 3
    rows = []
    for label, units in proxies.items():
        cost = np.array([unit.cost[args.scheme] for unit in units])
        cheapest = np.argsort(cost)[:third]
        rows.append((label, spearmanr(cost, measured)[0], measured[cheapest].sum()))
    oracle = np.sort(measured)[:third].sum()
    lines = [
        f"# Sensitivity proxies vs measured loss ({args.scheme})",
        "",
        f"{args.model}, each unit of every {args.layer_stride}. layer quantized alone (RTN {args.scheme}); "
        f"proxies from {args.samples}×{args.seq_len} "
        f"calibration tokens, loss measured on {args.samples} other windows (base loss {base:.4f} nats/token). "
        f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}; run "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - start:.0f} s.",
        "",
        f"| proxy | Spearman ρ with Δloss ({len(measured)} units) | summed Δloss of its cheapest {third} units |",
        "|---|---|---|",
        *[f"| {label} | {rho:.3f} | {loss:+.4f} |" for label, rho, loss in rows],
        f"| oracle (measured) | 1.000 | {oracle:+.4f} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    (ROOT / "benchmarks" / "results" / f"sensitivity-proxy-{args.scheme}.md").write_text(text)


if __name__ == "__main__":
    main()

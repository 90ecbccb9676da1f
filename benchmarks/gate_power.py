"""Power by design: for every blocking layer of each gate, how often a lossless checkpoint passes and the smallest
regression it blocks with probability ≥ 80%.

    python benchmarks/gate_power.py        # writes benchmarks/results/gate-power.{md,json}

Protocol. Every verdict below is read by the gate's own code (``compress.evals.gate.checks`` with the familywise
level of that gate's blocking checks), on simulated slices:
- perplexity and KL: windows drawn at random (as the gate's spread windows sample a long text) from the per-window
  scores ``benchmarks/gate_calibration.py`` stored for 480 windows of Shakespeare. A lossless checkpoint is RTN int8's
  per-window differences; a regression of a given size is RTN int4's per-window differences scaled so that their mean
  is that size (a real error's shape at a chosen size: the spread grows with the size, as it does between checkpoints).
- accuracy layers (lm_eval, json, needle, long_context): paired 0/1 outcomes over the layer's item count. The
  baseline is right on a share ``p`` of items; a lossless candidate flips ``churn`` of the items each way (a change of
  zero, with the disagreements a real requantization shows); a regression of ``d`` points loses ``d`` points more.
  ``p`` is the default model's accuracy on the preset's benchmarks (their stored per-item outcomes, pooled as the
  gate pools them: ARC-Easy 52.3%; with PIQA 61.5%) and ``churn`` RTN int8's flips against it on ARC-Easy; the
  generation layers take ARC-Easy's ``p``. The item count is the preset's: every item of its benchmarks, or its limit.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gate_verdicts import load_accuracy  # noqa: E402
from compress.commands.gate import load_policy  # noqa: E402
from compress.evals.gate import checks, stats  # noqa: E402
from compress.evals.gate.policy import resolve_policy  # noqa: E402
from compress.evals.gate.runner import blocking_checks  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DRAWS = 1000
RATIOS = (1.0, 1.02, 1.04, 1.06, 1.07, 1.08, 1.10, 1.12, 1.15, 1.20)
KLS = (0.001, 0.02, 0.04, 0.06, 0.07, 0.08, 0.10, 0.15)
DROPS = (0, 2, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40)
# ARC-Easy, all 570 items (benchmarks/results/accuracy-task.md): the default model is right on 52.3%; RTN int8 lost 6
# of its 298 right answers and gained 5 of its 272 wrong ones, about 2% churn each way
BASELINE_ACCURACY, CHURN = 0.523, 0.02
# the regression each layer is meant to catch, past its limit: +5 perplexity points, twice the KL limit, 5 accuracy
# points (10 for long-context, whose few long prompts cost most; 10 for json, whose limit is already 20 points)
STATED_MARGIN = {"perplexity": 0.05, "kl": None, "lm_eval": 5, "json": 10, "needle": 5, "long_context": 10}


def stated_regression(layer: str, limit: float) -> float:
    """The size the layer must block in >= 80% of runs (``STATED_MARGIN`` past ``limit``)."""
    return 2 * limit if layer == "kl" else round(limit + STATED_MARGIN[layer], 4)


def _window_scores() -> dict:
    saved = json.loads((RESULTS / "gate-calibration.json").read_text())["scores"]["models"]
    base = saved["baseline"]["window_nll"]

    def differences(name):
        return [c - b for c, b in zip(saved[name]["window_nll"], base, strict=True)]

    return {
        "lossless": differences("rtn_int8"),
        "shape": differences("rtn_int4"),
        "kl_lossless": saved["rtn_int8"]["window_kl"],
        "kl_shape": saved["rtn_int4"]["window_kl"],
    }


def _scaled(values: list[float], mean: float) -> list[float]:
    factor = mean / (sum(values) / len(values))
    return [value * factor for value in values]


def _rates(judge, draws: int = DRAWS) -> dict:
    verdicts = [judge(random.Random(seed)) for seed in range(draws)]
    return {verdict: verdicts.count(verdict) / draws for verdict in ("pass", "block", "inconclusive")}


def perplexity_power(scores: dict, windows: int, limit: float, family: float) -> list[dict]:
    rows = []
    for ratio in RATIOS:
        differences = scores["lossless"] if ratio == 1.0 else _scaled(scores["shape"], math.log(ratio))

        def judge(rng, differences=differences):
            sample = rng.sample(differences, windows)
            check = checks.ratio_check("perplexity", "perplexity", sample, [0.0] * windows, limit, 0.95)
            return checks.familywise(check, family).verdict

        rows.append({"size": ratio, **_rates(judge)})
    return rows


def kl_power(scores: dict, windows: int, limit: float, family: float) -> list[dict]:
    rows = []
    for mean in KLS:
        values = scores["kl_lossless"] if mean == KLS[0] else _scaled(scores["kl_shape"], mean)

        def judge(rng, values=values):
            check = checks.kl_check("kl", "kl_mean", rng.sample(values, windows), limit, 0.95)
            return checks.familywise(check, family).verdict

        rows.append({"size": mean, **_rates(judge)})
    return rows


def accuracy_power(items: int, max_drop: float, family: float, accuracy: float = BASELINE_ACCURACY) -> list[dict]:
    rows = []
    for drop in DROPS:

        def judge(rng, drop=drop):
            baseline = [1.0 if rng.random() < accuracy else 0.0 for _ in range(items)]
            lose = CHURN + drop / 100 / accuracy
            candidate = [
                (0.0 if rng.random() < lose else 1.0) if right else (1.0 if rng.random() < CHURN else 0.0)
                for right in baseline
            ]
            check = checks.drop_check("layer", "accuracy", candidate, baseline, max_drop, 0.95)
            return checks.familywise(check, family).verdict

        rows.append({"size": drop, **_rates(judge)})
    return rows


def _smallest_blocked(rows: list[dict]) -> float | None:
    return next((row["size"] for row in rows if row["block"] >= 0.8), None)


def benchmark_outcomes(policy) -> list[float]:
    """The default model's stored per-item outcomes on the preset's benchmarks, pooled in the preset's order
    (``benchmarks/accuracy_task.py`` stored them: ``accuracy-task.json`` for ARC-Easy, ``accuracy-<name>.json``)."""
    pooled = []
    for name in policy.lm_eval.benchmarks:
        stored = load_accuracy(RESULTS, "accuracy-task" if name == "arc_easy" else f"accuracy-{name}")
        if not stored:
            raise SystemExit(f"no stored outcomes of {name}: run benchmarks/accuracy_task.py --benchmark {name}")
        pooled += stored["baseline"]
    return pooled


def accuracy_items(policy, layer: str) -> int:
    """The item count each accuracy layer scores under ``policy`` (per task, for the multi-task layers)."""
    section = getattr(policy, layer)
    if layer == "lm_eval":
        every = len(benchmark_outcomes(policy))
        return min(section.limit, every) if section.limit else every
    if layer == "json":
        return section.num_prompts or 10
    if layer == "needle":
        return len(section.context_lengths) * len(section.depths) * section.trials
    return len(section.context_lengths) * section.trials  # long_context, per task


def analyze() -> dict:
    scores = _window_scores()
    found = {}
    for gate in ("quick", "default", "full"):
        policy = resolve_policy(load_policy(gate, []))
        family = stats.familywise_confidence(policy.confidence, blocking_checks(policy, policy.layers))
        windows = policy.perplexity.max_windows
        layers = {
            "perplexity": {
                "items": windows, "limit": policy.perplexity.max_ratio, "blocking": policy.perplexity.blocking,
                "rows": perplexity_power(scores, windows, policy.perplexity.max_ratio, family),
            },
            "kl": {
                "items": windows, "limit": policy.kl.max_mean, "blocking": policy.kl.blocking,
                "rows": kl_power(scores, windows, policy.kl.max_mean, family),
            },
        }  # fmt: skip
        outcomes = benchmark_outcomes(policy)
        for layer in ("lm_eval", "json", "needle", "long_context"):
            section = getattr(policy, layer)
            limit = section.max_validity_drop_points if layer == "json" else section.max_drop_points
            items = accuracy_items(policy, layer)
            accuracy = sum(outcomes) / len(outcomes) if layer == "lm_eval" else BASELINE_ACCURACY
            layers[layer] = {
                "items": items, "limit": limit, "blocking": section.blocking, "baseline_accuracy": accuracy,
                "rows": accuracy_power(items, limit, family, accuracy),
            }  # fmt: skip
        for name, layer in layers.items():
            layer["lossless_pass"] = layer["rows"][0]["pass"]
            layer["smallest_blocked_80"] = _smallest_blocked(layer["rows"])
            layer["stated"] = stated_regression(name, layer["limit"])
            layer["stated_block"] = next(row["block"] for row in layer["rows"] if row["size"] == layer["stated"])
        found[gate] = {"family_confidence": family, "layers": layers}
    return found


def _powered(layer: dict) -> str:
    """Whether the layer meets the gate's design rule: lossless passes >= 95%, the stated regression blocks >= 80%."""
    return "yes" if layer["lossless_pass"] >= 0.95 and layer["stated_block"] >= 0.8 else "no"


def _size(layer: str, value) -> str:
    if value is None:
        return "none in the range tried"
    if layer == "perplexity":
        return f"×{value:.2f}"
    if layer == "kl":
        return f"{value:g} nats"
    return f"−{value:g} points"


def write(found: dict) -> None:
    lines = [
        "# Gate power: what each blocking layer can see",
        "",
        f"`python benchmarks/gate_power.py` — {time.strftime('%Y-%m-%d')}, {DRAWS} simulated gate runs per cell.",
        "",
        __doc__.split("Protocol. ", 1)[1].strip(),
        "",
        f"Accuracy layers: a lossless candidate flips {CHURN:.0%} of the items each way (RTN int8 on ARC-Easy, "
        f"measured); the generation layers' baseline is right on {BASELINE_ACCURACY:.1%} of items, lm_eval's on its "
        "benchmarks' stored outcomes (per gate below). The window layers are simulated on one text: a regression "
        "present on every panel domain (gate.domains) meets one check per domain, so the rates below are the "
        "single-text ones, a lower bound on the panel's power.",
    ]
    for gate, result in found.items():
        lines += [
            "",
            f"## gate={gate} (BLOCK at the familywise {result['family_confidence']:.2%}; lm_eval's baseline right "
            f"on {result['layers']['lm_eval']['baseline_accuracy']:.1%} of its items)",
            "",
            "| layer | role | items | limit | P(pass), lossless | smallest regression blocked ≥ 80% "
            "| stated regression: P(block) | powered |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, layer in result["layers"].items():
            role = "blocking" if layer["blocking"] else "advisory"
            lines.append(
                f"| {name} | {role} | {layer['items']} | {layer['limit']:g} | {layer['lossless_pass']:.1%} "
                f"| {_size(name, layer['smallest_blocked_80'])} | {_size(name, layer['stated'])}: "
                f"{layer['stated_block']:.0%} | {_powered(layer)} |"
            )
        for name, layer in result["layers"].items():
            lines += ["", f"{gate} / {name}: P(block) by size: " + ", ".join(
                f"{_size(name, row['size'])} {row['block']:.0%}" for row in layer["rows"]
            )]  # fmt: skip
    (RESULTS / "gate-power.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "gate-power.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    write(analyze())
    print((RESULTS / "gate-power.md").read_text())

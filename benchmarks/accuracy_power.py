"""Operating characteristic of the lm_eval layer's planned non-inferiority rule, from stored per-item outcomes.

    python benchmarks/accuracy_power.py --draws 1000

Each draw resamples the stored paired outcomes (a bootstrap within each benchmark), lays them out in the gate's
pooled order (``item_plan.pooled_order``), scores the pilot, plans the count from its discordance
(``stats.planned_items`` at gate=default's familywise BLOCK level with lm_eval blocking), and judges the first
planned items with the gate's rule (``stats.noninferiority_verdict``). Pooled ARC-Easy + PIQA where both were
measured; ``rtn_int8`` and ``rtn_int4_g64`` exist on ARC-Easy alone and are judged there (570 items at most).
``mix-3``: a constructed -3-point checkpoint, each pooled item's outcome taken from ``rtn_int3_g64-f0.78`` on a
seeded random subset and from ``fp8_dynamic`` elsewhere, the subset grown until the pooled change reaches -3.0.
Writes ``benchmarks/results/accuracy-power.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gate_verdicts import clopper_pearson  # noqa: E402
from compress.evals.gate import item_plan, stats  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEMS = {"arc_easy": "accuracy-task", "piqa": "accuracy-piqa"}


def outcomes(benchmark: str, candidate: str | None) -> list[float]:
    stem = STEMS[benchmark] + (f"-{candidate}" if candidate else "")
    return json.loads((RESULTS / f"{stem}.json").read_text(encoding="utf-8"))["outcomes"]["acc"]


def mixed(first: list[list[float]], second: list[list[float]], baseline: list[list[float]], target: float, seed: int):
    """Per benchmark, ``second``'s outcomes on a seeded random subset of the pooled items, ``first``'s elsewhere:
    the smallest subset whose pooled change reaches ``target`` points."""
    places = [(bench, index) for bench, values in enumerate(first) for index in range(len(values))]
    random.Random(seed).shuffle(places)
    mix = [list(values) for values in first]
    items = len(places)
    change = sum(sum(m) - sum(b) for m, b in zip(mix, baseline, strict=True)) / items * 100
    for bench, index in places:
        if change <= target:
            break
        change += (second[bench][index] - mix[bench][index]) / items * 100
        mix[bench][index] = second[bench][index]
    return mix


def judged(candidate, baseline, pilot, margin, power, confidence, family, rng) -> tuple[str, int]:
    """One draw: the verdict of the planned rule and the items it judged."""
    sizes = [len(values) for values in baseline]
    draws = [[rng.randrange(size) for _ in range(size)] for size in sizes]
    next_of = [0] * len(sizes)
    pairs = []
    for bench in item_plan.pooled_order(sizes):
        index = draws[bench][next_of[bench]]
        next_of[bench] += 1
        pairs.append((candidate[bench][index], baseline[bench][index]))
    pilot = min(pilot, len(pairs))
    discordance = sum(1 for c, b in pairs[:pilot] if c != b) / pilot
    items = min(max(stats.planned_items(discordance, margin, power, family), pilot), len(pairs))
    gained = sum(1 for c, b in pairs[:items] if c and not b)
    lost = sum(1 for c, b in pairs[:items] if b and not c)
    return stats.noninferiority_verdict(gained, lost, items, margin, confidence, family)[0], items


def main() -> None:
    from compress.commands.gate import load_policy
    from compress.evals.gate.policy import resolve_policy
    from compress.evals.gate.runner import blocking_checks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--pilot", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--power", type=float, default=None, help="plan at this power (default: the preset's)")
    arguments = parser.parse_args()
    power_override = [] if arguments.power is None else [f"lm_eval.power={arguments.power}"]
    policy = resolve_policy(load_policy("default", ["lm_eval.blocking=true", *power_override]))
    family = stats.familywise_confidence(policy.confidence, blocking_checks(policy, policy.layers))
    margin, power, confidence = policy.lm_eval.max_drop_points / 100, policy.lm_eval.power, policy.confidence
    both = ["arc_easy", "piqa"]
    pooled_base = [outcomes(name, None) for name in both]
    sets = {name: (both, [outcomes(b, name) for b in both]) for name in ("fp8_dynamic", "rtn_int3_g64-f0.78")}
    sets["mix-3"] = (both, mixed(sets["fp8_dynamic"][1], sets["rtn_int3_g64-f0.78"][1], pooled_base, -3.0, 1))
    for name in ("rtn_int8", "rtn_int4_g64"):
        sets[name] = (["arc_easy"], [outcomes("arc_easy", name)])
    rows = {}
    for name, (benchmarks, candidate) in sets.items():
        baseline = [outcomes(b, None) for b in benchmarks]
        items = sum(len(values) for values in baseline)
        change = sum(sum(c) - sum(b) for c, b in zip(candidate, baseline, strict=True)) / items * 100
        rng = random.Random(arguments.seed)
        counts, planned = {stats.PASS: 0, stats.BLOCK: 0, stats.INCONCLUSIVE: 0}, []
        for _ in range(arguments.draws):
            verdict, judged_items = judged(candidate, baseline, arguments.pilot, margin, power, confidence, family, rng)
            counts[verdict] += 1
            planned.append(judged_items)
        rows[name] = {
            "benchmarks": benchmarks, "items": items, "change_points": round(change, 2),
            "mean_items_judged": sum(planned) / len(planned), "capped_share": planned.count(items) / len(planned),
            **{verdict: {"rate": count / arguments.draws, "cp95": clopper_pearson(count, arguments.draws)}
               for verdict, count in counts.items()},
        }  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {
        "command": "python benchmarks/accuracy_power.py " + " ".join(sys.argv[1:]), "commit": commit,
        "gate": "default with lm_eval.blocking=true", "max_drop_points": policy.lm_eval.max_drop_points,
        "confidence": confidence, "family_confidence": family, "power": power, "pilot": arguments.pilot,
        "draws": arguments.draws, "rows": rows,
    }  # fmt: skip
    (RESULTS / "accuracy-power.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    lines = [
        "# The lm_eval layer's planned rule: P(pass), P(block) from stored outcomes",
        "",
        f"Rule: PASS when the {confidence:.0%} Agresti–Min lower end is above −{report['max_drop_points']:g} points; "
        f"BLOCK when the exact one-sided McNemar test rejects no drop at the familywise {family:.3%} (two-sided; "
        f"gate=default's {blocking_checks(policy, policy.layers)} blocking checks with lm_eval blocking) and the "
        f"estimate is past −{report['max_drop_points'] / 2:g}. Items: a {arguments.pilot}-item pilot, then "
        f"`stats.planned_items` at power {power:g} from its discordance, capped by the items there. "
        f"{arguments.draws} bootstrap draws (items resampled within each benchmark, in the gate's pooled order); "
        "Clopper–Pearson 95% bounds treat the draws as independent. Outcomes: `accuracy-task*.json`, "
        "`accuracy-piqa*.json`. `mix-3`: see benchmarks/accuracy_power.py.",
        "",
        "| candidate | benchmarks | items there | change (points) | mean items judged | P(pass) | P(block) "
        "| P(inconclusive) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(row, verdict):
        low, high = row[verdict]["cp95"]
        return f"{row[verdict]['rate']:.1%} ({low:.1%}–{high:.1%})"

    for name, row in rows.items():
        lines.append(
            f"| {name} | {'+'.join(row['benchmarks'])} | {row['items']} | {row['change_points']:+.2f} | "
            f"{row['mean_items_judged']:.0f} | {cell(row, stats.PASS)} | {cell(row, stats.BLOCK)} | "
            f"{cell(row, stats.INCONCLUSIVE)} |"
        )
    lines += ["", "```bash", report["command"], "```", "", f"Commit {commit}."]
    (RESULTS / "accuracy-power.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

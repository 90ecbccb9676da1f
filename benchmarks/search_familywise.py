"""How often ``compress search`` keeps a checkpoint past the limit, with and without its sealed confirmation.

    python benchmarks/search_familywise.py                 # 400 simulated searches per text and limit
    python benchmarks/search_familywise.py --searches 500

Protocol. From the stored per-window scores of ``benchmarks/results/gate-calibration.json`` (1200 windows of 512
tokens of Shakespeare and of Python code; per checkpoint its per-window NLL and KL, and the baseline's NLL), each
simulated search draws a text of as many windows as the default evaluation text holds (53: one at random from each
of 53 equal stretches of the 1200) and splits them as the search does (``WindowSplit`` at the default
``search.confirm_share``: 32 search windows, 21 sealed). It walks the ladder of stored checkpoints from the most
lossy (largest full-text ratio) up, gating each on the same search windows with the gate's own checks (interval
over blocks of neighbours, BLOCK at the default preset's familywise level), and keeps the first that PASSES: the
smallest passing one, every rung below it looked at (the most looks a search can take). With confirmation, that
choice is gated once on the sealed windows and kept only if it PASSES. A checkpoint is past the limit when its
full-text (1200-window) ratio or mean KL exceeds an enforced limit. Draws share windows, so they are not independent
trials; the Clopper-Pearson bounds treat them as if they were. Results: ``benchmarks/results/search-familywise.*``.
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

from benchmarks.gate_verdicts import clopper_pearson, full_ratio  # noqa: E402
from compress.evals.gate import checks as gate_checks  # noqa: E402
from compress.evals.gate.windows import SEALED, SEARCH, WindowSplit  # noqa: E402
from compress.search import SearchSpec  # noqa: E402

TEXTS = ("shakespeare/1200", "python_code/1200")
TEXT_WINDOWS = 53  # windows of 512 tokens in the default evaluation text (recipes/gate/default.yaml)
# (max_ratio, max_kl): the shipped limits, each alone, and limits moved so that a rung sits just past them
LIMITS = [(1.05, 0.05), (1.05, None), (None, 0.05), (1.03, None), (1.04, None), (None, 0.03), (None, 0.04)]


def judge(model: dict, base: list[float], indices: list[int], max_ratio, max_kl, confidence, family) -> str:
    """The window layers' verdict on one slice, as the gate reads it (one place to adapt to the gate's checks)."""
    verdicts = []
    if max_ratio is not None:
        ratio = gate_checks.ratio_check(
            "perplexity", "perplexity", [model["window_nll"][i] for i in indices], [base[i] for i in indices],
            max_ratio, confidence, positions=indices,
        )  # fmt: skip
        verdicts.append(gate_checks.familywise(ratio, family).verdict)
    if max_kl is not None:
        kl = gate_checks.kl_check(
            "kl", "kl_mean", [model["window_kl"][i] for i in indices], max_kl, confidence, positions=indices
        )  # fmt: skip
        verdicts.append(gate_checks.familywise(kl, family).verdict)
    return "block" if "block" in verdicts else "pass" if all(v == "pass" for v in verdicts) else "inconclusive"


def simulate(scores: dict, max_ratio, max_kl, searches: int, seed: int, policy, family: float) -> dict:
    base = scores["models"]["baseline"]["window_nll"]
    count = len(base)
    rungs = []
    for name, model in scores["models"].items():
        if name == "baseline":
            continue
        ratio, kl = full_ratio(model["window_nll"], base), sum(model["window_kl"]) / len(model["window_kl"])
        past = (max_ratio is not None and ratio > max_ratio) or (max_kl is not None and kl > max_kl)
        rungs.append({"name": name, "ratio": ratio, "kl": kl, "past_limit": past, "model": model})
    rungs.sort(key=lambda rung: -rung["ratio"])  # most lossy first, as a search climbs from its smallest point
    share = SearchSpec().confirm_share
    search_at, sealed_at = (WindowSplit(part, share).positions(TEXT_WINDOWS) for part in (SEARCH, SEALED))
    edges = [j * count // TEXT_WINDOWS for j in range(TEXT_WINDOWS + 1)]
    rng = random.Random(seed)
    tally = {"chosen": 0, "chosen_past": 0, "accepted": 0, "accepted_past": 0, "looks": 0}
    settings = (max_ratio, max_kl, policy.confidence, family)
    for _ in range(searches):
        text = [rng.randrange(edges[j], edges[j + 1]) for j in range(TEXT_WINDOWS)]
        search, sealed = [text[p] for p in search_at], [text[p] for p in sealed_at]
        for rung in rungs:
            tally["looks"] += 1
            if judge(rung["model"], base, search, *settings) == "pass":
                tally["chosen"] += 1
                tally["chosen_past"] += rung["past_limit"]
                if judge(rung["model"], base, sealed, *settings) == "pass":
                    tally["accepted"] += 1
                    tally["accepted_past"] += rung["past_limit"]
                break
    return {
        "max_ratio": max_ratio,
        "max_kl": max_kl,
        "rungs": [{k: v for k, v in rung.items() if k != "model"} for rung in rungs],
        "searches": searches,
        "mean_looks": tally["looks"] / searches,
        "without_confirmation": _rate(tally["chosen_past"], searches, tally["chosen"]),
        "with_confirmation": _rate(tally["accepted_past"], searches, tally["accepted"]),
    }


def _rate(past: int, searches: int, kept: int) -> dict:
    low, high = clopper_pearson(past, searches)
    return {"kept": kept / searches, "past_limit": past / searches, "past_limit_bounds": [low, high]}


def markdown(report: dict) -> str:
    lines = [
        "# Search familywise error: sealed confirmation",
        "",
        f"`{report['command']}` at `{report['commit']}`. {report['protocol']}",
        "",
        f"Search windows {report['search_windows']}, sealed {report['sealed_windows']} (of {TEXT_WINDOWS}); "
        f"{report['searches']} searches per row; BLOCK at the familywise {report['family_confidence']:.2%}.",
        "",
        "| text | limits | rungs past | looks | kept, no confirmation | past limit, no confirmation | kept, confirmed "
        "| past limit, confirmed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        limits = ", ".join(f"{key} {row[key]:g}" for key in ("max_ratio", "max_kl") if row[key] is not None)
        past = sum(rung["past_limit"] for rung in row["rungs"])
        cells = []
        for kind in ("without_confirmation", "with_confirmation"):
            found = row[kind]
            low, high = found["past_limit_bounds"]
            cells += [f"{found['kept']:.1%}", f"{found['past_limit']:.1%} ({low:.1%}–{high:.1%})"]
        lines.append(f"| {row['text']} | {limits} | {past}/{len(row['rungs'])} | {row['mean_looks']:.1f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    worst = max(row["with_confirmation"]["past_limit_bounds"][1] for row in report["rows"])
    lines += ["", f"Largest upper bound of P(kept past the limit) with confirmation: {worst:.1%}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--searches", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from benchmarks.gate_calibration import gate_policy

    policy, family, _ = gate_policy("default")
    stored = json.loads((ROOT / "benchmarks" / "results" / "gate-calibration.json").read_text())["texts"]
    rows = []
    for text in TEXTS:
        for index, (max_ratio, max_kl) in enumerate(LIMITS):
            row = simulate(stored[text], max_ratio, max_kl, args.searches, args.seed + index, policy, family)
            rows.append({"text": text, **row})
    share = SearchSpec().confirm_share
    report = {
        "command": "python benchmarks/search_familywise.py " + " ".join(sys.argv[1:]),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),  # fmt: skip
        "protocol": __doc__.split("Protocol. ", 1)[1].split(" Results:")[0].replace("\n", " "),
        "searches": args.searches,
        "seed": args.seed,
        "confirm_share": share,
        "search_windows": len(WindowSplit(SEARCH, share).positions(TEXT_WINDOWS)),
        "sealed_windows": len(WindowSplit(SEALED, share).positions(TEXT_WINDOWS)),
        "confidence": policy.confidence,
        "family_confidence": family,
        "rows": rows,
    }
    out = ROOT / "benchmarks" / "results"
    (out / "search-familywise.json").write_text(json.dumps(report, indent=2))
    (out / "search-familywise.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

"""The domain panel's verdict, calibrated, and the coverage of the gate's interval per text, in one table.

The default gate judges perplexity and KL on three kinds of text (``compress.base.data.domain_panel``): dialogue in
verse (Shakespeare, the evaluation text), code (the running Python's standard library) and technical prose (its
docstrings); each domain's two checks join the familywise family, and the verdict line names the worst domain. Here
the verdict a user gets is drawn from the per-window scores ``benchmarks/gate_calibration.py`` stored for each text:
per draw, one spread slice of the preset's window count from each domain's text (drawn independently), each judged
by the gate's checks at the preset's familywise level, then combined (any BLOCK blocks, all PASS passes) with the
worst domain recorded as the gate records it (the highest perplexity ratio). Only checkpoints scored on every
panel text take part. The stored texts are whole corpora, not the gate's evaluation splits of them: the same kinds
of text, more windows.
"""

from __future__ import annotations

from collections import Counter

from benchmarks import gate_verdicts

# the panel's kinds of text → the gate-calibration text that stands for each (gate_calibration.evaluation_text)
PANEL = {"dialogue": "shakespeare", "code": "python_code", "technical": "python_docstrings"}
COVERAGE_GOAL, SLICES_GOAL, TEXTS_GOAL = 0.93, 100, 2


def panel_texts(texts: dict, name: str) -> dict[str, str]:
    """Each panel domain's stored text entry (``<text>/<windows>``) that scored checkpoint ``name``: the one with the
    most windows."""
    found = {}
    for domain, text in PANEL.items():
        keys = [key for key in texts if key.split("/")[0] == text and name in texts[key]["models"]]
        if keys:
            found[domain] = max(keys, key=lambda key: texts[key]["windows"])
    return found


def panel_rates(texts: dict, policy, family: float, domains: list[str], seed: int = 0) -> dict:
    """Per checkpoint scored on the texts of all ``domains`` (the evaluation text ``dialogue`` first), the combined
    verdict's rates over resampled panel draws, how often each domain was the worst, and the texts it was read on."""
    size = policy.perplexity.max_windows
    names = dict.fromkeys(name for scores in texts.values() for name in scores["models"] if name != "baseline")
    found: dict = {"windows": size, "domains": domains, "checkpoints": {}}
    found["missing"] = [domain for domain in domains if domain not in panel_texts(texts, "baseline")]
    domains = found["domains"] = [domain for domain in domains if domain not in found["missing"]]
    for name in names:
        keys = panel_texts(texts, name)
        if any(domain not in keys for domain in domains):
            continue
        scored = [texts[keys[domain]]["models"] for domain in domains]
        draws = [
            gate_verdicts.spread_draws(len(models["baseline"]["window_nll"]), size, gate_verdicts.DRAWS, seed + i)
            for i, models in enumerate(scored)
        ]
        checks, worst = [[] for _ in range(2 * len(domains))], Counter()  # per check, its verdict in every draw
        for draw in range(gate_verdicts.DRAWS):
            ratios = {}
            for index, (domain, models, slices) in enumerate(zip(domains, scored, draws, strict=True)):
                base = models["baseline"]["window_nll"]
                ratio, divergence = gate_verdicts.judge_windows(models[name], base, slices[draw], policy, family)
                checks[2 * index].append(ratio.verdict)
                checks[2 * index + 1].append(divergence.verdict)
                ratios[domain] = ratio.estimate
            worst[max(ratios, key=ratios.get)] += 1
        verdicts = gate_verdicts.combine(*checks)
        full = {
            domain: gate_verdicts.full_ratio(models[name]["window_nll"], models["baseline"]["window_nll"])
            for domain, models in zip(domains, scored, strict=True)
        }
        found["checkpoints"][name] = {
            "texts": {domain: keys[domain] for domain in domains}, "full_ratio": full, "worst": dict(worst),
            **gate_verdicts.tally(verdicts),
        }  # fmt: skip
    return found


def panel_markdown(gate: str, family: float, found: dict) -> list[str]:
    if not found["checkpoints"]:
        missing = found["missing"] or "a checkpoint on every text"
        return ["", f"### gate={gate}, the domain panel: not calibrated (no scores for {missing})"]
    domains = found["domains"]
    unscored = f"; not scored, so left out: {', '.join(found['missing'])}" if found["missing"] else ""
    lines = [
        "",
        f"### gate={gate}, the verdict a user gets over the domain panel: perplexity + KL on {len(domains)} kinds "
        f"of text, {gate_verdicts.DRAWS} draws of {found['windows']} spread windows each (BLOCK at {family:.2%}"
        f"{unscored})",
        "",
        "| checkpoint |" + "".join(f" ratio, {domain} |" for domain in domains)
        + " P(pass) (95% CP) | P(block) (95% CP) | P(inconclusive) (95% CP) | worst domain (share of draws) | texts |",
        "|---|" + "---|" * (len(domains) + 5),
    ]  # fmt: skip
    for name, row in found["checkpoints"].items():
        ratios = "".join(f" {row['full_ratio'][domain]:.4f} |" for domain in domains)
        worst = ", ".join(
            f"{domain} {count / row['slices']:.0%}" for domain, count in Counter(row["worst"]).most_common()
        )
        texts = ", ".join(f"`{key}`" for key in row["texts"].values())
        lines.append(f"| {name} |{ratios} {gate_verdicts.rate_cells(row)} | {worst} | {texts} |")
    return lines


def coverage_rows(tables: dict) -> list[dict]:
    """Per text, gate and checkpoint: the coverage of the gate's 95% interval over disjoint contiguous slices (the
    hard case: neighbouring windows of one text are correlated), with the number of slices."""
    rows = []
    for key, table in tables.items():
        for gate, result in table.items():
            contiguous = result["kinds"]["contiguous"]
            for name, layers in contiguous["checkpoints"].items():
                rows.append({
                    "text": key, "gate": gate, "windows": result["windows_per_slice"], "slices": contiguous["slices"],
                    "checkpoint": name, "perplexity": layers["perplexity"]["coverage"],
                    "kl": layers["kl"]["coverage"],
                })  # fmt: skip
    return sorted(rows, key=lambda row: row["slices"] < SLICES_GOAL)  # the texts long enough for the goal first


def coverage_markdown(rows: list[dict]) -> list[str]:
    """The coverage summary: every text's disjoint contiguous slices, the goal marked where the slices suffice."""
    lines = [
        "",
        f"## Coverage of the gate's 95% interval: disjoint contiguous slices (goal ≥ {COVERAGE_GOAL:.0%} over ≥ "
        f"{SLICES_GOAL} slices)",
        "",
        "Each slice's interval (blocks of neighbouring windows, `evals/gate/stats.py`) is checked for holding the "
        "value over the whole text; the 95% Clopper-Pearson bounds say how far the share of covering slices can be "
        "trusted.",
        "",
        "| text | gate | windows per slice | slices | checkpoint | perplexity coverage (95% CP) | KL coverage (95% CP) "
        "| goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = []
        for layer in ("perplexity", "kl"):
            hits = round(row[layer] * row["slices"])
            low, high = gate_verdicts.clopper_pearson(hits, row["slices"])
            cells.append(f"{row[layer]:.0%} ({low:.0%}–{high:.0%})")
        if row["slices"] < SLICES_GOAL:
            goal = f"– (< {SLICES_GOAL} slices)"
        else:
            goal = "met" if min(row["perplexity"], row["kl"]) >= COVERAGE_GOAL else "**missed**"
        lines.append(
            f"| {row['text']} | {row['gate']} | {row['windows']} | {row['slices']} | {row['checkpoint']} "
            f"| {cells[0]} | {cells[1]} | {goal} |"
        )
    return lines + ["", *coverage_goal_lines(rows)]


def coverage_goal_lines(rows: list[dict]) -> list[str]:
    """Per checkpoint, the goal as issue 47 states it: ≥ 93% on ≥ 100 slices on at least two texts."""
    texts: dict[str, dict[str, bool]] = {}  # checkpoint → {text: goal met there}, texts with enough slices only
    probes: dict[str, list[str]] = {}  # checkpoint → the texts too short for the goal it was scored on
    for row in rows:
        if row["slices"] >= SLICES_GOAL:
            met = min(row["perplexity"], row["kl"]) >= COVERAGE_GOAL
            by_text = texts.setdefault(row["checkpoint"], {})
            by_text[row["text"]] = met and by_text.get(row["text"], True)  # every gate's slices, where several
        elif row["text"] not in probes.setdefault(row["checkpoint"], []):
            probes[row["checkpoint"]].append(row["text"])
    lines = [f"Per checkpoint, the goal on at least {TEXTS_GOAL} texts:", ""]
    for name in dict.fromkeys(row["checkpoint"] for row in rows):
        found = texts.get(name, {})
        if not found:
            short = ", ".join(f"`{text}`" for text in probes[name])
            lines.append(f"- {name}: not measured: scored only on {short} (fewer than {SLICES_GOAL} slices)")
            continue
        met = [text for text, ok in found.items() if ok]
        missed = len(met) < len(found)
        verdict = "**met**" if len(met) >= TEXTS_GOAL else "**missed**" if missed else "not shown: too few texts"
        where = ", ".join(f"`{text}`" + ("" if ok else " (missed)") for text, ok in found.items())
        lines.append(f"- {name}: {verdict} ({where} with ≥ {SLICES_GOAL} slices)")
    return lines

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

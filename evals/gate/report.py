"""``gate.json`` for machines, ``gate.md`` for the reviewer, and the metric names MLflow keeps."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from compress.base.staging import write_file_atomically
from compress.evals.gate.result import GateResult

TITLES = {"pass": "PASSED", "block": "BLOCKED", "inconclusive": "INCONCLUSIVE"}

log = logging.getLogger(__name__)


def _format(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


VERDICT_FILES = ("gate.json", "gate.md")


def clear_verdict(out_dir: Path) -> None:
    """Remove a previous verdict from a reused folder before judging again: a gate killed midway must not leave the
    last one (perhaps a PASS) for CI to read as its own."""
    for name in VERDICT_FILES:
        if (Path(out_dir) / name).exists():
            log.info("gate: removing the previous verdict %s before judging again", Path(out_dir) / name)
            (Path(out_dir) / name).unlink()


def write_report(result: GateResult, out_dir: Path) -> list[Path]:
    """gate.json for machines, gate.md for the reviewer."""
    lines = [
        f"# Release gate: {TITLES[result.verdict]}",
        "",
        f"- candidate: `{result.candidate}`",
        f"- baseline: `{result.baseline}`",
        f"- generation backend: `{result.backend}`"
        + (" (transformers greedy loop; the compress engine was not used)" if result.backend == "transformers" else ""),
        f"- candidate KV cache: `{result.kv_cache_dtype or 'model dtype'}`",
    ]
    if result.registry and "version" in result.registry:
        registry = result.registry
        aliases = ", ".join(registry["aliases"])
        lines.append(f"- registered: `{registry['name']}` version {registry['version']} ({aliases})")
    if result.roles():
        lines.append(f"- roles: {result.roles()} (an advisory layer is reported, never deciding)")
    if result.reasons:
        lines += ["", "## Why", ""] + [f"- {reason}" for reason in result.reasons]
    if result.layers:
        lines += ["", "## Layers", "", "| layer | role | status | verdict | seconds |", "|---|---|---|---|---|"]
        lines += [
            f"| {x.name} | {x.role or '–'} | {x.status} | {x.verdict or '–'} | {x.seconds:.1f} |" for x in result.layers
        ]
    checks = [check for layer in result.layers for check in layer.checks]
    if checks:
        confidence = f"{checks[0].confidence:.0%}" if len({c.confidence for c in checks}) == 1 else "level"
        lines += [
            "",
            "## Checks",
            "",
            "Each estimate is paired over the same items for both sides; the verdict is read from its interval: "
            "PASS inside the limit, BLOCK outside it, INCONCLUSIVE when it straddles it.",
            "",
            f"| layer | metric | candidate | baseline | estimate | {confidence} interval | items | limit | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {check.layer} | {check.metric} | {_format(check.candidate)} | {_format(check.baseline)} "
            f"| {_format(check.estimate)} | {_format(check.low)} – {_format(check.high)} | {check.items} "
            f"| {check.limit_text} | {check.verdict if check.verdict != 'block' else '**BLOCK**'} |"
            for check in checks
        ]
    notes = [(layer.name, layer.note) for layer in result.layers if layer.note]
    notes += [(layer.name, note) for layer in result.layers if layer.note is None for note in _notes(layer)]
    if notes:
        lines += ["", "## Not judged", ""] + [f"- {name}: {note}" for name, note in notes]
    protocol = next((layer.metrics.get("protocol") for layer in result.layers if layer.metrics.get("protocol")), None)
    if protocol:
        lines += [
            "",
            f"Perplexity and KL: {protocol['windows']} windows of {protocol['seq_len']} tokens, measured by the "
            f"{protocol['measured_by']}, intervals at {protocol['confidence']:.1%}"
            + (" (gate.decide: widened for repeated looks)" if protocol["decide"] else "")
            + ".",
        ]
    lines += _kl_statistics(result)
    if (out_dir / "needle_heatmap.png").exists() and any(
        layer.name == "needle" and layer.metrics for layer in result.layers
    ):
        lines += ["", "## Needle in a haystack", "", "![needle accuracy](needle_heatmap.png)"]
    markdown = out_dir / "gate.md"
    write_file_atomically(markdown, lambda staged: staged.write_text("\n".join(lines) + "\n"))
    data = out_dir / "gate.json"  # last and whole: CI reads it as the verdict
    write_file_atomically(data, lambda staged: staged.write_text(json.dumps(result.to_dict(), indent=2, default=str)))
    return [data, markdown]


def _kl_statistics(result: GateResult) -> list[str]:
    """The KL report llama.cpp's perplexity tool prints, for the evaluation text: the per-token KL's mean,
    percentiles and max, the mean Δp of the actual next token and the same-top share with their intervals."""
    layer = next((layer for layer in result.layers if layer.name == "kl" and "candidate" in layer.metrics), None)
    kl = layer.metrics["candidate"] if layer is not None else {}
    if "same_top_low" not in kl:  # no KL judged, or passes stored before these statistics
        return []
    confidence = f"{kl['summary_confidence']:.0%}"
    points = [100 * kl[key] for key in ("delta_p_mean", "delta_p_low", "delta_p_high")]
    shares = [100 * kl[key] for key in ("same_top", "same_top_low", "same_top_high")]
    tokens = [_format(kl[key]) for key in ("kl_mean", "kl_p99.9", "kl_p99", "kl_p95", "kl_p90", "kl_p50", "kl_max")]
    return [
        "",
        "## KL statistics",
        "",
        f"KL(baseline ‖ candidate) over the {kl['kl_vocabulary']} vocabulary, nats per token, {kl['tokens']} tokens.",
        "",
        f"| mean | p99.9 | p99 | p95 | p90 | median | max | mean Δp, points ({confidence}) | same top ({confidence}) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {' | '.join(tokens)} | {points[0]:+.2f} ({points[1]:+.2f} – {points[2]:+.2f}) "
        f"| {shares[0]:.1f}% ({shares[1]:.1f} – {shares[2]:.1f}%) |",
        "",
        "Δp: the candidate's probability of the actual next token minus the baseline's. Intervals: Student t over "
        "per-window means (the tokens of one window are correlated); the mean KL's interval is its check's.",
    ]


def _notes(layer) -> list[str]:
    return list(layer.metrics.get("notes", [])) if isinstance(layer.metrics, dict) else []


def summary_metrics(result: GateResult) -> dict[str, float]:
    """The metric names the gate logs and ``compress compare`` reads back: all under ``gate.``, so that a run which
    also measured its own perplexity (``ppl_ratio``) keeps both numbers apart. Each judged estimate comes with its
    interval (``<name>_low`` / ``<name>_high``)."""
    metrics = {"passed": float(result.passed), "inconclusive": float(result.verdict == "inconclusive")}

    def both(layer, key):
        metrics[key], metrics[f"{key}_baseline"] = layer.metrics["candidate"][key], layer.metrics["baseline"][key]

    for layer in result.layers:
        if layer.status in ("error", "skipped"):
            continue
        if layer.name == "perplexity" and "candidate" in layer.metrics:
            metrics["ppl_candidate"] = layer.metrics["candidate"]["perplexity"]
            metrics["ppl_baseline"] = layer.metrics["baseline"]["perplexity"]
            metrics["ppl_ratio"] = layer.metrics["ppl_ratio"]
        if layer.name == "kl" and "candidate" in layer.metrics:
            for key in ("kl_mean", "kl_p99", "same_top", "delta_p_mean"):
                metrics[key] = layer.metrics["candidate"][key]
        if layer.name == "json" and "candidate" in layer.metrics:
            for key in ("json_validity", "json_schema_compliance"):
                both(layer, key)
        if layer.name in ("needle", "long_context") and "candidate" in layer.metrics:
            both(layer, f"{layer.name}_accuracy")
        if layer.name == "latency" and "candidate" in layer.metrics:
            for key in ("ttft_p50_ms", "tpot_p50_ms"):
                both(layer, key)
            metrics["ttft_ratio"], metrics["tpot_ratio"] = layer.metrics["ttft_ratio"], layer.metrics["tpot_ratio"]
        for check in layer.checks:
            metric, domain = check.base_metric, check.domain  # a panel domain's check: "perplexity [code]"
            name = "ppl_ratio" if metric == "perplexity" and check.layer == "perplexity" else metric
            name = (f"{name}.{domain}" if domain else name).replace("/", ".")
            if domain:  # MLflow names allow no brackets: gate.ppl_ratio.code, gate.kl_mean.technical
                metrics[name] = check.estimate
            metrics[f"{name}_low"], metrics[f"{name}_high"] = check.low, check.high
    return {
        f"gate.{_mlflow_name(key)}": value
        for key, value in metrics.items()
        if value is not None and math.isfinite(value)
    }


def _mlflow_name(name: str) -> str:
    """MLflow refuses a metric name with anything beyond alphanumerics, ``_ - . : /`` and spaces: a pooled check
    (``arc_easy+piqa/acc``) is logged as ``arc_easy_piqa.acc``."""
    return re.sub(r"[^\w\-. :/]", "_", name)

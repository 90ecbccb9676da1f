"""What a run reports: phase timings, the metrics it logs, and the one-screen summary (``report.md``, the CLI).

The run's own perplexity is logged as ``ppl_baseline`` / ``ppl_candidate`` / ``ppl_ratio`` on the headline text
(another source than the calibration data) and ``..._in_domain`` on the calibration source's held-out split; the
release gate's numbers live under ``gate.*`` (see ``compress.evals.gate.summary_metrics``), so the two never
overwrite each other in MLflow.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compress.base.errors import ExitCode
from compress.base.signals import raise_if_signalled

log = logging.getLogger(__name__)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Timer:
    """Wall time per named phase (load_model, compress, save, ...), summed over repeated phases, the phases that
    raised the process's peak RSS (by how much): which step to shrink when a run does not fit; each phase's peak
    GPU memory (torch's allocations, once CUDA is in use); and every phase's span in epoch seconds, so a sampler
    outside the process (benchmarks/gpu_e2e.py) can attribute what it measured to a phase."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak_rise_mb: dict[str, float] = {}
        self.peak_gpu_mb: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        raise_if_signalled()
        began, start, peak = time.time(), time.perf_counter(), peak_rss_mb()
        cuda = _cuda_in_use()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        try:
            yield
            raise_if_signalled()
        finally:
            elapsed = time.perf_counter() - start  # one clock for both: a span lasts what the phase's seconds say
            log.info("%s: %.1f s", name, elapsed)  # a run cut short (a timeout, a kill) writes no report.json
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            self.spans.append((name, began, began + elapsed))
            rise = peak_rss_mb() - peak
            if rise > 0:
                self.peak_rise_mb[name] = self.peak_rise_mb.get(name, 0.0) + rise
            cuda = _cuda_in_use()
            if cuda is not None:
                gpu_peak = cuda.max_memory_allocated() / 2**20
                self.peak_gpu_mb[name] = max(self.peak_gpu_mb.get(name, 0.0), gpu_peak)


def _cuda_in_use():
    """``torch.cuda`` once this process has initialised CUDA, else None (a CPU run never touches it)."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


def run_metrics(report: dict) -> dict[str, float]:
    """The run's own metrics (the gate logs its own under ``gate.*``)."""
    ppl = report["perplexity"]
    metrics = {
        "size_mb": report["checkpoint"]["size_mb"],
        "bits_per_weight": report["checkpoint"]["bits_per_weight"],
        "wall_time_s": report["wall_time_s"],
        "peak_rss_mb": report["peak_rss_mb"],
    }
    if "baseline" in ppl and "candidate" in ppl:
        metrics.update(
            ppl_baseline=ppl["baseline"]["perplexity"],
            ppl_candidate=ppl["candidate"]["perplexity"],
            ppl_ratio=ppl["candidate"]["perplexity"] / ppl["baseline"]["perplexity"],
        )
    if "rtn_reference" in ppl:
        metrics["ppl_rtn_reference"] = ppl["rtn_reference"]["perplexity"]
    in_domain = report.get("perplexity_in_domain") or {}
    if "baseline" in in_domain and "candidate" in in_domain:
        metrics.update(
            ppl_baseline_in_domain=in_domain["baseline"]["perplexity"],
            ppl_candidate_in_domain=in_domain["candidate"]["perplexity"],
            ppl_ratio_in_domain=in_domain["candidate"]["perplexity"] / in_domain["baseline"]["perplexity"],
        )
    return metrics


def summary_lines(report: dict) -> list[str]:
    """The run's summary without the gate verdict, which the CLI prints once, last."""
    ckpt, data = report["checkpoint"], report["data"]
    headline, in_domain = data.get("evaluation") or {}, data.get("in_domain")
    where = f"{headline.get('source', data['source'])}, " + (
        "in-domain: the calibration source" if not in_domain else "out-of-domain"
    )
    generated = f"; {data['generated_tokens']} of them sampled from the model" if data.get("generated_tokens") else ""
    lines = [
        f"# compress run {report['run_id']}",
        "",
        f"recipe `{report['recipe']}` on model `{report['model']}`; {data['calibration_tokens']} calibration tokens "
        f"({data['source']}{generated}), {data['evaluation_tokens']} evaluation tokens ({where})"
        + (
            f"; in-domain beside it: {in_domain['tokens']} held-out tokens of {in_domain['source']}"
            if in_domain
            else ""
        ),
        "",
    ]
    lines += [f"stage {name}: {summary.get('algorithm', name)}" for name, summary in report.get("stages", {}).items()]
    lines += [""] if report.get("stages") else []
    ppl, beside = report["perplexity"], report.get("perplexity_in_domain") or {}
    lines += ["| model | perplexity | vs baseline |" + (" in-domain | vs baseline |" if beside else "")]
    lines += ["|---|---|---|" + ("---|---|" if beside else "")]
    base = ppl.get("baseline", {}).get("perplexity")
    base_beside = beside.get("baseline", {}).get("perplexity")
    for name, result in ppl.items():
        ratio = f"{result['perplexity'] / base:.4f}×" if base else "n/a"
        row = f"| {name} | {result['perplexity']:.4f} | {ratio} |"
        if beside:
            other = beside.get(name, {}).get("perplexity")
            row += f" {other:.4f} | {other / base_beside:.4f}× |" if other and base_beside else " – | – |"
        lines.append(row)
    divergence = ppl.get("candidate", {}).get("divergence")
    if divergence:  # measured in the candidate's perplexity pass, against the baseline's top-k
        lines.append(
            f"\ncandidate's KL from the baseline {divergence['kl_mean']:.4f} nats/token "
            f"(p99 {divergence['kl_p99']:.3f}), same top token at {divergence['same_top']:.1%} of positions"
        )
    lines += [
        "",
        f"checkpoint: {ckpt['size_mb']:.1f} MB, {ckpt['quantized_linears']} quantized linears at "
        f"{ckpt['bits_per_weight']:.2f} stored bits/weight",
        f"wall time {report['wall_time_s']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MB; phases: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in report["timings_s"].items()),
        "peak RSS raised by: "
        + (", ".join(f"{k} +{v:.0f} MB" for k, v in report.get("peak_rss_rise_mb", {}).items()) or "nothing measured"),
    ]
    return lines


VERDICT_EXIT_CODES = {  # what an enforced gate exits with (compress.base.errors.ExitCode)
    "pass": int(ExitCode.OK),
    "block": int(ExitCode.BLOCKED),
    "inconclusive": int(ExitCode.CANNOT_JUDGE),
}


def verdict_line(gate: dict, enforce: bool | None = None) -> str:
    """The gate's one line, which quotes the perplexity ratio with its interval and names each layer's role:
    ``release gate: BLOCKED — perplexity ×1.2130 (95% CI 1.1903–1.2362) > the 1.05× limit: BLOCK [blocking:
    perplexity (block); skipped: kl]``. With ``enforce`` given (the CLI), a block or an inconclusive verdict also
    says whether it fails the command."""
    verdict = gate.get("verdict", "pass" if gate["passed"] else "block")
    title = {"pass": "PASSED", "block": "BLOCKED", "inconclusive": "INCONCLUSIVE"}[verdict]
    headline = gate.get("headline")
    roles = f" [{gate['roles']}]" if gate.get("roles") else ""  # which layers decide, which only report
    if verdict == "pass":
        return (f"release gate: PASSED — {headline}" if headline else "release gate: PASSED") + roles
    reason = gate["reasons"][0] if gate.get("reasons") else "see the gate report"
    if headline and headline != reason:
        reason = f"{reason}; {headline}"
    reason += roles
    if enforce is None:
        return f"release gate: {title} — {reason}"
    consequence = (
        f"gate.enforce=true: exiting {VERDICT_EXIT_CODES[verdict]}"
        if enforce
        else "this is the gate working; see README; gate.enforce=true makes it fail the command"
    )
    return f"release gate: {title} — {reason} ({consequence})"


def gate_details(gate: dict) -> list[str]:
    """Every further reason of a block or an undecided check, then where the gate's own report is."""
    others = gate["reasons"][1:] if not gate["passed"] else []
    return [*(f"  - {reason}" for reason in others), f"  details: {gate['report']}"]


def write_report(report: dict, folder: Path) -> None:
    """``report.json`` and ``report.md`` (the summary, then the verdict and its details)."""
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    lines = summary_lines(report)
    if "gate" in report:
        lines += ["", verdict_line(report["gate"]), *gate_details(report["gate"])]
    (folder / "report.md").write_text("\n".join(lines) + "\n")


def run_report(config, data: dict, stages: dict, checkpoint: dict, passes=None) -> dict:
    """The run's report before the gate: what ran on which text, each stage's summary, the perplexity passes
    (``compress.app.run_passes.RunEvaluation``; none for a run without them) and the checkpoint's size summary."""
    return {
        "recipe": config.recipe,
        "model": config.model.path,
        "data": data,
        "stages": stages,
        "perplexity": {name: r.to_dict() for name, r in passes.results.items()} if passes else {},
        "perplexity_in_domain": {name: r.to_dict() for name, r in passes.in_domain_results.items()} if passes else {},
        "checkpoint": checkpoint,
    }

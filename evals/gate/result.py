"""What a gate returns: one :class:`LayerResult` per layer and the :class:`GateResult` that gathers them, read by
``report`` (gate.json, gate.md) and by the callers that record the verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from compress.evals.gate.checks import Check
from compress.evals.gate.stats import BLOCK, PASS


@dataclass
class LayerResult:
    name: str
    status: str  # pass | fail | inconclusive | warn | cannot_judge | error | skipped
    verdict: str | None = None  # pass | block | inconclusive, whether or not the layer is blocking
    seconds: float = 0.0
    estimate: float | None = None  # of the check that decided the verdict (the worst one)
    low: float | None = None
    high: float | None = None
    limit: float | None = None
    metrics: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    role: str | None = None  # blocking | advisory (decides the verdict or only reports); None: not judged


@dataclass
class GateResult:
    verdict: str  # pass | block | inconclusive
    reasons: list[str]  # why it is not a pass: the blocking lines first, then the undecided ones
    layers: list[LayerResult]
    candidate: str
    baseline: str
    backend: str
    kv_cache_dtype: str | None
    policy: dict
    registry: dict | None = None  # filled in by whoever records the verdict (compress.app.tracking.record_verdict)
    mlflow_run_id: str | None = None
    files: list[Path] = field(default_factory=list)  # what this gate wrote: gate.json, gate.md, plots

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def to_dict(self) -> dict:
        data = {key: value for key, value in asdict(self).items() if key != "files"}
        data["passed"] = self.passed
        return data

    def layer(self, name: str) -> LayerResult | None:
        return next((layer for layer in self.layers if layer.name == name), None)

    def metric(self, layer: str, name: str, model: str = "candidate") -> float | None:
        found = self.layer(layer)
        if found is not None and model in found.metrics:
            return found.metrics[model].get(name)
        return None

    def headline(self) -> str | None:
        """The perplexity check's line (ratio and interval), which every verdict line quotes: with a domain panel
        (``gate.domains``), the worst kind of text's, named (``perplexity [code] ×1.08 ...``)."""
        found = self.layer("perplexity")
        checks = [check for check in found.checks if check.base_metric == "perplexity"] if found else []
        return max(checks, key=lambda check: check.estimate).describe() if checks else None

    def roles(self) -> str | None:
        """Each layer's part in the verdict, in one short phrase for the verdict line: ``blocking: perplexity, kl;
        advisory: latency (inconclusive); not judged: json; skipped: needle``. A layer that did not pass says how
        it ended; an advisory one is reported, never deciding."""
        groups: dict[str, list[str]] = {"blocking": [], "advisory": [], "not judged": [], "skipped": []}
        for layer in self.layers:
            if layer.status == "skipped":
                groups["skipped"].append(layer.name)
            elif layer.status == "cannot_judge" or layer.role is None:
                groups["not judged"].append(layer.name)
            else:
                ended = "error" if layer.status == "error" else layer.verdict
                groups[layer.role].append(layer.name + (f" ({ended})" if ended not in (PASS, None) else ""))
        text = "; ".join(f"{role}: {', '.join(names)}" for role, names in groups.items() if names)
        return text or None

    def fail_closed(self, reason: str) -> None:
        self.verdict = BLOCK
        self.reasons.insert(0, reason)

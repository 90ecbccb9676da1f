"""The release gate: a regressed checkpoint must not ship, and its verdict says how sure it is.

Layers run cheapest first (perplexity and KL in one pass, lm-eval accuracy, JSON validity, needle, multi-hop long
context, latency); each compares the candidate with the baseline on the same items under limits from
``recipes/gate/*.yaml`` and reads its verdict from a paired interval: PASS, BLOCK or INCONCLUSIVE
(``compress.evals.gate.stats``). The first BLOCK stops the gate; an evaluator that raises blocks too (fail closed).
Outputs: ``gate.json``, ``gate.md`` and plots. The gate only judges: recording the verdict in MLflow and registering the
checkpoint is the caller's job (``compress.app.tracking.record_verdict``), so this package never imports the CLI,
pipeline
or tracking layers.

Modules, in import order: ``stats`` (intervals, verdicts) → ``policy`` → ``checks`` → ``context`` → ``windows``
(perplexity, KL) → ``layers`` → ``result`` → ``report`` (gate.json, gate.md) → ``run`` (orchestration).
"""

from compress.evals.gate.policy import LAYER_ORDER, GatePolicy, resolve_policy
from compress.evals.gate.report import clear_verdict, summary_metrics, write_report
from compress.evals.gate.result import GateResult, LayerResult
from compress.evals.gate.runner import describe_sides, run_gate

__all__ = [
    "clear_verdict",
    "describe_sides",
    "LAYER_ORDER",
    "GatePolicy",
    "GateResult",
    "LayerResult",
    "resolve_policy",
    "run_gate",
    "summary_metrics",
    "write_report",
]

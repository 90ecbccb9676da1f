"""What a search leaves behind: its trials, the result and its one line, ``search.json``/``search.md``, and the
MLflow parent run with one child run per trial."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from compress.base.errors import ExitCode
from compress.search.frontier import Allocation, Frontier
from compress.search.spec import SearchSpec

PASS, BLOCK, INCONCLUSIVE = "pass", "block", "inconclusive"  # the gate's verdicts (evals/gate/stats.py)


@dataclass
class Trial:
    number: int
    point: int  # frontier index
    bits_per_weight: float  # as stored (size.json linear_bits_per_weight)
    predicted_cost: float
    passed: bool
    ppl_ratio: float | None
    reasons: list[str]
    checkpoint: str
    size_mb: float
    schemes: dict[str, int]  # scheme → units
    mlflow_run_id: str | None = None
    verdict: str = "block"  # the gate's: pass | block | inconclusive (still undecided after gate.decide's windows)
    ppl_interval: tuple[float, float] | None = None  # the gate's interval of the perplexity ratio

    @property
    def undecided(self) -> bool:
        """Neither a pass nor a block: the gate stayed INCONCLUSIVE after the evidence it may add."""
        return not self.passed and self.verdict == INCONCLUSIVE


@dataclass
class Confirmation:
    """The chosen checkpoint's gate on the sealed windows (``search.confirm``): the only verdict on it that the
    search's choice did not shape."""

    trial: int  # the chosen trial's number
    verdict: str  # the gate's: pass | block | inconclusive
    reasons: list[str]
    windows: int  # sealed windows scored on the evaluation text
    window_positions: list[int]  # their places in the text
    ppl_ratio: float | None
    ppl_interval: tuple[float, float] | None
    gate_dir: str

    @property
    def passed(self) -> bool:
        return self.verdict == PASS


@dataclass
class SearchResult:
    outcome: str  # passed | unconfirmed (the choice failed its confirmation) | budget | max_trials
    line: str  # the one line the command prints last
    trials: list[Trial]
    best: Trial | None  # the smallest trial that passed the search's windows
    folder: Path
    mlflow_run_id: str | None = None
    confirmation: Confirmation | None = None  # None: search.confirm=false, or nothing passed to confirm

    @property
    def passed(self) -> bool:
        """A checkpoint to release: one passed, and its confirmation (when there is one) passed too."""
        return self.best is not None and (self.confirmation is None or self.confirmation.passed)

    @property
    def exit_code(self) -> int:
        """0 passed; a choice that failed confirmation exits as its sealed gate did (1 BLOCK, 3 INCONCLUSIVE);
        1 when nothing passed within the limits."""
        if self.passed:
            return int(ExitCode.OK)
        if self.best is not None and self.confirmation.verdict == INCONCLUSIVE:
            return int(ExitCode.CANNOT_JUDGE)
        return int(ExitCode.BLOCKED)


def outcome_line(
    outcome: str, trials: list[Trial], best: Trial | None, spec: SearchSpec, confirmation: Confirmation | None = None
) -> str:
    """The command's last line. Nothing passing is BLOCKED when the largest trial blocked, INCONCLUSIVE when the
    gate could not decide it (more windows did not settle it): a different fix (more evidence, not more bits). A
    choice its sealed windows did not pass is NOT CONFIRMED, with the fix its verdict calls for."""
    if best is not None and confirmation is not None and not confirmation.passed:
        return _unconfirmed_line(trials, best, confirmation)
    if best is not None:
        confirmed = f", confirmed on {confirmation.windows} sealed windows" if confirmation is not None else ""
        return (
            f"search: PASSED — smallest passing checkpoint {best.checkpoint} ({best.bits_per_weight:.3f} bits/weight, "
            f"{best.size_mb:.1f} MB, trial {best.number} of {len(trials)}{confirmed})"
        )
    worst = max(trials, key=lambda t: t.point)
    head, was = ("INCONCLUSIVE", "stayed undecided") if worst.undecided else ("BLOCKED", "was blocked")
    why = "; ".join(worst.reasons) or was.split()[-1]
    undecided = sum(t.undecided for t in trials)
    tally = f"{len(trials)} trials recorded ({undecided} undecided)" if undecided else f"{len(trials)} trials recorded"
    if outcome == "budget":
        return (
            f"search: {head} — budget limit: the best allocation within search.budget_bits={spec.budget_bits:g} "
            f"({worst.bits_per_weight:.3f} bits/weight, trial {worst.number}) {was} ({why}); "
            f"{tally}; raise search.budget_bits or relax the gate"
            + (" or give it more evidence (gate.perplexity.decide_max_windows, more items)" if worst.undecided else "")
        )
    return (
        f"search: {head} — trial limit: search.max_trials={spec.max_trials} trials ran, none passed (largest "
        f"{worst.bits_per_weight:.3f} bits/weight {was}: {why}); {tally}; raise search.max_trials"
    )


def _unconfirmed_line(trials: list[Trial], best: Trial, confirmation: Confirmation) -> str:
    """A choice that passed the search's windows but not the sealed ones is no release: a block says it is past the
    limit (its pass was the search's windows' luck), an undecided one that the sealed windows were too few."""
    why = "; ".join(confirmation.reasons) or confirmation.verdict
    head = (
        f"search: NOT CONFIRMED — the chosen checkpoint {best.checkpoint} ({best.bits_per_weight:.3f} bits/weight, "
        f"trial {best.number} of {len(trials)}) passed the search's windows but "
    )
    if confirmation.verdict == INCONCLUSIVE:
        return head + (
            f"stayed undecided on its {confirmation.windows} sealed windows ({why}); not a release: give the "
            "confirmation more windows (a longer eval.data, or a larger search.confirm_share)"
        )
    larger = sorted((t for t in trials if t.passed and t.point > best.point), key=lambda t: t.bits_per_weight)
    fix = (
        f"gate the next larger passing trial on new text (compress gate checkpoint={larger[0].checkpoint}, "
        f"{larger[0].bits_per_weight:.3f} bits/weight)"
        if larger
        else f"search again above it (search.start_bits={best.bits_per_weight:.2f} or more) or relax the gate"
    )
    return head + f"blocks on its {confirmation.windows} sealed windows ({why}); not a release: {fix}"


def verdict_counts(trials: list[Trial]) -> dict[str, int]:
    """How many trials passed, blocked, and stayed undecided."""
    return {
        PASS: sum(t.passed for t in trials),
        BLOCK: sum(not t.passed and not t.undecided for t in trials),
        INCONCLUSIVE: sum(t.undecided for t in trials),
    }


def write_summary(result: SearchResult, spec: SearchSpec, frontier: Frontier) -> None:
    data = {
        "outcome": result.outcome,
        "line": result.line,
        "spec": asdict(spec),
        "frontier_points": len(frontier),
        "verdicts": verdict_counts(result.trials),
        "passed": result.passed,
        "best": asdict(result.best) if result.best else None,
        "confirmation": asdict(result.confirmation) if result.confirmation else None,
        "trials": [asdict(trial) for trial in result.trials],
    }
    (result.folder / "search.json").write_text(json.dumps(data, indent=2))
    lines = [
        "# compress search",
        "",
        f"budget {spec.budget_bits:g} bits/weight, candidates {', '.join(spec.candidates)}",
        "",
        "| trial | bits/weight | size MB | ppl ratio | 95% interval | predicted error | schemes (units) | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in result.trials:
        ratio = "–" if t.ppl_ratio is None else f"{t.ppl_ratio:.4f}"
        interval = "–" if t.ppl_interval is None else f"{t.ppl_interval[0]:.4f}–{t.ppl_interval[1]:.4f}"
        schemes = ", ".join(f"{name} ×{count}" for name, count in t.schemes.items())
        verdict = "pass" if t.passed else f"{t.verdict.upper()}: " + "; ".join(t.reasons)
        lines.append(
            f"| {t.number} | {t.bits_per_weight:.3f} | {t.size_mb:.2f} | {ratio} | {interval} | {t.predicted_cost:.4g} "
            f"| {schemes} | {verdict} |"
        )
    if result.confirmation is not None:
        c = result.confirmation
        ratio = "–" if c.ppl_ratio is None else f"×{c.ppl_ratio:.4f}"
        interval = "" if c.ppl_interval is None else f" ({c.ppl_interval[0]:.4f}–{c.ppl_interval[1]:.4f})"
        why = "" if c.passed else ": " + "; ".join(c.reasons)
        lines += [
            "",
            f"Confirmation of trial {c.trial} on {c.windows} sealed windows (never seen by the trials): perplexity "
            f"{ratio}{interval}, {c.verdict.upper()}{why}",
        ]
    lines += ["", result.line, ""]
    (result.folder / "search.md").write_text("\n".join(lines))


class Tracker:
    """The search's MLflow parent run and one child run per trial (``mlflow.parentRunId``); nothing when tracking
    is off."""

    def __init__(self, config, spec: SearchSpec, folder: Path):
        from compress.app.tracking import RunLog, check_writable, flatten, tracking_uri

        self.parent = None
        self.children: dict[int, object] = {}
        self.config = config
        if not config.tracking.enabled:
            return
        uri = tracking_uri(config.tracking.uri)
        check_writable(uri, "set tracking.uri=<a writable store> or tracking.enabled=false")
        tags = {"compress.kind": "search", "compress.recipe": config.recipe, "compress.model": config.model.path}
        self.parent = RunLog(uri, config.tracking.experiment, folder.name, tags=tags)
        self.parent.params({**flatten(asdict(spec), "search."), "recipe": config.recipe})

    @property
    def run_id(self) -> str | None:
        return None if self.parent is None else self.parent.run_id

    def trial(self, trial: Trial, verdict, checkpoint: Path, allocation: Allocation) -> None:
        from compress.app.tracking import RunLog, record_verdict

        if self.parent is None:
            return
        tags = {
            "compress.kind": "search-trial",
            "compress.recipe": f"{self.config.recipe} search #{trial.number}",
            "compress.model": self.config.model.path,
        }
        child = RunLog(
            self.parent.uri, self.config.tracking.experiment, f"trial-{trial.number}", tags, self.parent.run_id
        )
        child.params({f"schemes.{name}": str(count) for name, count in trial.schemes.items()})
        child.metrics(
            {
                "size_mb": trial.size_mb,
                "bits_per_weight": trial.bits_per_weight,
                "predicted_bits_per_weight": allocation.bits_per_weight,
                "predicted_error": trial.predicted_cost,
            }
        )
        record_verdict(child, verdict, verdict.files, checkpoint, own_run=False)
        child.artifact(checkpoint / "recipe.yaml")
        child.finish()
        trial.mlflow_run_id = child.run_id
        self.children[trial.number] = child

    def finish(self, result: SearchResult, policy) -> None:
        from compress.app.tracking import register_checkpoint, registered_name

        if self.parent is None:
            return
        undecided = verdict_counts(result.trials)[INCONCLUSIVE]
        self.parent.metrics(
            {"trials": len(result.trials), "trials_inconclusive": undecided, "passed": float(result.passed)}
        )
        self.parent.tag("compress.search.outcome", result.line)
        if result.confirmation is not None:
            confirmation = result.confirmation
            self.parent.tag("compress.search.confirmation", confirmation.verdict)
            passed, windows = float(confirmation.passed), confirmation.windows
            self.parent.metrics({"confirmation_passed": passed, "confirmation_windows": windows})
            if confirmation.ppl_ratio is not None:
                self.parent.metrics({"confirmation_ppl_ratio": confirmation.ppl_ratio})
            for name in ("gate.json", "gate.md"):
                self.parent.artifact(Path(confirmation.gate_dir) / name, "confirmation")
        if result.best is not None:
            self.parent.metrics({"best_bits_per_weight": result.best.bits_per_weight, "size_mb": result.best.size_mb})
            self.parent.tag("compress.search.best_trial_run", str(result.best.mlflow_run_id))
            if policy.registry.register and result.passed:
                name = policy.registry.name or registered_name(self.config.model.path)
                tags = {"bits_per_weight": f"{result.best.bits_per_weight:.4f}"}
                registry = register_checkpoint(
                    self.children[result.best.number], Path(result.best.checkpoint), name, tags, policy.registry.promote
                )
                self.parent.tag("compress.search.registered", f"{registry['name']} v{registry['version']}")
        for name in ("search.json", "search.md"):
            self.parent.artifact(result.folder / name)
        self.parent.finish()

    def fail(self, error: BaseException) -> None:
        if self.parent is not None:
            self.parent.fail(error)

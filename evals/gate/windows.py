"""The perplexity and KL layers: one pass per side over the same windows of the evaluation text.

The baseline's pass records the top of its distribution at every position (``compress.evals.divergence``), cached on
disk by model, tokens and protocol; the candidate's pass measures its perplexity and its KL divergence from that
reference at once. Both layers judge the same windows, item by item: the interval of the perplexity ratio is over
per-window NLL differences, the KL's over per-window means.

Which windows: when the gate scores fewer windows than the text holds, it takes them spread over the whole text
(:func:`spread_order`: any first n of that order lie evenly across it), not the first n: windows side by side share a
scene, a topic, a difficulty, and an interval over one stretch says little about the rest of the text. Windows that lie
near one another (any selection from one short text, the whole text scored, the run's own pass) are read with a
variance from batch means over thirds of the stretch (``compress.evals.gate.stats.window_mean_interval``).
docs/gate.md has the coverage this buys.

A caller that gates many candidates and keeps one (``compress search``) gives a :class:`WindowSplit`: the gate
then scores only its part of every judged text's windows, the search's or the sealed one its choice is confirmed on.

``gate.decide=true``: while a perplexity or KL check is INCONCLUSIVE, the candidate scores more windows (at least
twice as many each look, or as many as the interval says would decide it) up to ``perplexity.decide_max_windows``.
Looking several times at a growing sample inflates the error rate, so each look's interval is widened to
``1 − (1 − confidence) / looks`` for the number of looks the cap allows (Bonferroni).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from compress.base.locks import file_lock, lock_beside
from compress.base.paths import artifacts_dir
from compress.evals.divergence import (
    DivergenceMeter,
    FullReference,
    ReferenceRecorder,
    load_reference,
    reference_path,
    reference_summary,
    save_reference,
)
from compress.evals.gate import checks as gate_checks
from compress.evals.gate.checks import Check
from compress.evals.gate.context import GateContext, Subject
from compress.evals.gate.policy import GatePolicy
from compress.evals.gate.stats import INCONCLUSIVE
from compress.evals.perplexity import PerplexityResult, available_windows, evaluation_windows, resident_perplexity


def spread_order(count: int) -> list[int]:
    """The window indices ``0 .. count−1`` in van der Corput order (0, ½, ¼, ¾, ⅛, ... of the text): every prefix of
    it is spread evenly over the text, so adding windows (``gate.decide``) keeps the sample spread."""
    bits = max(1, (count - 1).bit_length())
    order, seen = [], set()
    for step in range(1 << bits):
        point = int(format(step, f"0{bits}b")[::-1], 2) / (1 << bits)
        index = int(point * count)
        if index not in seen:
            seen.add(index)
            order.append(index)
    return order


SEARCH, SEALED = "search", "sealed"


@dataclass(frozen=True)
class WindowSplit:
    """One of two disjoint parts of a text's windows: in :func:`spread_order`, the first ``1 − sealed_share`` of
    them are the search's, the rest are sealed. A search keeps the first candidate that passes, so its windows
    become the ones the choice fits; only windows it never saw can confirm that choice. Both parts lie spread over
    the whole text, interleaved, and each is in spread order itself (so ``gate.decide`` keeps adding spread
    windows)."""

    part: str  # SEARCH | SEALED
    sealed_share: float

    def positions(self, available: int) -> list[int]:
        """The text positions of this part's windows, out of ``available``."""
        order = spread_order(available)
        cut = available - round(available * self.sealed_share)
        return order[:cut] if self.part == SEARCH else order[cut:]


def judged_windows(context: GateContext) -> int:
    """How many windows of the evaluation text the gate may score: its part of them under a :class:`WindowSplit`."""
    available = available_windows(context.evaluation_ids, context.policy.perplexity.seq_len)
    return available if context.window_split is None else len(context.window_split.positions(available))


def scoring_ids(context: GateContext) -> torch.Tensor:
    """The token stream the gate scores, window after window: the evaluation text's windows in :func:`spread_order`
    when the gate scores fewer than all of them (its part's windows under a :class:`WindowSplit`), else the text as
    it is; sets ``context.window_positions`` (each scored window's place in the text)."""
    if context.window_ids is None:
        seq_len = context.policy.perplexity.seq_len
        available = available_windows(context.evaluation_ids, seq_len)
        wanted = context.policy.perplexity.max_windows or available
        spread = 2 <= wanted < available or context.window_split is not None
        if context.window_split is not None:
            context.window_positions = context.window_split.positions(available)
        else:
            context.window_positions = spread_order(available) if spread else list(range(available))
        windows = context.evaluation_ids[: available * seq_len].view(available, seq_len)
        context.window_ids = windows[context.window_positions].reshape(-1) if spread else context.evaluation_ids
    return context.window_ids


def positions_of(context: GateContext, count: int) -> list[int]:
    """The text positions of the first ``count`` windows judged: the gate's own order, or the caller's windows in
    text order (``compress run`` scores its evaluation text from the first window on)."""
    if context.scores_source != "gate":
        first = context.scores["candidate"].get("first_window", 0)
        return list(range(first, first + count))
    scoring_ids(context)
    return context.window_positions[:count]


def window_plan(context: GateContext) -> tuple[int, int]:
    """``(windows scored first, most windows a decided gate may score)``, and the per-look confidence set."""
    policy = context.policy.perplexity
    available = judged_windows(context)
    if available < 2:
        part = "" if context.window_split is None else f"'s {context.window_split.part} part"
        raise ValueError(
            f"the evaluation text{part} holds {available} window(s) of {policy.seq_len} tokens; an interval needs ≥ 2: "
            "give more text or lower gate.perplexity.seq_len"
        )
    first = min(policy.max_windows or available, available)
    cap = min(policy.decide_max_windows or available, available) if context.policy.decide else first
    looks = 1 + max(0, math.ceil(math.log2(cap / first))) if cap > first else 1
    context.window_confidence = 1 - (1 - context.policy.confidence) / looks
    return first, cap


def domain_contexts(context: GateContext) -> dict[str, GateContext]:
    """One context per kind of text of the domain panel (``gate.domains``), made once from ``context``: the same
    policy and sides, that domain's evaluation ids, its own scores and baseline reference."""
    if context.domain_contexts is None:
        context.domain_contexts = {
            name: replace(
                context,
                evaluation_ids=ids,
                scores={},
                scores_source="gate",
                reference=None,
                reference_cached=None,
                window_ids=None,
                window_positions=[],
                domain_ids={},
                domain_contexts={},
            )  # fmt: skip
            for name, ids in context.domain_ids.items()
        }
    return context.domain_contexts


def measure_windows(context: GateContext, subjects: list[Subject]) -> dict:
    """Both layers' measurement, done once per side (the baseline first: the candidate's KL needs its reference), on
    the evaluation text and on each domain of the panel."""
    for each in (context, *domain_contexts(context).values()):
        for subject in sorted(subjects, key=lambda subject: subject.label != "baseline"):
            if not cached_baseline(each, subject):
                measure = _measure_baseline if subject.label == "baseline" else _measure_candidate
                each.scores[subject.label] = measure(each, subject)
    return {}


def known(context: GateContext, subject: Subject) -> bool:
    """Whether ``subject``'s passes are all known (given by the caller or cached) on every text the window layers
    judge: then it need not be loaded for them."""
    return all(cached_baseline(each, subject) for each in (context, *domain_contexts(context).values()))


def _records_reference(context: GateContext) -> bool:
    return "kl" in context.selected


def cached_baseline(context: GateContext, subject: Subject) -> bool:
    """Fill in the baseline's pass from the reference cache (same model files, tokens and protocol), if it is there:
    then the baseline need not be loaded for these layers at all. A full-vocabulary reference is never cached."""
    if subject.label != "baseline" or subject.label in context.scores or not _records_reference(context):
        return subject.label in context.scores
    if context.policy.kl.full_vocab:
        return False
    policy, top_k = context.policy.perplexity, context.policy.kl.top_k
    _, cap = window_plan(context)
    path = reference_path(cache_dir(context.policy), subject.folder, scoring_ids(context), policy.seq_len, top_k)
    reference = load_reference(path, cap)
    if reference is None:
        return False
    context.reference, context.reference_cached = reference, str(path)
    window_nll = (-reference["target_logprob"].double().mean(1)).tolist()
    context.scores["baseline"] = _from_windows(window_nll, policy.seq_len, reference_summary(reference)).to_dict()
    return True


def _measure_baseline(context: GateContext, subject: Subject) -> dict:
    policy, top_k = context.policy.perplexity, context.policy.kl.top_k
    _, cap = window_plan(context)
    ids = scoring_ids(context)
    if not _records_reference(context):
        return _score(subject, context, cap, None).to_dict()
    if context.policy.kl.full_vocab:
        context.reference = FullReference(cap, policy.seq_len - 1, directory=cache_dir(context.policy))
        return _score(subject, context, cap, context.reference).to_dict()
    path = reference_path(cache_dir(context.policy), subject.folder, ids, policy.seq_len, top_k)
    # Two gates of one baseline at once: the second waits here, then reads the reference the first cached.
    with file_lock(lock_beside(path), f"the baseline reference {path}") if path else nullcontext():
        if cached_baseline(context, subject):
            return context.scores["baseline"]
        recorder = ReferenceRecorder(cap, policy.seq_len - 1, top_k)
        result = _score(subject, context, cap, recorder)
        context.reference = recorder.tensors()
        keep_reference(context.policy, subject.folder, ids, policy.seq_len, recorder)
    return result.to_dict()


def reference_recorder(policy: GatePolicy, token_ids, seq_len: int, max_windows: int | None):
    """For a caller that scores the baseline itself (``compress run``): the recorder of its top-k distributions (its
    whole ones under ``gate.kl.full_vocab``) when the gate will judge the KL, so the candidate's pass measures its
    divergence and the gate judges both numbers without measuring again; None when the gate has no KL layer."""
    if not (policy.enabled and "kl" in policy.layers and policy.kl.enabled):
        return None
    windows = evaluation_windows(token_ids, seq_len, max_windows)
    if policy.kl.full_vocab:
        return FullReference(len(windows), seq_len - 1, directory=cache_dir(policy))
    return ReferenceRecorder(len(windows), seq_len - 1, policy.kl.top_k)


def keep_reference(
    policy: GatePolicy, folder, token_ids, seq_len: int, recorder: ReferenceRecorder | FullReference
) -> None:
    """Cache a baseline's recorded top-k reference (when the baseline has a folder to key it by; a full-vocabulary
    one is too large to keep)."""
    if isinstance(recorder, FullReference):
        return
    path = reference_path(cache_dir(policy), folder, token_ids, seq_len, recorder.indices.shape[-1])
    if path is not None:
        save_reference(path, recorder.tensors(), {"format": "compress-reference", "seq_len": str(seq_len)})


def _measure_candidate(context: GateContext, subject: Subject) -> dict:
    first, cap = window_plan(context)
    meter = DivergenceMeter(context.reference) if context.reference is not None else None
    result = _score(subject, context, first, meter)
    while result.windows < cap:
        undecided = [check for check in window_checks(context, result.to_dict()) if check.verdict == INCONCLUSIVE]
        if not undecided:
            break
        needed = max(check.items_to_decide or cap for check in undecided)
        more = min(cap, max(2 * result.windows, math.ceil(needed * 1.2))) - result.windows
        extra = _score(subject, context, more, meter, first_window=result.windows)
        result = _merged(result, extra)
    return result.to_dict()


def _score(subject: Subject, context: GateContext, windows: int, observer, first_window: int = 0) -> PerplexityResult:
    policy = context.policy.perplexity
    return resident_perplexity(
        subject.model, scoring_ids(context), policy.seq_len, policy.batch_size, windows,
        label=f"perplexity ({subject.label})", progress=False, observer=observer, first_window=first_window,
    )  # fmt: skip


def _merged(first: PerplexityResult, more: PerplexityResult) -> PerplexityResult:
    """Two consecutive runs of windows as one (the second's divergence summary already covers both: one meter)."""
    merged = _from_windows(first.window_nll + more.window_nll, first.seq_len, more.divergence)
    return replace(merged, first_window=first.first_window)


def _from_windows(window_nll: list[float], seq_len: int, divergence: dict | None) -> PerplexityResult:
    mean_nll = sum(window_nll) / len(window_nll)
    tokens = len(window_nll) * (seq_len - 1)
    return PerplexityResult(math.exp(mean_nll), mean_nll, tokens, len(window_nll), seq_len, window_nll, 0, divergence)


def cache_dir(policy: GatePolicy) -> Path:
    return Path(policy.cache_dir).expanduser() if policy.cache_dir else artifacts_dir() / "cache" / "gate-references"


def window_checks(
    context: GateContext, candidate: dict, layers=("perplexity", "kl"), domain: str | None = None
) -> list[Check]:
    """The perplexity and KL checks of ``candidate``'s windows against the same windows of the baseline; on a
    domain of the panel, each metric is named with it (``perplexity [code]``)."""
    baseline = context.scores["baseline"]
    count = len(candidate["window_nll"])
    candidate_nll, baseline_nll = candidate["window_nll"], baseline["window_nll"][:count]
    if len(baseline_nll) < count:
        raise ValueError(f"the baseline scored {len(baseline_nll)} windows, the candidate {count}: they must match")
    placement = {
        "confidence": context.window_confidence,
        "positions": positions_of(context, count),
    }

    def placed(make, layer: str, metric: str, *values) -> Check:
        check = make(layer, metric if domain is None else f"{metric} [{domain}]", *values, **placement)
        check.domain = domain
        return check

    found = []
    if "perplexity" in layers and "perplexity" in context.selected:
        policy = context.policy.perplexity
        if policy.max_ratio is not None:
            ratio = gate_checks.ratio_check
            found.append(placed(ratio, "perplexity", "perplexity", candidate_nll, baseline_nll, policy.max_ratio))
        if policy.max_value is not None:
            value = gate_checks.value_check
            found.append(placed(value, "perplexity", "perplexity_value", candidate_nll, policy.max_value))
    divergence = candidate.get("divergence")
    if "kl" in layers and "kl" in context.selected and divergence and "window_kl" in divergence:
        policy, mean = context.policy.kl, gate_checks.mean_check
        if policy.max_mean is not None:
            found.append(placed(gate_checks.kl_check, "kl", "kl_mean", divergence["window_kl"], policy.max_mean))
        if policy.min_same_top is not None:
            found.append(placed(mean, "kl", "same_top", divergence["window_same_top"], policy.min_same_top, False))
    return found


def _domain_checks(context: GateContext, layer: str) -> list[Check]:
    return [
        check
        for name, each in domain_contexts(context).items()
        for check in window_checks(each, each.scores["candidate"], (layer,), name)
    ]


def _panel(checks: list[Check]) -> dict:
    """Each text's ratio and interval, and the worst of them: what the verdict line names."""
    ratios = {check.domain or "evaluation": check for check in checks if check.base_metric == "perplexity"}
    domains = {
        name: {"ratio": check.estimate, "low": check.low, "high": check.high, "windows": check.items}
        for name, check in ratios.items()
    }
    worst = max(domains, key=lambda name: domains[name]["ratio"]) if domains else None
    return {"domains": domains, "worst_domain": worst}


def _protocol(context: GateContext, windows: int) -> dict:
    policy = context.policy.perplexity
    return {
        "seq_len": policy.seq_len if context.scores_source == "gate" else context.scores["candidate"]["seq_len"],
        "windows": windows,
        "window_positions": positions_of(context, windows),
        "measured_by": context.scores_source,
        "confidence": context.window_confidence,
        "decide": context.policy.decide,
        "window_split": None if context.window_split is None else context.window_split.part,
    }


def judge_perplexity(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    candidate, baseline = context.scores["candidate"], context.scores["baseline"]
    count = len(candidate["window_nll"])
    same_windows = len(baseline["window_nll"]) == count
    baseline_ppl = baseline["perplexity"] if same_windows else math.exp(sum(baseline["window_nll"][:count]) / count)
    metrics.update(
        candidate={key: candidate[key] for key in ("perplexity", "mean_nll", "tokens", "windows", "seq_len")},
        baseline={"perplexity": baseline_ppl, "windows": count},
        ppl_ratio=candidate["perplexity"] / baseline_ppl,
        protocol=_protocol(context, count),
    )
    checks = window_checks(context, candidate, ("perplexity",)) + _domain_checks(context, "perplexity")
    if context.domain_ids:
        metrics.update(_panel(checks))
    return metrics, checks


def judge_kl(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    candidate = context.scores["candidate"]
    divergence = candidate.get("divergence")
    if not divergence or "window_kl" not in divergence:
        raise ValueError("no KL was measured: the baseline's reference distributions are missing")
    summary = {key: value for key, value in divergence.items() if not key.startswith("window_")}
    summary.update(context.scores["baseline"].get("divergence") or {})  # top_k and the tail mass it leaves out
    summary["reference_cached"] = context.reference_cached
    metrics.update(candidate=summary, protocol=_protocol(context, len(candidate["window_nll"])))
    return metrics, window_checks(context, candidate, ("kl",)) + _domain_checks(context, "kl")

"""A run's perplexity passes, kept beside its checkpoint so that ``compress gate`` on that checkpoint judges the numbers
the run printed instead of scoring its own first windows: one ratio and one interval per checkpoint.

``<run>/perplexity-passes.json`` holds both sides' per-window NLL (the candidate's per-window KL and same-top share in
its ``divergence``) and what they were measured on: the baseline's folder and fingerprint, the checkpoint's
fingerprint, the evaluation text (its source and the sha256 of its token ids), ``seq_len``, the window count and the
KL's ``top_k`` (``"full"`` under ``gate.kl.full_vocab``). The gate uses them only when all of that matches its own
inputs; otherwise it measures as before and says why in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.base.data import token_digest
from compress.base.staging import write_file_atomically
from compress.evals.divergence import model_fingerprint

PASSES_FILE = "perplexity-passes.json"
FORMAT = "compress-run-passes/1"
STORED_BY = "run (stored passes)"  # how gate.md names who measured them


def passes_path(checkpoint: Path) -> Path:
    """Where a run keeps its passes: in the run folder, beside ``checkpoint``."""
    return Path(checkpoint).parent / PASSES_FILE


def kl_vocabulary(policy) -> int | str:
    """What the KL of a pass was computed over, as stored under ``top_k``: the baseline's top-k tokens (k), or
    ``"full"`` under ``gate.kl.full_vocab``; the gate uses a run's passes only under the same."""
    return "full" if policy.kl.full_vocab else policy.kl.top_k


def write_passes(
    checkpoint: Path,
    baseline_folder: Path | str | None,
    token_ids: torch.Tensor,
    source: str,
    seq_len: int,
    top_k: int | str | None,
    passes: dict[str, dict],
) -> Path:
    """Store ``passes`` (``{"baseline": ..., "candidate": ...}``, ``PerplexityResult.to_dict()``) beside the saved
    ``checkpoint``, written aside and renamed: a killed run never leaves a torn file under the final name, and the run
    folder it sits in is itself published by rename (``compress.app.rundir``)."""
    baseline = Path(baseline_folder) if baseline_folder is not None else None
    data = {
        "format": FORMAT,
        "baseline": {"path": str(baseline), "fingerprint": model_fingerprint(baseline) if baseline else None},
        "checkpoint": {"fingerprint": model_fingerprint(Path(checkpoint))},
        "evaluation": {"source": source, "tokens": int(token_ids.numel()), "token_sha256": token_digest(token_ids)},
        "seq_len": seq_len,
        "windows": len(passes["candidate"]["window_nll"]),
        "top_k": top_k,
        "passes": passes,
    }
    path = passes_path(checkpoint)
    write_file_atomically(path, lambda temporary: temporary.write_text(json.dumps(data)))
    return path


@dataclass
class StoredPasses:
    """What ``compress gate`` found beside a checkpoint: the passes to judge (``measured``) or why not (``reason``)."""

    path: Path
    measured: dict[str, dict] | None = None
    reason: str | None = None  # one line: why the stored passes were not used (None when there were none)
    windows: int = 0
    seq_len: int = 0

    def line(self) -> str | None:
        """The one line the gate command prints about them, if any."""
        if self.measured is not None:
            return (
                f"gate: judging the run's stored passes ({self.path}): {self.windows} windows of {self.seq_len} "
                "tokens, the ratio and interval the run printed"
            )
        if self.reason is not None:
            return f"gate: measuring both sides anew, not the run's stored passes ({self.path}): {self.reason}"
        return None


def find_passes(checkpoint: Path | str, baseline_folder: Path | None, token_ids: torch.Tensor, policy) -> StoredPasses:
    """The run's stored passes for a gate of ``policy`` (a ``GatePolicy``) on ``checkpoint`` against the baseline in
    ``baseline_folder``, on ``token_ids``: used only when the checkpoint is unchanged, the baseline, the evaluation
    text and the protocol are the gate's own, and the run scored at least the windows this gate would."""
    path = passes_path(Path(checkpoint).expanduser())
    found = StoredPasses(path)
    if not Path(checkpoint).expanduser().is_dir() or not path.is_file():
        return found
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        mismatch = _mismatch(data, Path(checkpoint).expanduser(), baseline_folder, token_ids, policy)
    except (OSError, ValueError, KeyError, TypeError) as error:
        found.reason = f"unreadable ({type(error).__name__}: {error})"
        return found
    if mismatch is not None:
        found.reason = mismatch
        return found
    found.measured = {side: data["passes"][side] for side in ("baseline", "candidate")}
    found.windows, found.seq_len = data["windows"], data["seq_len"]
    return found


def windows_needed(token_ids: torch.Tensor, policy) -> int:
    """How many windows the gate itself would score: its first look, or ``gate.decide``'s cap."""
    available = int(token_ids.numel()) // policy.perplexity.seq_len
    first = min(policy.perplexity.max_windows or available, available)
    return min(policy.perplexity.decide_max_windows or available, available) if policy.decide else first


def _mismatch(data: dict, checkpoint: Path, baseline_folder, token_ids, policy) -> str | None:
    """Why the stored passes are not this gate's (one line), or None when they are."""
    fingerprint = model_fingerprint(checkpoint)
    if fingerprint is None or data["checkpoint"]["fingerprint"] != fingerprint:
        return "the checkpoint's files changed since the run scored it"
    baseline = model_fingerprint(Path(baseline_folder)) if baseline_folder is not None else None
    if baseline is None or data["baseline"]["fingerprint"] != baseline:
        return f"the run's baseline was {data['baseline']['path']}, not {baseline_folder or 'a local folder'}"
    seq_len = policy.perplexity.seq_len
    if data["seq_len"] != seq_len:
        return f"the run scored windows of {data['seq_len']} tokens, gate.perplexity.seq_len={seq_len}"
    evaluation = data["evaluation"]
    if evaluation["token_sha256"] != token_digest(token_ids):
        return (
            f"the run scored another evaluation text ({evaluation['source']}, {evaluation['tokens']} tokens; "
            f"this gate's has {int(token_ids.numel())}): set gate.data to the run's eval.data"
        )
    needed = windows_needed(token_ids, policy)
    if data["windows"] < needed:
        return f"the run scored {data['windows']} windows, this gate scores {needed}"
    if "kl" in policy.layers and policy.kl.enabled:
        divergence = data["passes"]["candidate"].get("divergence") or {}
        if "window_kl" not in divergence:
            return "the run measured no KL (its gate had no KL layer)"
        if data["top_k"] != kl_vocabulary(policy):
            kept = "whole distributions" if data["top_k"] == "full" else f"top {data['top_k']} tokens"
            wanted = "gate.kl.full_vocab=true" if policy.kl.full_vocab else f"gate.kl.top_k={policy.kl.top_k}"
            return f"the run's KL kept the baseline's {kept}, {wanted}"
    return None

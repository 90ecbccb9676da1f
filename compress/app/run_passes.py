"""The run's perplexity passes: the baseline (recording its top-k distributions when the gate judges the KL), the
candidate from its checkpoint (its KL from the baseline measured in the same pass) and the RTN reference, all on the
same windows of the headline evaluation text (``compress.evals.perplexity``), which comes from another source than the
calibration data; the gate judges these numbers instead of measuring again. The baseline and the candidate are also
scored on the calibration source's held-out split, reported beside the headline as the in-domain figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from compress.app.run_config import RunConfig
from compress.app.stored_passes import kl_vocabulary, write_passes
from compress.app.tracking import RunLog, record_verdict
from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint
from compress.compression.in_memory import compress_model
from compress.evals.divergence import DivergenceMeter, FullReference
from compress.evals.gate.windows import keep_reference, reference_recorder
from compress.evals.perplexity import PerplexityResult, can_stream, stored_model_perplexity
from compress.model.sources import load, resolve_model_path
from compress.stages import Stage
from compress.stages.rtn import rtn_reference


@dataclass
class EvaluationText:
    """One evaluation text of a run: where it comes from, its pieces (what the gate reads) and their token ids."""

    source: str
    texts: list[str]
    ids: torch.Tensor
    in_domain: bool  # the calibration source's held-out split: flattering, so never the headline when another exists

    def describe(self) -> dict:
        return {"source": self.source, "tokens": int(self.ids.numel()), "in_domain": self.in_domain}


class RunEvaluation:
    """One run's passes on the headline text, in ``results`` by name (``baseline``, ``candidate``,
    ``rtn_reference``), and on the in-domain text, when it is another one, in ``in_domain_results``."""

    def __init__(
        self, config: RunConfig, headline: EvaluationText, in_domain: EvaluationText | None, device: torch.device
    ):
        self.config, self.headline, self.in_domain, self.device = config, headline, in_domain, device
        self.eval_ids = headline.ids
        self.results: dict[str, PerplexityResult] = {}
        self.in_domain_results: dict[str, PerplexityResult] = {}
        protocol = (config.eval.seq_len, config.eval.max_windows)
        self.recorder = reference_recorder(config.gate, self.eval_ids, *protocol) if config.eval.perplexity else None

    def baseline(self, model: torch.nn.Module) -> None:
        self.results["baseline"] = self._evaluate(model, "perplexity [baseline]", observer=self.recorder)
        if self.recorder is not None:  # a later `compress gate` against this model on this text reuses it
            folder = resolve_model_path(self.config.model)
            keep_reference(self.config.gate, folder, self.eval_ids, self.config.eval.seq_len, self.recorder)
        self._in_domain("baseline", model)

    def candidate(self, checkpoint: Path) -> None:
        model, _ = load_checkpoint(checkpoint)
        meter = None
        if self.recorder is not None:  # a full-vocabulary reference is read as it is, a top-k one as its tensors
            full = isinstance(self.recorder, FullReference)
            meter = DivergenceMeter(self.recorder if full else self.recorder.tensors())
        self.results["candidate"] = self._evaluate(model, f"perplexity [{self.config.recipe}]", observer=meter)
        self._store(checkpoint)
        self._in_domain("candidate", model)

    def _store(self, checkpoint: Path) -> None:
        """Both sides' passes beside the checkpoint, with what they were measured on: ``compress gate`` on this
        checkpoint then judges these numbers (``compress.app.stored_passes``), and prints the ratio this run prints."""
        if "baseline" not in self.results:
            return
        passes = {side: self.results[side].to_dict() for side in ("baseline", "candidate")}
        top_k = kl_vocabulary(self.config.gate) if self.recorder is not None else None
        folder = resolve_model_path(self.config.model)
        write_passes(checkpoint, folder, self.eval_ids, self.headline.source, self.config.eval.seq_len, top_k, passes)

    def _in_domain(self, side: str, model: torch.nn.Module) -> None:
        if self.in_domain is not None:
            label = f"perplexity [{side}, in-domain {self.in_domain.source}]"
            self.in_domain_results[side] = self._evaluate(model, label, ids=self.in_domain.ids)

    def rtn_reference(self, stages: list[Stage], samples: torch.Tensor) -> None:
        """Round-to-nearest with the recipe's weight scheme, streamed on the CPU: each layer quantized on a copy as
        the evaluation reads it, so neither the quantized model nor its dense layers exist whole."""
        model, _ = load(self.config.model)
        rtn = rtn_reference(stages)
        streams = self.device.type == "cpu" and can_stream(model)
        quantized = rtn.quantized_copies(model) if streams else None
        if quantized is None:  # rank 0 alone, data-parallel or not: RTN needs no collective
            compress_model(model, [rtn], samples, self.device, 1)
        self.results["rtn_reference"] = self._evaluate(model, "perplexity [rtn]", transform=quantized)

    def _evaluate(self, model, label: str, ids: torch.Tensor | None = None, **options) -> PerplexityResult:
        """``options``: a layer ``transform`` (the streamed RTN reference), an ``observer`` (the gate's KL); ``ids``:
        another text than the headline one."""
        protocol = (self.config.eval.seq_len, self.config.eval.batch_size, self.config.eval.max_windows)
        ids = self.eval_ids if ids is None else ids
        try:
            return stored_model_perplexity(model, ids, *protocol, label=label, device=self.device, **options)
        except FloatingPointError as error:
            raise CompressError(str(error)) from error


def release_gate(config: RunConfig, staging: Path, final: Path, run_log: RunLog | None, report: dict, texts) -> dict:
    """The release gate on the saved checkpoint against the original model, judging the run's own perplexity passes
    of both sides (``report``) instead of measuring again; its verdict is recorded in this run's MLflow store (the
    same ``tracking.uri``) under ``gate.*`` and a pass registers ``runs:/<run>/checkpoint``."""
    from compress.evals.gate import run_gate

    verdict = run_gate(
        staging / "checkpoint", resolve_model_path(config.model), config.gate, staging / "gate",
        evaluation_texts=texts, candidate_label=str(final / "checkpoint"),
        measured=_measured(report),
    )  # fmt: skip
    if run_log is not None:
        record_verdict(run_log, verdict, verdict.files, staging / "checkpoint", own_run=False)
    return {
        "passed": verdict.passed, "verdict": verdict.verdict, "headline": verdict.headline(), "roles": verdict.roles(),
        "reasons": verdict.reasons, "report": str(final / "gate" / "gate.md"), "registry": verdict.registry,
    }  # fmt: skip


def _measured(report: dict) -> dict | None:
    """The run's perplexity passes of the baseline and the candidate, when it made both: what the gate judges."""
    passes = {side: report["perplexity"].get(side) for side in ("baseline", "candidate")}
    return passes if all(passes.values()) else None

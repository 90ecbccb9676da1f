"""The run's perplexity passes: the baseline (recording its top-k distributions when the gate judges the KL), the
candidate from its checkpoint (its KL from the baseline measured in the same pass) and the RTN reference, all on the
same windows of the evaluation text (``compress.evals.perplexity``). The gate judges these numbers instead of measuring
again.
"""

from __future__ import annotations

from pathlib import Path

import torch

from compress.checkpoint import load_checkpoint
from compress.compression import compress_model
from compress.config import RunConfig
from compress.errors import CompressError
from compress.evals.divergence import DivergenceMeter
from compress.evals.gate.windows import keep_reference, reference_recorder
from compress.evals.perplexity import PerplexityResult, can_stream, stored_model_perplexity
from compress.models import load, resolve_model_path
from compress.stages import Stage
from compress.stages.rtn import rtn_reference


class RunEvaluation:
    """One run's passes, in ``results`` by name (``baseline``, ``candidate``, ``rtn_reference``)."""

    def __init__(self, config: RunConfig, eval_ids: torch.Tensor, device: torch.device):
        self.config, self.eval_ids, self.device = config, eval_ids, device
        self.results: dict[str, PerplexityResult] = {}
        protocol = (config.eval.seq_len, config.eval.max_windows)
        self.recorder = reference_recorder(config.gate, eval_ids, *protocol) if config.eval.perplexity else None

    def baseline(self, model: torch.nn.Module) -> None:
        self.results["baseline"] = self._evaluate(model, "perplexity [baseline]", observer=self.recorder)
        if self.recorder is not None:  # a later `compress gate` against this model on this text reuses it
            folder = resolve_model_path(self.config.model)
            keep_reference(self.config.gate, folder, self.eval_ids, self.config.eval.seq_len, self.recorder)

    def candidate(self, checkpoint: Path) -> None:
        model, _ = load_checkpoint(checkpoint)
        meter = DivergenceMeter(self.recorder.tensors()) if self.recorder is not None else None
        self.results["candidate"] = self._evaluate(model, f"perplexity [{self.config.recipe}]", observer=meter)

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

    def _evaluate(self, model, label: str, **options) -> PerplexityResult:
        """``options``: a layer ``transform`` (the streamed RTN reference), an ``observer`` (the gate's KL)."""
        protocol = (self.config.eval.seq_len, self.config.eval.batch_size, self.config.eval.max_windows)
        try:
            return stored_model_perplexity(model, self.eval_ids, *protocol, label=label, device=self.device, **options)
        except FloatingPointError as error:
            raise CompressError(str(error)) from error

"""The baseline's pass over a calibration text, scored once and cached: its per-window NLL and its top-k reference
(what every candidate's KL is read against).

Every ``benchmarks/gate_calibration.py`` scoring run needs the baseline's reference, which is not kept in the results
JSON (1200 windows hold ~160 MB of top-32 log-probabilities). Scoring the baseline again costs as much as one more
checkpoint (15 minutes for 1200 windows on the 2-core machine); the cache lets a run score only its candidates. It is
the gate's own reference cache (``compress.evals.divergence``), keyed by the model folder's fingerprint, the text's
token ids, the window length and top-k, in its own folder, with the per-window NLL stored beside the reference.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from compress.evals.divergence import ReferenceRecorder, load_reference, reference_path, save_reference
from compress.evals.perplexity import stored_model_perplexity

NLL = "window_nll"


def baseline_pass(model: torch.nn.Module, model_folder: Path, ids: torch.Tensor, windows: int, seq_len: int, top_k: int,
                  cache_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:  # fmt: skip
    """``(baseline row, reference)`` for the first ``windows`` windows of ``ids``: from the cache when it holds that
    many windows of this model on this text, else scored and cached."""
    path = reference_path(cache_dir, model_folder, ids, seq_len, top_k)
    start = time.perf_counter()
    cached = load_reference(path, windows)
    if cached is not None and NLL in cached:
        window_nll = cached.pop(NLL).tolist()
        row = {"perplexity": math.exp(math.fsum(window_nll) / len(window_nll)), "window_nll": window_nll,
               "cached_reference": str(path)}  # fmt: skip
        return {**row, "seconds": time.perf_counter() - start}, cached
    recorder = ReferenceRecorder(windows, seq_len - 1, top_k)
    base = stored_model_perplexity(model, ids, seq_len, 4, windows, label="baseline",
                                   device=torch.device("cpu"), observer=recorder)  # fmt: skip
    reference = recorder.tensors()
    if path is not None:
        nll = torch.tensor(base.window_nll, dtype=torch.float64)
        save_reference(path, {**reference, NLL: nll}, {"windows": str(windows), "seq_len": str(seq_len)})
    row = {"perplexity": base.perplexity, "window_nll": base.window_nll}
    return {**row, "seconds": time.perf_counter() - start}, reference

"""KL divergence of a candidate's next-token distributions from the baseline's, measured in the perplexity pass.

Perplexity only looks at the probability of the token that came next; two models can agree on it and still disagree
on everything else they predict. The measure llama.cpp's perplexity tool reports for quantized models is the mean
KL divergence KL(baseline ‖ candidate) over every scored position, its upper percentiles, and how often both models
rank the same token first. We compute the same statistics:

- The baseline pass (:class:`ReferenceRecorder`) keeps, per scored position, the ``top_k`` largest log-probabilities
  with their token ids and the log-probability of the actual next token, in fp32, in a safetensors file keyed by the
  model's files, the evaluation tokens and the protocol (:func:`reference_path`), so a second gate against the same
  baseline neither recomputes it nor holds the baseline model.
- The candidate pass (:class:`DivergenceMeter`) reads it and computes, per position, the KL divergence of the
  distributions coarse-grained onto the baseline's top-k tokens plus one "rest of the vocabulary" bucket.
- ``gate.kl.full_vocab``: the exact full-vocabulary KL instead, as llama.cpp computes it. The baseline's pass keeps
  every position's whole distribution (:class:`FullReference`, fp16, in a temporary file on disk: 1.6 GB for 32
  windows, too much to cache across gates) and the candidate's pass reads it, in the gate's order of work unchanged.

Error of the top-k truncation: coarse-graining can only lose divergence (the log-sum inequality), so the figure is a
lower bound of the full-vocabulary KL, exact when the candidate scales the baseline's tail uniformly. The baseline's
tail mass beyond the top-k is reported (``reference_tail_mass``) and, with ``top_k=32`` on the default model, the
measured gap to the full KL is in docs/gate.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.base.data import token_digest
from compress.base.errors import CompressError
from compress.base.staging import write_file_atomically

TOP_K = 32
FORMAT = "compress-reference-v1"
PERCENTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
SUMMARY_CONFIDENCE = 0.95  # the reported statistics' intervals; the gate's checks read theirs at the gate's level


class ReferenceRecorder:
    """The baseline side: the top of every scored position's distribution and the target's log-probability."""

    def __init__(self, windows: int, positions: int, top_k: int = TOP_K, first_window: int = 0):
        self.first_window = first_window
        self.indices = torch.zeros(windows, positions, top_k, dtype=torch.int32)
        self.logprobs = torch.full((windows, positions, top_k), -torch.inf)
        self.target_logprob = torch.zeros(windows, positions)

    def observe(self, logits: torch.Tensor, window: torch.Tensor, position: torch.Tensor, target: torch.Tensor):
        logprobs = F.log_softmax(logits.float(), dim=-1)
        top = logprobs.topk(self.indices.shape[-1], dim=-1)
        rows, position = (window - self.first_window).cpu(), position.cpu()
        self.indices[rows, position] = top.indices.to(torch.int32).cpu()
        self.logprobs[rows, position] = top.values.cpu()
        self.target_logprob[rows, position] = logprobs.gather(1, target[:, None])[:, 0].cpu()

    def summary(self) -> dict:
        return reference_summary(self.tensors())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"indices": self.indices, "logprobs": self.logprobs, "target_logprob": self.target_logprob}


def reference_summary(reference: dict[str, torch.Tensor]) -> dict:
    """What the baseline's pass reports: how many tokens it keeps per position and the mass beyond them."""
    tail = 1 - reference["logprobs"].exp().sum(-1)
    return {"top_k": reference["indices"].shape[-1], "reference_tail_mass": float(tail.clamp_min(0).double().mean())}


class FullReference:
    """The baseline side under ``gate.kl.full_vocab``: the whole next-token distribution of every scored position,
    as fp16 log-probabilities (32 windows × 511 × 49152 × 2 bytes = 1.6 GB on the default model), too much to keep in
    memory beside a model or to cache across gates. They go to an unlinked temporary file in ``directory``,
    memory-mapped: the page cache holds what fits and the disk the rest, so the candidate's pass reads them with
    one model in memory or two, and the file is gone with this object or the process. fp16 rounding is renormalized
    when read (:meth:`logprobs_at`): the KL stays one of two distributions."""

    def __init__(self, windows: int, positions: int, first_window: int = 0, directory: Path | None = None):
        self.shape = (windows, positions)
        self.first_window = first_window
        self.directory = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        self.logprobs: torch.Tensor | None = None  # (windows, positions, vocab), made at the first logits seen
        self.top = torch.zeros(windows, positions, dtype=torch.long)  # argmax in fp32: fp16 rounding may tie two
        self.target_logprob = torch.zeros(windows, positions)

    def observe(self, logits: torch.Tensor, window: torch.Tensor, position: torch.Tensor, target: torch.Tensor):
        logprobs = F.log_softmax(logits.float(), dim=-1)
        if self.logprobs is None:
            self.logprobs = scratch_tensor((*self.shape, logprobs.shape[-1]), torch.float16, self.directory)
        rows, position = (window - self.first_window).cpu(), position.cpu()
        self.logprobs[rows, position] = logprobs.half().cpu()
        self.top[rows, position] = logprobs.argmax(-1).cpu()
        self.target_logprob[rows, position] = logprobs.gather(1, target[:, None])[:, 0].cpu()

    def logprobs_at(self, rows: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        stored = self.logprobs[rows, position].float()
        return stored - stored.logsumexp(-1, keepdim=True)

    def summary(self) -> dict:
        return {"full_vocab": True}


def scratch_tensor(shape: tuple[int, ...], dtype: torch.dtype, directory: Path) -> torch.Tensor:
    """A tensor backed by a temporary file in ``directory`` whose name is removed at once (the mapping keeps it),
    after checking the disk has room for all of it: a sparse file filling the disk midway would crash the process."""
    size = math.prod(shape) * dtype.itemsize
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if size > free:
        raise CompressError(
            f"gate.kl.full_vocab=true keeps the baseline's whole distributions on disk while the candidate is scored: "
            f"{size / 1e9:.1f} GB here, but {directory} has {free / 1e9:.1f} GB free: point gate.cache_dir at a disk "
            "with room, score fewer windows (gate.perplexity.max_windows, decide_max_windows), or set "
            "gate.kl.full_vocab=false (the cached top-k reference)"
        )
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".full-vocab-", suffix=".tmp") as file:
        file.truncate(size)
        tensor = torch.from_file(file.name, shared=True, size=math.prod(shape), dtype=dtype)
    return tensor.view(shape)


class DivergenceMeter:
    """The candidate side: per scored position, KL(baseline ‖ candidate) (over the reference's top-k plus the rest,
    or over the whole vocabulary from a :class:`FullReference`), whether both rank the same token first, and the
    change in the probability of the actual next token."""

    def __init__(self, reference: dict[str, torch.Tensor] | FullReference, first_window: int = 0):
        self.reference = reference
        full = isinstance(reference, FullReference)
        windows, positions = reference.shape if full else reference["indices"].shape[:2]
        self.first_window = first_window
        self.top_k = None if full else reference["indices"].shape[-1]
        self.kl = torch.full((windows, positions), torch.nan)
        self.same_top = torch.zeros(windows, positions, dtype=torch.bool)
        self.delta_p = torch.zeros(windows, positions)
        self.seen = torch.zeros(windows, positions, dtype=torch.bool)

    def observe(self, logits: torch.Tensor, window: torch.Tensor, position: torch.Tensor, target: torch.Tensor):
        rows, position = (window - self.first_window).cpu(), position.cpu()
        if rows.max() >= len(self.kl) or position.max() >= self.kl.shape[1]:
            raise ValueError("the candidate scored windows the baseline's reference does not hold")
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        if isinstance(self.reference, FullReference):
            self.kl[rows, position] = full_kl(self.reference.logprobs_at(rows, position), logprobs)
            reference_top = self.reference.top[rows, position]
            reference_target = self.reference.target_logprob[rows, position]
        else:
            indices = self.reference["indices"][rows, position].long()
            reference_logprobs = self.reference["logprobs"][rows, position]
            self.kl[rows, position] = coarse_kl(reference_logprobs, logprobs.gather(1, indices))
            reference_top, reference_target = indices[:, 0], self.reference["target_logprob"][rows, position]
        self.same_top[rows, position] = logprobs.argmax(-1) == reference_top
        candidate_target = logprobs.gather(1, target.cpu()[:, None])[:, 0]
        self.delta_p[rows, position] = candidate_target.exp() - reference_target.exp()
        self.seen[rows, position] = True

    def summary(self) -> dict:
        """Per-window means (the gate's items) and llama.cpp's statistics: the token-level distribution of the KL
        (mean, percentiles, max; the mean's interval is the gate's KL check), the mean Δp of the actual next token
        and the same-top share, each with a plain Student-t interval at ``SUMMARY_CONFIDENCE`` over per-window means,
        not over tokens: the tokens of one window are correlated, so llama.cpp's standard error over tokens is too
        narrow."""
        from compress.evals.gate.stats import mean_interval  # the gate's package imports this module

        scored = self.seen.all(dim=1)
        kl, same_top, delta_p = self.kl[scored], self.same_top[scored].double(), self.delta_p[scored].double()
        tokens = kl.flatten().double()
        quantiles = torch.quantile(tokens, torch.tensor(PERCENTILES, dtype=torch.float64)).tolist()
        window_kl, window_same_top = kl.double().mean(1).tolist(), same_top.mean(1).tolist()
        window_delta_p = delta_p.mean(1).tolist()
        same_top_interval = mean_interval(window_same_top, SUMMARY_CONFIDENCE)
        delta_p_interval = mean_interval(window_delta_p, SUMMARY_CONFIDENCE)
        return {
            "kl_vocabulary": "full" if self.top_k is None else f"top-{self.top_k} plus the rest",
            "kl_mean": float(tokens.mean()),
            "kl_max": float(tokens.max()),
            **{f"kl_p{percentile * 100:g}": value for percentile, value in zip(PERCENTILES, quantiles, strict=True)},
            "same_top": float(same_top.mean()),
            "same_top_low": same_top_interval.low,
            "same_top_high": same_top_interval.high,
            "delta_p_mean": float(delta_p.mean()),
            "delta_p_low": delta_p_interval.low,
            "delta_p_high": delta_p_interval.high,
            "summary_confidence": SUMMARY_CONFIDENCE,
            "window_kl": window_kl,
            "window_same_top": window_same_top,
            "window_delta_p": window_delta_p,
            "tokens": int(tokens.numel()),
        }


def full_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) per row over the whole vocabulary, from both models' log-probabilities (a token P gives no mass
    adds nothing, even where Q's log-probability is −inf)."""
    p = reference.exp()
    return torch.where(p > 0, p * (reference - candidate), torch.zeros_like(p)).sum(-1).clamp_min(0)


def coarse_kl(reference_top: torch.Tensor, candidate_top: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) per row over the ``k`` tokens of P's top-k (log-probabilities of both models there) plus one bucket
    for the rest of the vocabulary: a lower bound of the full KL (the log-sum inequality)."""
    p = reference_top.exp()
    top_terms = (p * (reference_top - candidate_top)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - candidate_top.exp().sum(-1)).clamp_min(1e-12)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (top_terms + rest).clamp_min(0)


def model_fingerprint(folder: Path) -> str | None:
    """Names, sizes and modification times of a model folder's files plus its config: cheap, and changes whenever
    the weights are rewritten. None for anything that is not a local folder (no cache then)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.suffix in {".safetensors", ".json", ".bin", ".gguf"}:
            stat = file.stat()
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    return digest.hexdigest()


def reference_path(
    cache_dir: Path, model_folder: Path | None, token_ids: torch.Tensor, seq_len: int, top_k: int = TOP_K
) -> Path | None:
    """Where the reference of this model on these tokens under this protocol is cached; None when the model has no
    folder to fingerprint."""
    fingerprint = model_fingerprint(model_folder) if model_folder is not None else None
    if fingerprint is None:
        return None
    key = [FORMAT, fingerprint, token_digest(token_ids), seq_len, top_k]
    key = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"{key}.safetensors"


def load_reference(path: Path | None, windows: int) -> dict[str, torch.Tensor] | None:
    """The cached reference if it holds at least ``windows`` windows (the first ``windows`` of them), else None."""
    from safetensors.torch import load_file

    if path is None or not path.is_file():
        return None
    try:
        tensors = load_file(path)
    except Exception:  # a torn or foreign file is a cache miss, recomputed and replaced
        return None
    if len(tensors.get("indices", ())) < windows:
        return None
    return {name: tensor[:windows] for name, tensor in tensors.items()}


def save_reference(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Written whole or not at all: a killed gate or a full disk never leaves a torn reference under the final name,
    nor a temporary beside it in the cache."""
    import safetensors.torch

    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, lambda staged: safetensors.torch.save_file(contiguous, staged, metadata=metadata))

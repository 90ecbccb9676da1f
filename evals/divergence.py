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

Error of the top-k truncation: coarse-graining can only lose divergence (the log-sum inequality), so the figure is a
lower bound of the full-vocabulary KL, exact when the candidate scales the baseline's tail uniformly. The baseline's
tail mass beyond the top-k is reported (``reference_tail_mass``) and, with ``top_k=32`` on the default model, the
measured gap to the full KL is in docs/gate.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.base.data import token_digest
from compress.base.staging import write_file_atomically

TOP_K = 32
FORMAT = "compress-reference-v1"
PERCENTILES = (0.5, 0.9, 0.95, 0.99, 0.999)


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


class DivergenceMeter:
    """The candidate side: per scored position, KL(baseline ‖ candidate) over the reference's top-k plus the rest,
    whether both rank the same token first, and the change in the probability of the actual next token."""

    def __init__(self, reference: dict[str, torch.Tensor], first_window: int = 0):
        self.reference = reference
        windows, positions, _ = reference["indices"].shape
        self.first_window = first_window
        self.kl = torch.full((windows, positions), torch.nan)
        self.same_top = torch.zeros(windows, positions, dtype=torch.bool)
        self.delta_p = torch.zeros(windows, positions)
        self.seen = torch.zeros(windows, positions, dtype=torch.bool)

    def observe(self, logits: torch.Tensor, window: torch.Tensor, position: torch.Tensor, target: torch.Tensor):
        rows, position = (window - self.first_window).cpu(), position.cpu()
        if rows.max() >= len(self.kl) or position.max() >= self.kl.shape[1]:
            raise ValueError("the candidate scored windows the baseline's reference does not hold")
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        indices = self.reference["indices"][rows, position].long()
        reference_logprobs = self.reference["logprobs"][rows, position]
        self.kl[rows, position] = coarse_kl(reference_logprobs, logprobs.gather(1, indices))
        self.same_top[rows, position] = logprobs.argmax(-1) == indices[:, 0]
        reference_target = self.reference["target_logprob"][rows, position]
        candidate_target = logprobs.gather(1, target.cpu()[:, None])[:, 0]
        self.delta_p[rows, position] = candidate_target.exp() - reference_target.exp()
        self.seen[rows, position] = True

    def summary(self) -> dict:
        """Per-window means (the gate's items) and the token-level distribution of the KL."""
        scored = self.seen.all(dim=1)
        kl, same_top, delta_p = self.kl[scored], self.same_top[scored].float(), self.delta_p[scored]
        tokens = kl.flatten()
        quantiles = torch.quantile(tokens.double(), torch.tensor(PERCENTILES, dtype=torch.float64)).tolist()
        return {
            "kl_mean": float(tokens.double().mean()),
            "kl_max": float(tokens.max()),
            **{f"kl_p{percentile * 100:g}": value for percentile, value in zip(PERCENTILES, quantiles, strict=True)},
            "same_top": float(same_top.double().mean()),
            "delta_p_mean": float(delta_p.double().mean()),
            "window_kl": kl.double().mean(1).tolist(),
            "window_same_top": same_top.double().mean(1).tolist(),
            "tokens": int(tokens.numel()),
        }


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

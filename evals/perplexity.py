"""Perplexity protocol used everywhere in compress (reports, gate, benchmarks), so numbers compare across runs.

Protocol: the evaluation split is tokenized as one stream without special tokens and cut into non-overlapping windows
of ``seq_len`` tokens (the incomplete tail is dropped); every window is scored independently from its first token;
perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens (``seq_len - 1`` per window).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens: int
    windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def evaluation_windows(token_ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    count = token_ids.numel() // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(f"evaluation text has {token_ids.numel()} tokens, fewer than one window of {seq_len}")
    return token_ids[: count * seq_len].view(count, seq_len)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    batch_size: int = 4,
    max_windows: int | None = None,
    label: str = "perplexity",
    progress: bool = True,
) -> PerplexityResult:
    """Token-level perplexity of ``model`` on ``token_ids`` (1-D) under the protocol above."""
    windows = evaluation_windows(token_ids, seq_len, max_windows)
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc=label, unit="batch", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        logits = model(input_ids=batch).logits
        # window by window: [:, :-1].reshape copied the batch's logits and the loss took a log-softmax of all of
        # them at once (vocab x tokens x 4 bytes each: +1.9 GB at batch 4 on the default model)
        nll = sum(
            F.cross_entropy(logits[row, :-1].float(), batch[row, 1:], reduction="sum") for row in range(len(batch))
        )
        if not torch.isfinite(nll):
            raise FloatingPointError(f"{label}: the model produced non-finite logits (NaN/inf) on window {start}")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    mean_nll = total_nll / total_tokens
    return PerplexityResult(math.exp(mean_nll), mean_nll, total_tokens, len(windows), seq_len)

"""Next-token choice for a batch of rows with per-request settings: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import torch

from compress.engine.sequence import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the ``top_k`` largest logits and the ``top_p`` probability nucleus."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # probability mass ranked above each token
        logits = logits.scatter(-1, order, ordered.masked_fill(before >= top_p, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``; a seeded request draws from its own generator, so its
    output does not depend on what else is in the batch."""
    tokens = logits.argmax(-1).tolist()
    for row, (param, generator) in enumerate(zip(params, generators, strict=True)):
        if param.temperature == 0:
            continue
        row_logits = filter_logits(logits[row].float().cpu() / param.temperature, param.top_k, param.top_p)
        tokens[row] = int(torch.multinomial(row_logits.softmax(-1), 1, generator=generator))
    return tokens

"""Perplexity protocol used everywhere in compress (reports, gate, benchmarks), so numbers compare across runs.

Protocol: the evaluation split is tokenized as one stream without special tokens and cut into non-overlapping windows
of ``seq_len`` tokens (the incomplete tail is dropped); every window is scored independently from its first token;
perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens (``seq_len - 1`` per window).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    window_nll = _scorer(model, windows[:1, :HEAD_CHUNK].to(device))
    total_nll, total_tokens = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc=label, unit="batch", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        nll = window_nll(batch)
        if not torch.isfinite(nll):
            raise FloatingPointError(f"{label}: the model produced non-finite logits (NaN/inf) on window {start}")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    mean_nll = total_nll / total_tokens
    return PerplexityResult(math.exp(mean_nll), mean_nll, total_tokens, len(windows), seq_len)


HEAD_CHUNK = 256  # positions whose logits exist at once when the output head runs apart from the decoder


def _scorer(model: torch.nn.Module, probe: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The summed next-token NLL of a batch of windows. Run whole, a batch's logits are its tokens × vocab floats
    (4 × 512 × 49152 × 4 bytes = 403 MB on the default model; 1.2 GB with a 152k vocabulary), the largest block of
    an evaluation's memory. Where the model is a decoder plus an output head, the head runs on ``HEAD_CHUNK``
    positions at a time instead; that split is used only if it gives the full forward's logits on ``probe``."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    config = model.config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma-2/3

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).float()
        return torch.tanh(logits / cap) * cap if cap else logits

    def chunked(batch: torch.Tensor) -> torch.Tensor:
        hidden = decoder(input_ids=batch).last_hidden_state[:, :-1].flatten(0, 1)
        targets = batch[:, 1:].flatten()
        nll = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, len(targets), HEAD_CHUNK):
            logits = logits_of(hidden[start : start + HEAD_CHUNK])
            nll += F.cross_entropy(logits, targets[start : start + HEAD_CHUNK], reduction="sum")
        return nll

    def whole(batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch).logits
        # window by window: [:, :-1].reshape copied the batch's logits and the loss took a log-softmax of all of
        # them at once (vocab x tokens x 4 bytes each: +1.9 GB at batch 4 on the default model)
        return sum(
            F.cross_entropy(logits[row, :-1].float(), batch[row, 1:], reduction="sum") for row in range(len(batch))
        )

    if decoder is None or decoder is model or head is None:
        return whole
    try:
        split = logits_of(decoder(input_ids=probe).last_hidden_state)
    except (TypeError, AttributeError):  # a decoder that is not a transformers base model
        return whole
    reference = model(input_ids=probe).logits.float()
    return chunked if torch.allclose(split, reference, rtol=1e-4, atol=1e-4) else whole

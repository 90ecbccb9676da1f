"""Perplexity protocol used everywhere in compress (reports, gate, benchmarks), so numbers compare across runs.

Protocol: the evaluation split is tokenized as one stream without special tokens and cut into non-overlapping windows
of ``seq_len`` tokens (the incomplete tail is dropped); every window is scored independently from its first token
(which a Gemma model sees replaced by its ``<bos>``: ``compress.base.data.window_start_token``);
perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens (``seq_len - 1`` per window).
Each window's mean NLL is kept too (``window_nll``): the gate's interval is over per-window differences. An
``observer`` (``compress.evals.divergence``) sees every position's logits in the same pass: the baseline's top of the
distribution is recorded there, and the candidate's KL divergence from it measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from compress.base.data import open_with, window_start_token
from compress.base.errors import CompressError


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens: int
    windows: int
    seq_len: int
    window_nll: list[float] = field(default_factory=list)  # mean NLL of each window, in window order
    first_window: int = 0  # index of the first scored window in the text's window sequence
    divergence: dict | None = None  # the observer's summary (the candidate's KL from the baseline), if any

    def to_dict(self) -> dict:
        return asdict(self)


class Observer(Protocol):
    """Sees the logits of every scored position, once, during a perplexity pass."""

    def observe(self, logits: torch.Tensor, window: torch.Tensor, position: torch.Tensor, target: torch.Tensor): ...

    def summary(self) -> dict | None: ...


def evaluation_windows(
    token_ids: torch.Tensor, seq_len: int, max_windows: int | None = None, first_window: int = 0
) -> torch.Tensor:
    """Windows ``first_window`` .. ``first_window + max_windows - 1`` of the text (all that remain if None)."""
    count = token_ids.numel() // seq_len - first_window
    if max_windows is not None:
        count = min(count, max_windows)
    if count <= 0:
        raise ValueError(
            f"evaluation text has {token_ids.numel()} tokens: no window of {seq_len} tokens from window {first_window}"
        )
    return token_ids[first_window * seq_len : (first_window + count) * seq_len].view(count, seq_len)


def _model_windows(
    model: torch.nn.Module, token_ids: torch.Tensor, seq_len: int, max_windows: int | None, first_window: int
) -> torch.Tensor:
    """The windows as ``model`` reads them: opening with its ``<bos>`` where its family needs one."""
    windows = evaluation_windows(token_ids, seq_len, max_windows, first_window)
    return open_with(windows, window_start_token(model.config))


def available_windows(token_ids: torch.Tensor, seq_len: int) -> int:
    return token_ids.numel() // seq_len


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    batch_size: int = 4,
    max_windows: int | None = None,
    label: str = "perplexity",
    progress: bool = True,
    observer: Observer | None = None,
    first_window: int = 0,
) -> PerplexityResult:
    """Token-level perplexity of ``model`` on ``token_ids`` (1-D) under the protocol above."""
    windows = _model_windows(model, token_ids, seq_len, max_windows, first_window)
    device = next(model.parameters()).device
    window_nll = _scorer(model, windows[:1, :HEAD_CHUNK].to(device))
    sums = []
    for start in tqdm(range(0, len(windows), batch_size), desc=label, unit="batch", disable=not progress):
        nll = window_nll(windows[start : start + batch_size].to(device), observer, first_window + start)
        if not torch.isfinite(nll).all():
            raise FloatingPointError(f"{label}: the model produced non-finite logits (NaN/inf) on window {start}")
        sums.append(nll.cpu())
    return _result(torch.cat(sums), windows, first_window, observer)


def _result(
    window_sums: torch.Tensor, windows: torch.Tensor, first_window: int, observer: Observer | None
) -> PerplexityResult:
    """The protocol's summary of the per-window summed NLL over every predicted token of ``windows``."""
    tokens, per_window = windows[:, 1:].numel(), windows.shape[1] - 1
    total_nll = float(window_sums.double().sum())
    return PerplexityResult(
        math.exp(total_nll / tokens), total_nll / tokens, tokens, len(windows), windows.shape[1],
        window_nll=(window_sums.double() / per_window).tolist(), first_window=first_window,
        divergence=observer.summary() if observer is not None else None,
    )  # fmt: skip


@torch.no_grad()
def streamed_perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    batch_size: int = 4,
    max_windows: int | None = None,
    label: str = "perplexity",
    progress: bool = True,
    transform: Callable[[int, torch.nn.Module], torch.nn.Module] | None = None,
    observer: Observer | None = None,
    first_window: int = 0,
) -> PerplexityResult:
    """:func:`perplexity` of a lazily loaded model (``compress.model.sources.load``) on the CPU, computed layer by
    layer: every window goes through decoder layer 0, then all of them through layer 1, and so on, each layer read from
    disk and dropped again. It holds one layer and the windows' hidden states (28k tokens × 576 × 4 bytes = 66 MB on the
    default model) instead of the whole model, and leaves the model lazy for the compression walk after it.
    ``transform(index, layer)``, when given, is what runs instead of each layer as read (a quantized copy of it: the
    perplexity of a compression that needs no calibration, without ever holding the compressed model).

    A model already in memory (not lazy, or lazy with layers read and perhaps compressed in place) is evaluated in
    the same layer-major order, its layers kept: a whole-model forward per batch left ~300 MB more in the heap
    (measured on the default model's int4 checkpoint, same perplexity to the last digit)."""
    from compress.base.memory import release_freed_memory
    from compress.model.layer_walk import capture_first_layer_inputs, decoder_layers, fp32_compute, run_layer
    from compress.model.lazy_weights import materialize_layer, release_layer

    windows = _model_windows(model, token_ids, seq_len, max_windows, first_window)
    head, cap = model.get_output_embeddings(), _softcap(model)
    layers = decoder_layers(model)
    reread = can_stream(model)  # lazy and untouched: every layer is read, used and dropped
    with fp32_compute(model):
        inputs = capture_first_layer_inputs(model, windows, batch_size, torch.device("cpu"))
        for index in tqdm(range(len(layers)), desc=label, unit="layer", disable=not progress):
            materialize_layer(model, index)
            layer = layers[index] if transform is None else transform(index, layers[index])
            try:
                inputs = run_layer(layer, inputs, f"{label}: layer {index}")
            except CompressError as error:
                raise FloatingPointError(f"{label}: the model produced non-finite values (NaN/inf) ({error})") from None
            del layer
            if reread:
                release_layer(model, index)
            release_freed_memory()  # else freed layers (lazy: +900 MB at the end) and hidden states stay in the heap
        sums = []
        for start, hidden in zip(range(0, len(windows), batch_size), inputs.hidden, strict=True):
            batch = windows[start : start + batch_size]
            sums.append(_head_nll(model.model.norm(hidden), batch, head, cap, observer, first_window + start))
            release_freed_memory()  # the head's 25 MB logit chunks, else +316 MB in the heap by the last batch
    window_sums = torch.cat(sums)
    if not torch.isfinite(window_sums).all():
        raise FloatingPointError(f"{label}: the model produced non-finite logits (NaN/inf)")
    return _result(window_sums, windows, first_window, observer)


def stored_model_perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    batch_size: int,
    max_windows: int | None,
    *,
    label: str,
    device: torch.device,
    transform: Callable[[int, torch.nn.Module], torch.nn.Module] | None = None,
    observer: Observer | None = None,
) -> PerplexityResult:
    """Perplexity of a model as ``compress`` stores it (lazily loaded, compressed, any dtype), the way a run reports
    it. On CPU a 16-bit model computes in fp32, one layer widened at a time, so that CPU numbers stay comparable across
    source dtypes (measured on the default model: bf16 compute moved perplexity +0.10%, bf16 storage with fp32 compute
    −0.03%), and the evaluation goes layer by layer (:func:`streamed_perplexity`: a lazily loaded model is read
    and dropped a layer at a time, through ``transform`` if given); on a GPU the model runs whole in its own dtype."""
    from compress.base.memory import release_freed_memory
    from compress.model.layer_walk import fp32_compute
    from compress.model.lazy_weights import materialize_all

    release_freed_memory()  # what the run's previous step freed goes back to the OS before this one allocates
    if device.type == "cpu" and _decoder_with_head(model):
        return streamed_perplexity(
            model, token_ids, seq_len, batch_size, max_windows, label, transform=transform, observer=observer
        )
    if transform is not None:
        raise ValueError(f"{label}: a layer transform needs a decoder with a final norm and head, on the CPU")
    materialize_all(model)
    model.to(device)
    try:
        with fp32_compute(model) if device.type == "cpu" else nullcontext():
            return perplexity(model, token_ids, seq_len, batch_size, max_windows, label=label, observer=observer)
    finally:
        model.to("cpu")


def resident_perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    batch_size: int = 4,
    max_windows: int | None = None,
    label: str = "perplexity",
    progress: bool = True,
    observer: Observer | None = None,
    first_window: int = 0,
) -> PerplexityResult:
    """Perplexity of a model in memory, left where it is (the gate's sides): on the CPU layer by layer in fp32, as
    :func:`stored_model_perplexity` scores it; on a GPU (or for a model without a final norm and head) whole."""
    score = (
        streamed_perplexity
        if next(model.parameters()).device.type == "cpu" and _decoder_with_head(model)
        else perplexity
    )
    return score(
        model, token_ids, seq_len, batch_size, max_windows, label=label, progress=progress, observer=observer,
        first_window=first_window,
    )  # fmt: skip


def can_stream(model: torch.nn.Module) -> bool:
    """Whether :func:`streamed_perplexity` reads this model from disk a layer at a time and drops each again: a lazily
    loaded decoder with no layer read yet (a layer already in memory may have been compressed in place: the file no
    longer holds it), whose logits are its final norm and output head (soft-capped or not), as every family
    ``compress`` supports has them."""
    weights = getattr(model, "lazy_weights", None)
    return weights is not None and not weights.loaded and _decoder_with_head(model)


def _decoder_with_head(model: torch.nn.Module) -> bool:
    """Whether the logits are the final norm and output head applied to the decoder stack's output."""
    inner = getattr(model, "model", None)
    return isinstance(getattr(inner, "norm", None), torch.nn.Module) and model.get_output_embeddings() is not None


HEAD_CHUNK = 128  # positions whose logits (and log-softmax) exist at once: 2 x 25 MB on the default model; 256 cost
# 50 MB more at every perplexity peak, and 64 ran 27% slower


def _softcap(model: torch.nn.Module) -> float | None:
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)  # Gemma-2/3


def _logits(hidden: torch.Tensor, head: torch.nn.Module, cap: float | None) -> torch.Tensor:
    logits = head(hidden).float()
    return torch.tanh(logits / cap) * cap if cap else logits


def _head_nll(
    hidden: torch.Tensor,
    batch: torch.Tensor,
    head: torch.nn.Module,
    cap: float | None,
    observer: Observer | None = None,
    first_window: int = 0,
) -> torch.Tensor:
    """Summed next-token NLL of each window of ``batch`` from its final hidden states, the head run on
    ``HEAD_CHUNK`` positions at a time; ``observer`` sees each chunk's logits."""
    per_window = batch.shape[1] - 1
    hidden, targets = hidden[:, :-1].flatten(0, 1), batch[:, 1:].flatten()
    nll = hidden.new_zeros(len(batch), dtype=torch.float32)
    for start in range(0, len(targets), HEAD_CHUNK):
        logits = _logits(hidden[start : start + HEAD_CHUNK], head, cap)
        flat = torch.arange(start, start + len(logits), device=logits.device)
        chunk_targets = targets[start : start + HEAD_CHUNK]
        nll.index_add_(0, flat // per_window, F.cross_entropy(logits, chunk_targets, reduction="none"))
        if observer is not None:
            observer.observe(logits, first_window + flat // per_window, flat % per_window, chunk_targets)
    return nll


def _scorer(model: torch.nn.Module, probe: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The summed next-token NLL of each window of a batch. Run whole, a batch's logits are its tokens × vocab floats
    (4 × 512 × 49152 × 4 bytes = 403 MB on the default model; 1.2 GB with a 152k vocabulary), the largest block of
    an evaluation's memory. Where the model is a decoder plus an output head, the head runs on ``HEAD_CHUNK``
    positions at a time instead; that split is used only if it gives the full forward's logits on ``probe``."""
    decoder, head, cap = model.get_decoder(), model.get_output_embeddings(), _softcap(model)

    def chunked(batch: torch.Tensor, observer: Observer | None, first_window: int) -> torch.Tensor:
        return _head_nll(decoder(input_ids=batch).last_hidden_state, batch, head, cap, observer, first_window)

    def whole(batch: torch.Tensor, observer: Observer | None, first_window: int) -> torch.Tensor:
        logits = model(input_ids=batch).logits
        # window by window: [:, :-1].reshape copied the batch's logits and the loss took a log-softmax of all of
        # them at once (vocab x tokens x 4 bytes each: +1.9 GB at batch 4 on the default model)
        sums = []
        for row in range(len(batch)):
            row_logits, targets = logits[row, :-1].float(), batch[row, 1:]
            sums.append(F.cross_entropy(row_logits, targets, reduction="sum"))
            if observer is not None:
                positions = torch.arange(len(targets), device=targets.device)
                observer.observe(row_logits, torch.full_like(positions, first_window + row), positions, targets)
        return torch.stack(sums)

    if decoder is None or decoder is model or head is None:
        return whole
    try:
        split = _logits(decoder(input_ids=probe).last_hidden_state, head, cap)
    except (TypeError, AttributeError):  # a decoder that is not a transformers base model
        return whole
    reference = model(input_ids=probe).logits.float()
    return chunked if torch.allclose(split, reference, rtol=1e-4, atol=1e-4) else whole

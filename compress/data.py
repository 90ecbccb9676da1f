"""Text corpora, their deterministic calibration/evaluation split, and calibration samples.

Every source (CPython's ``pydoc_data`` topics by default, a local .txt/.jsonl file, or a ``datasets`` hub name) is cut
into pieces of a few thousand characters at paragraph boundaries; each piece goes to the evaluation split when the
hash of its text falls below ``eval_fraction``. The split depends on content alone, so it is the same on every
machine and in every run, and no text is in both splits.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.errors import CompressError

log = logging.getLogger(__name__)

PIECE_CHARS = 2000


@dataclass
class DataSpec:
    """What ``recipes/data/*.yaml`` configures."""

    source: str = "pydoc"  # pydoc | file | hf
    path: str | None = None  # local .txt / .jsonl for source=file
    name: str | None = None  # datasets name for source=hf
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    eval_fraction: float = 0.2
    num_samples: int = 64
    seq_len: int = 512


@dataclass
class Corpus:
    calibration: list[str]
    evaluation: list[str]

    @property
    def calibration_text(self) -> str:
        return "\n\n".join(self.calibration)

    @property
    def evaluation_text(self) -> str:
        return "\n\n".join(self.evaluation)


def _pydoc_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise CompressError(
            f"data file {path} is not UTF-8 text (line {line}, byte {error.start}: {error.reason}); convert it, "
            f"e.g. `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`"
        ) from None


def _file_documents(path: Path, text_field: str) -> list[str]:
    if not path.is_file():
        raise CompressError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        documents = []
        for number, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CompressError(f"{path}:{number} is not valid JSON: {error.msg}") from error
            if not isinstance(record, dict) or text_field not in record:
                raise CompressError(f"{path}:{number} has no field {text_field!r}; set data.text_field=<field>")
            documents.append(str(record[text_field]))
        return documents
    return [_read_text(path)]


def _hub_documents(spec: DataSpec) -> list[str]:
    import datasets

    try:
        dataset = datasets.load_dataset(spec.name, spec.subset, split=spec.split)
    except Exception as error:  # datasets raises many types for "not found / offline"
        raise CompressError(f"cannot load dataset {spec.name!r} (split {spec.split!r}): {error}") from error
    if spec.text_field not in dataset.column_names:
        raise CompressError(
            f"dataset {spec.name!r} has no column {spec.text_field!r}; columns: {dataset.column_names}; "
            "set data.text_field=<column>"
        )
    return [str(text) for text in dataset[spec.text_field]]


def documents(spec: DataSpec) -> list[str]:
    if spec.source == "pydoc":
        return _pydoc_documents()
    if spec.source == "file":
        if not spec.path:
            raise CompressError("data.source=file needs data.path=<file.txt|file.jsonl>")
        return _file_documents(Path(spec.path).expanduser(), spec.text_field)
    if spec.source == "hf":
        if not spec.name:
            raise CompressError("data.source=hf needs data.name=<dataset name>")
        return _hub_documents(spec)
    raise CompressError(f"data.source={spec.source!r} is unknown; use pydoc, file or hf")


def pieces(document: str, max_chars: int = PIECE_CHARS) -> list[str]:
    """Cut at blank lines into pieces of at most ``max_chars`` (a longer paragraph stays whole)."""
    out, current = [], ""
    for paragraph in document.split("\n\n"):
        if current and len(current) + len(paragraph) + 2 > max_chars:
            out.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current.strip():
        out.append(current)
    return [piece for piece in out if piece.strip()]


def _in_evaluation(piece: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256(piece.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def load_corpus(spec: DataSpec) -> Corpus:
    """Split ``spec``'s text into disjoint calibration and evaluation pieces."""
    import datasets

    if not 0.0 < spec.eval_fraction < 1.0:
        raise CompressError(f"data.eval_fraction={spec.eval_fraction} must be between 0 and 1")
    all_pieces = [piece for document in documents(spec) for piece in pieces(document)]
    table = datasets.Dataset.from_dict({"text": all_pieces})
    table = table.map(lambda row: {"evaluation": _in_evaluation(row["text"], spec.eval_fraction)})
    corpus = Corpus(
        calibration=table.filter(lambda row: not row["evaluation"])["text"],
        evaluation=table.filter(lambda row: row["evaluation"])["text"],
    )
    if not corpus.calibration:
        raise CompressError(f"the calibration split of data source {spec.source!r} is empty: give more text")
    if not corpus.evaluation:
        raise CompressError(
            f"the evaluation split of data source {spec.source!r} is empty: give more text or raise data.eval_fraction"
        )
    return corpus


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """One token stream, without special tokens, so windows never begin with a spurious BOS."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def calibration_samples(token_ids: torch.Tensor, num_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[num_samples, seq_len]`` non-overlapping windows of the calibration stream, chosen by ``seed``."""
    if num_samples < 1 or seq_len < 2:
        raise CompressError(f"data.num_samples={num_samples} and data.seq_len={seq_len} must be ≥1 and ≥2")
    available = token_ids.numel() // seq_len
    if available == 0:
        raise CompressError(
            f"the calibration text has {token_ids.numel()} tokens, fewer than one window of data.seq_len={seq_len}"
        )
    if available < num_samples:
        log.warning(
            "calibration text holds %d windows of %d tokens; using all of them, not %d", available, seq_len, num_samples
        )
        num_samples = available
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:num_samples]
    windows = token_ids[: available * seq_len].view(available, seq_len)
    return windows[order.sort().values]

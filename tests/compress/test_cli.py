"""End to end through the real CLI on a tiny model: Hydra recipe → stages → checkpoint → perplexity → MLflow."""

import json
import os
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from compress.__main__ import main
from compress.base.data import load_corpus

SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=3", "stages.0.group_size=32"]
FAST = [*SMALL, "gate=none"]  # the release gate has its own test below


def test_awq_run_writes_checkpoint_report_and_mlflow(tiny_model_dir, artifacts, capsys):
    args = [*FAST, "stages.0.grid=4", "eval.reference=rtn"]  # the RTN reference is asked for, not a default
    assert main(["run", "recipe=awq_int4", f"model={tiny_model_dir}", *args]) == 0
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["perplexity"]) == {"baseline", "candidate", "rtn_reference"}
    assert report["checkpoint"]["quantized_linears"] == 14
    assert (run_dir / "checkpoint" / "recipe.yaml").read_text().startswith("recipe: awq_int4")
    assert "grid: 4" in (run_dir / "checkpoint" / "config.yaml").read_text()
    summary = (run_dir / "report.md").read_text()
    assert "| candidate |" in summary
    awq = "stage 0:awq: AWQ: activation-aware scales (grid 4, duo scaling both), then GPTQ (true-sequential, "
    assert f"{awq}act-order, Hessian-weighted clipping search), int4 sym g32" in summary
    assert report["data"]["generated_tokens"] == report["data"]["calibration_tokens"] == 4 * 64  # data: sampled
    calibration = json.loads((run_dir / "checkpoint" / "calibration.json").read_text())
    assert calibration["windows"] == 4 and calibration["seq_len"] == 64 and len(calibration["token_sha256"]) == 64
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint")  # what a user of transformers would do
    assert "perplexity" in capsys.readouterr().out

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("compress").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["stages.0.type"] == "awq" and run.data.params["stages.0.group_size"] == "32"
    assert run.data.metrics["ppl_candidate"] == pytest.approx(report["perplexity"]["candidate"]["perplexity"])
    assert run.data.tags["compress.run_dir"] == str(run_dir)


def test_multirun_sweep_composes_each_job_once(tiny_model_dir, artifacts, monkeypatch):
    """Each job's configuration is composed once, checked, and that object runs: no second composition by Hydra."""
    from hydra._internal.hydra import Hydra

    compositions = []
    compose_config = Hydra.compose_config

    def counting(self, config_name, overrides, *args, **kwargs):
        compositions.append(list(overrides))
        return compose_config(self, config_name, overrides, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counting)
    args = [
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *FAST,
        "stages.0.bits=3,4",
        "-m",
        "tracking.enabled=false",
    ]
    assert main(args) == 0
    reports = [json.loads((d / "report.json").read_text()) for d in (artifacts / "runs").iterdir()]
    assert sorted(r["checkpoint"]["bits_per_weight"] for r in reports) == [4.0, 5.0]  # 3/4 bits + fp32 scale / 32
    assert len(compositions) == 2, compositions  # one per job
    assert sorted(next(o for o in job if o.startswith("stages.0.bits")) for job in compositions) == [
        "stages.0.bits=3",
        "stages.0.bits=4",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recipe=awq_int5"], "unknown recipe 'awq_int5'; available: autoround_int3, autoround_int4, awq_int4"),
        (["recipe=awq_int4", "stages.0.gruop_size=64"], "unknown key 'gruop_size' (did you mean 'group_size'?)"),
        (["recipe=awq_int4", "eval.seqlen=64"], "eval: unknown key 'seqlen' (did you mean 'seq_len'?)"),
        (["recipe=awq_int4", "gate=strictest"], "gate=strictest is not a known option"),
        (["recipe=awq_int4", "model=./no/such/model"], "model path ./no/such/model does not exist"),
    ],
)
def test_bad_input_gives_one_clear_error_and_no_output(args, message, artifacts, capsys):
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (artifacts / "runs").exists() or not any((artifacts / "runs").iterdir())


@pytest.mark.usefixtures("default_mlflow_store")
def test_empty_calibration_text_fails_cleanly(tiny_model_dir, artifacts, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["run", "recipe=rtn_int4", f"model={tiny_model_dir}", f"data={empty}", *FAST]) == 2
    assert "calibration split of data source 'file' is empty" in capsys.readouterr().err
    assert not (artifacts / "runs").exists() or not any((artifacts / "runs").iterdir())  # no staging folder left


@pytest.mark.usefixtures("default_mlflow_store")
def test_unknown_dataset_fails_before_the_model_loads(artifacts, capsys):
    assert main(["run", "recipe=rtn_int4", "data=no-such-dataset", *FAST]) == 2
    assert "cannot load dataset 'no-such-dataset'" in capsys.readouterr().err
    assert not (artifacts / "models").exists()  # the default model was never converted for a doomed run


@pytest.mark.usefixtures("default_mlflow_store")
def test_corrupt_model_weights_fail_cleanly(tiny_model_dir, artifacts, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_model_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["run", "recipe=rtn_int4", f"model={broken}", *FAST]) == 2
    assert "model.safetensors is corrupt or truncated" in capsys.readouterr().err
    assert not (artifacts / "runs").exists() or [p for p in (artifacts / "runs").iterdir()] == []


@pytest.mark.usefixtures("default_mlflow_store")
@pytest.mark.parametrize(("max_ratio", "enforce", "code"), [(100.0, True, 0), (0.5, False, 0), (0.5, True, 1)])
def test_run_ends_with_the_release_gate(tiny_model_dir, artifacts, max_ratio, enforce, code, monkeypatch):
    """A block fails the command only with gate.enforce=true; the report records the verdict either way. The corpus
    is read once: the gate gets the evaluation texts the run scored."""
    from compress.app import pipeline

    reads = []
    monkeypatch.setattr(pipeline, "load_corpus", lambda spec: reads.append(spec) or load_corpus(spec))
    args = [
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *SMALL,
        "gate=quick",
        "gate.layers=[perplexity]",
        f"gate.perplexity.max_ratio={max_ratio}",
        "gate.registry.register=false",
        f"gate.enforce={enforce}",
    ]
    assert main(args) == code
    assert [spec.source for spec in reads] == ["pydoc", "shakespeare"]  # each corpus read once
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    passed = max_ratio > 1
    assert report["gate"]["passed"] is passed
    assert "gate" in report["timings_s"]
    verdict = (run_dir / "gate" / "gate.md").read_text()
    assert ("perplexity" in verdict) and ((not passed) == ("# Release gate: BLOCKED" in verdict))


def test_rtn_reference_without_an_integer_quantizer_fails_before_work(tiny_model_dir, artifacts, capsys):
    args = ["run", "recipe=fp8_dynamic", f"model={tiny_model_dir}", *SMALL[:-1], "gate=none", "eval.reference=rtn"]
    assert main(args) == 2
    assert "eval.reference=rtn needs an integer weight quantizer" in capsys.readouterr().err
    assert not (artifacts / "runs").exists() or not any((artifacts / "runs").iterdir())


@pytest.mark.parametrize(
    ("command", "expected"),
    [("gate", "checkpoint=(required)"), ("generate", "max_tokens=64"), ("compare", "limit=200")],
)
def test_help_lists_every_key_with_its_default(command, expected, capsys):
    assert main([command, "--help"]) == 0
    assert expected in capsys.readouterr().out


def test_cfg_job_prints_each_composed_job_and_runs_nothing(tiny_model_dir, artifacts, capsys):
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", "stages.0.bits=3,4", "--cfg", "job", "-m"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "# stages.0.bits=3\nrecipe: rtn_int4\n" in out and "# stages.0.bits=4\n" in out
    assert "  bits: 3\n" in out and "  bits: 4\n" in out
    assert not (artifacts / "runs").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("hydra/launcher=joblib", "hydra/launcher=joblib is not a known launcher; available: basic, submitit_local"),
        ("hydra.run.dir=out", "hydra.run.dir=out: jobs are composed by compress, so Hydra's settings do not apply"),
        ("hydra.launcher.partition=gpu", "hydra.launcher.* options need hydra/launcher=submitit_local or"),
    ],
)
def test_hydra_settings_other_than_the_launcher_are_one_line(override, message, capsys):
    assert main(["run", "recipe=rtn_int4", override, "stages.0.bits=3,4", "-m"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}")


def test_bad_submitit_parameter_fails_before_any_job(tiny_model_dir, artifacts, capsys):
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", "hydra/launcher=submitit_local", "-m"]
    assert main([*args, "stages.0.bits=3,4", "hydra.launcher.gpus_per_nodes=1"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: hydra/launcher=submitit_local: ")
    assert "gpus_per_nodes" in errors[0] and not (artifacts / "runs").exists()


def test_submitit_local_sweep_runs_each_composed_job_in_its_own_process(tiny_model_dir, artifacts, monkeypatch, capsys):
    """The parent composes both jobs; each runs in a submitit job process of its own and its outcome comes back."""
    root = Path(__file__).parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *FAST, "stages.0.bits=3,4", "-m"]
    assert (
        main([*args, "tracking.enabled=false", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"]) == 0
    )
    reports = [json.loads((d / "report.json").read_text()) for d in (artifacts / "runs").iterdir()]
    assert sorted(r["checkpoint"]["bits_per_weight"] for r in reports) == [4.0, 5.0]
    out = capsys.readouterr().out
    assert "sweep: 2 of 2 jobs ran" in out and "#0 stages.0.bits=3: run folder: " in out
    [logs] = (artifacts / "sweeps").iterdir()
    job_pids = {int(p.name.split("_")[0]) for p in (logs / ".submitit").glob("*/*_log.out")}
    assert len(job_pids) == 2 and os.getpid() not in job_pids  # two job processes, not this one


def test_the_console_script_is_declared_and_runs():
    """`compress run ...` after install: pyproject's script points at the same `main` as `python -m compress`, and
    the installed script (the Makefile's editable install puts it beside the venv's python) prints the commands."""
    import subprocess
    import sys
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["compress"] == "compress.__main__:main"
    script = Path(sys.executable).parent / "compress"
    if not script.is_file():
        pytest.skip(f"no installed console script at {script}: reinstall with `pip install -e .`")
    shown = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "usage: compress <command>" in shown.stdout and "search" in shown.stdout

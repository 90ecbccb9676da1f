"""The `run` command's configuration through the real CLI: one schema checked before any work, one error line,
no traceback, nothing left behind; the release gate's exit code; sweeps that run every job.

The commands run in this process (``compress.__main__.main``, what ``python -m compress`` calls): a process of its
own would cost more than each check; test_lifecycle runs ``python -m compress run`` as a real process."""

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from compress.__main__ import main
from compress.app.run_config import build_run_config, check_evaluation_length
from compress.base.errors import CompressError

REPO = Path(__file__).resolve().parents[2]
TINY_RUN = [
    "data.num_samples=2",
    "data.seq_len=32",
    "eval.seq_len=32",
    "eval.max_windows=2",
    "stages.0.group_size=32",
    "tracking.enabled=false",
]
BLOCKING_GATE = [
    "gate=quick",
    "gate.layers=[perplexity]",
    "gate.perplexity.max_ratio=0.5",
    "gate.perplexity.seq_len=32",
    "gate.perplexity.max_windows=2",
    "gate.registry.register=false",
]


@pytest.fixture
def compress_cli(monkeypatch, capfd) -> Callable[..., subprocess.CompletedProcess]:
    """``python -m compress <args>`` with ``$COMPRESS_ARTIFACTS=artifacts``: its exit code and what it wrote to
    stdout and stderr (log records included, as the command's own ``basicConfig`` handler would write them)."""

    def run(*args: str, artifacts: Path) -> subprocess.CompletedProcess:
        monkeypatch.setenv("COMPRESS_ARTIFACTS", str(artifacts))
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        monkeypatch.chdir(REPO)
        capfd.readouterr()
        handler = logging.StreamHandler(sys.stderr)  # pytest's handlers on the root logger make basicConfig a no-op
        logging.getLogger().addHandler(handler)
        try:
            code = main(list(args))
        finally:
            logging.getLogger().removeHandler(handler)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def assert_one_error_line(result: subprocess.CompletedProcess, message: str, code: int = 2) -> None:
    """One ``error:`` line and the table's code: 2 for bad input, 4 for a place that cannot be written."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == code, result.stderr[-2000:]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def leftovers(artifacts: Path) -> list[Path]:
    """Run folders and hidden staging folders a failed command must not leave."""
    return [
        path
        for folder in ("runs", "sweeps")
        if (artifacts / folder).exists()
        for path in (artifacts / folder).iterdir()
    ]


@pytest.fixture
def bad_utf8_file(tmp_path) -> Path:
    path = tmp_path / "latin1.txt"
    path.write_bytes(("Grüße aus Köln.\n\n" * 50).encode("latin-1"))
    return path


@pytest.fixture
def remote_code_model(tiny_model_dir, tmp_path) -> Path:
    """The tiny model, with a config that asks for its own Python code (as hub models with `auto_map` do)."""
    folder = tmp_path / "remote-code"
    folder.mkdir()
    for file in tiny_model_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="my_custom",
        auto_map={"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_my.py").write_text(
        "from transformers import LlamaConfig\n\nclass MyConfig(LlamaConfig):\n    model_type = 'my_custom'\n"
    )
    return folder


def tiny_config(tiny_model_dir: Path, **sections) -> dict:
    """A composed run configuration as Hydra hands it over, with ``sections`` merged in."""
    composed = {
        "recipe": "rtn_int4",
        "stages": [{"type": "rtn", "bits": 4, "group_size": 32}],
        "model": {"path": str(tiny_model_dir)},
        "data": {},
        "gate": {"enabled": False},
    }
    for name, values in sections.items():
        composed[name] = {**composed.get(name, {}), **values} if isinstance(values, dict) else values
    return composed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["output.save_dtype=int8"],
            "output.save_dtype='int8' is not supported; use one of float16, bfloat16, "
            "float32 (or null to keep the model's dtype)",
        ),
        (["stages.0.bits=five"], "stages.0.bits='five' has the wrong type: give an integer"),
        (["data.num_samples=eight"], "data.num_samples='eight' has the wrong type: give an integer"),
        (["gate.perplexity.max_ratoi=2"], "gate.perplexity: unknown key 'max_ratoi' (did you mean 'max_ratio'?)"),
        (["device=gpu"], "device='gpu' is unknown; use auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_configuration_fails_in_the_first_check(tiny_model_dir, tmp_path, overrides, message, compress_cli):
    artifacts = tmp_path / "artifacts"
    result = compress_cli(
        "run", "recipe=rtn_int4", f"model={tiny_model_dir}", *TINY_RUN, *overrides, artifacts=artifacts
    )
    assert_one_error_line(result, message)
    assert not artifacts.exists()  # nothing was created: no run folder, no MLflow store, no converted model


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"data": {"num_samples": 0}}, "data.num_samples=0 must be ≥ 1"),
        ({"data": {"seq_len": 1}}, "data.seq_len=1 must be ≥ 2"),
        ({"eval": {"batch_size": -2}}, "eval.batch_size=-2 must be ≥ 1"),
        ({"eval": {"max_windows": 0}}, "eval.max_windows=0 must be ≥ 1"),
        ({"calibration_batch_size": 0}, "calibration_batch_size=0 must be ≥ 1"),
        ({"data": {"eval_fraction": 1.5}}, "data.eval_fraction=1.5 must be between 0 and 1"),
        (
            {"data": {"source": "web"}},
            "data.source='web' is unknown; use pydoc, shakespeare, python_code, python_docstrings, file, hf",
        ),
        (
            {"eval": {"seq_len": 4096}},
            "eval.seq_len=4096 is longer than the model's context (512 tokens); set eval.seq_len≤512",
        ),
        ({"data": {"seq_len": 1024}}, "data.seq_len=1024 is longer than the model's context"),
        ({"output": {"save_dtype": "int8"}}, "output.save_dtype='int8' is not supported"),
        ({"output": {"run_name": "a/b"}}, "output.run_name='a/b' names a folder"),
        ({"output": {"run_name": ".hidden"}}, "output.run_name='.hidden' names a folder"),
        ({"gate": {"layers": ["perplexity", "lmeval"]}}, "gate.layers has unknown layers ['lmeval']"),
        ({"gate": {"engine": {"block_sise": 16}}}, "gate.engine: unknown key 'block_sise' (did you mean"),
        ({"gate": {"engine": {"block_size": 24}}}, "gate.engine: block_size=24 must be a power of two"),
        ({"stages": [{"type": "gptq", "dampening": 2.0}]}, "stages.0 (gptq): dampening=2.0 must be in (0, 1]"),
        ({"stages": [{"type": "rtn", "bits": "four"}]}, "stages.0.bits='four' has the wrong type: give an integer"),
        ({"stages": [{"type": "rtn", "bitz": 4}]}, "stages.0 (rtn): unknown key 'bitz' (did you mean 'bits'?)"),
    ],
)
def test_values_the_types_cannot_check_are_checked_before_work(tiny_model_dir, sections, message):
    with pytest.raises(CompressError) as error:
        build_run_config(tiny_config(tiny_model_dir, **sections))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_valid_configuration_passes(tiny_model_dir):
    config = build_run_config(tiny_config(tiny_model_dir, output={"save_dtype": "bfloat16", "run_name": "w4-g32.v2"}))
    assert config.output.save_dtype == "bfloat16" and config.stages[0]["bits"] == 4


def test_unwritable_output_dir_fails_before_work(tiny_model_dir, tmp_path, compress_cli):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    result = compress_cli(
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *TINY_RUN,
        f"output.dir={not_a_folder}/runs",
        artifacts=tmp_path / "artifacts",
    )
    assert_one_error_line(result, f"output.dir: cannot write run folders under {not_a_folder}/runs", code=4)
    assert not (tmp_path / "artifacts").exists()


def test_every_job_of_a_sweep_is_checked_before_the_first_starts(tiny_model_dir, tmp_path, compress_cli):
    artifacts = tmp_path / "artifacts"
    result = compress_cli(
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *TINY_RUN,
        "gate=none",
        "eval.batch_size=1,0",
        "-m",
        artifacts=artifacts,
    )
    assert_one_error_line(result, "eval.batch_size=0 must be ≥ 1")
    assert not artifacts.exists()  # job 0 was valid, yet it did not run


def test_non_utf8_data_file_is_one_line(tiny_model_dir, bad_utf8_file, tmp_path, compress_cli):
    artifacts = tmp_path / "artifacts"
    result = compress_cli(
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        f"data={bad_utf8_file}",
        *TINY_RUN,
        "gate=none",
        artifacts=artifacts,
    )
    assert_one_error_line(result, f"data file {bad_utf8_file} is not UTF-8 text (line 1, byte 2")
    assert "iconv -f latin1 -t utf-8" in result.stderr
    assert leftovers(artifacts) == []


def test_model_with_its_own_code_names_our_key(remote_code_model, tmp_path, compress_cli):
    artifacts = tmp_path / "artifacts"
    result = compress_cli(
        "run", "recipe=rtn_int4", f"model={remote_code_model}", *TINY_RUN, "gate=none", artifacts=artifacts
    )
    assert_one_error_line(result, "set model.trust_remote_code=true if you trust its source")
    assert "trust_remote_code=True" not in result.stderr  # transformers' Python argument is not our CLI
    assert leftovers(artifacts) == []


@pytest.mark.parametrize(
    ("arguments", "message", "code"),
    [
        (["prompt=hi", "temprature=0"], "unknown key 'temprature' (did you mean 'temperature'?)", 2),
        (["prompt=hi"], "missing checkpoint=...; usage: python -m compress generate", 2),
        (["prompt=hi", "max_tokens=abc"], "max_tokens='abc': give an integer", 2),
        (["prompt=hi", "stream=yes"], "stream='yes': give true or false", 2),
        (["prompt=hi", "temperature=-1"], "need temperature >= 0", 2),
        (["prompt=hi", "kv_cache_dtype=int4"], "kv_cache_dtype='int4': choose auto or one of", 2),
        (["prompt=hi", "checkpoint=/no/such/checkpoint"], "checkpoint=/no/such/checkpoint: no config.json there", 2),
        (["prompt=hi", "max_tokens=5000"], "exceeds max_model_len=512", 2),
    ],
)
def test_generate_bad_arguments_are_one_line(tiny_model_dir, tmp_path, arguments, message, code, compress_cli):
    if not any(argument.startswith("checkpoint=") for argument in arguments) and "missing" not in message:
        arguments = [*arguments, f"checkpoint={tiny_model_dir}"]
    result = compress_cli("generate", *arguments, artifacts=tmp_path / "artifacts")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == code, result.stderr[-2000:]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_blocked_gate_ends_green_unless_enforced_and_the_gate_command_still_fails(
    tiny_model_dir, tmp_path, compress_cli, empty_mlflow_db
):
    """`make run`'s first command must end green: the block is reported, the exit code is 0; the `gate` command
    (what CI calls) exits 1 on the same block."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shutil.copy(empty_mlflow_db, artifacts / "mlflow.db")  # the gate command's default store (making one: test_cli)
    result = compress_cli(
        "run", "recipe=rtn_int4", f"model={tiny_model_dir}", *TINY_RUN, *BLOCKING_GATE, artifacts=artifacts
    )
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("release gate: BLOCKED — ") and "(this is the gate working; see README" in last
    [run_dir] = (artifacts / "runs").iterdir()
    assert json.loads((run_dir / "report.json").read_text())["gate"]["passed"] is False

    gate = compress_cli(
        "gate",
        f"checkpoint={run_dir / 'checkpoint'}",
        f"baseline={tiny_model_dir}",
        "gate=quick",
        *BLOCKING_GATE[1:],
        "gate.enforce=false",
        f"out={tmp_path / 'gate'}",
        artifacts=artifacts,
    )
    assert gate.returncode == 1, gate.stderr[-3000:]
    assert "release gate: BLOCKED — perplexity ×" in gate.stdout


def test_sweep_runs_every_job_and_fails_at_the_end_when_an_enforced_gate_blocks(tiny_model_dir, tmp_path, compress_cli):
    artifacts = tmp_path / "artifacts"
    result = compress_cli(
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *TINY_RUN,
        *BLOCKING_GATE,
        "gate.enforce=true",
        "stages.0.bits=3,4",
        "-m",
        artifacts=artifacts,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    reports = [json.loads((folder / "report.json").read_text()) for folder in (artifacts / "runs").iterdir()]
    assert sorted(r["checkpoint"]["bits_per_weight"] for r in reports) == [4.0, 5.0]  # both jobs ran
    assert all(r["gate"]["passed"] is False for r in reports)
    summary = result.stdout[result.stdout.index("sweep: 2 of 2 jobs ran") :].splitlines()
    assert summary[1].startswith("  #0 stages.0.bits=3: release gate: BLOCKED — ")
    assert summary[2].startswith("  #1 stages.0.bits=4: release gate: BLOCKED — ")
    assert all("gate.enforce=true: exiting 1" in line for line in summary[1:3])


def test_evaluation_text_shorter_than_one_window_is_named(tiny_model_dir):
    config = build_run_config(tiny_config(tiny_model_dir, eval={"seq_len": 256}))
    check_evaluation_length(256, config)
    with pytest.raises(
        CompressError,
        match=r"eval.seq_len=256 is longer than the evaluation text of eval.data \(100 tokens\); "
        r"set eval.seq_len≤100, give more text, or raise eval.data.eval_fraction",
    ):
        check_evaluation_length(100, config, "eval.data")


def test_the_api_sets_a_stage_key_the_recipe_file_leaves_at_its_default_as_the_cli_does():
    """``oneshot(..., overrides=[...])`` takes the CLI's overrides: gptq_int4.yaml does not list input_correction."""
    from compress.app.recipe import compose

    [stage] = compose("gptq_int4", ["stages.0.input_correction=true"]).stages
    assert stage["input_correction"] is True


def copied_recipes(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the recipes folder that compress composes from (``$COMPRESS_RECIPES``)."""
    folder = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", folder)
    monkeypatch.setenv("COMPRESS_RECIPES", str(folder))
    return folder


def test_a_copied_recipe_is_named_by_its_file_name(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Hydra picks ``recipes/<name>.yaml`` by file name; the run id, recipe.yaml, MLflow tag and report use the
    composed ``recipe``: a copy must not carry its original's name into them."""
    from compress.app.recipe import compose

    folder = copied_recipes(tmp_path, monkeypatch)
    shutil.copy(folder / "rtn_int4.yaml", folder / "my_rtn.yaml")
    assert compose("my_rtn", model=str(tiny_model_dir)).recipe == "my_rtn"
    assert main(["run", "recipe=my_rtn", f"model={tiny_model_dir}", "--cfg", "job"]) == 0
    assert capsys.readouterr().out.startswith("recipe: my_rtn\n")


def test_a_recipe_key_that_contradicts_the_file_name_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    from compress.app.recipe import compose

    folder = copied_recipes(tmp_path, monkeypatch)
    text = (folder / "rtn_int4.yaml").read_text().replace("stages:", "recipe: rtn_int4\nstages:", 1)
    (folder / "my_rtn.yaml").write_text(text)  # a copy of a recipe that still says its original's name
    with pytest.raises(CompressError, match=r"my_rtn.yaml says recipe: rtn_int4, but a recipe is named by its file"):
        compose("my_rtn", model=str(tiny_model_dir))

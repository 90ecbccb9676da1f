"""One exit-code table for every command (``compress.base.errors.ExitCode``): CI can tell a blocked checkpoint (1) from
a typo (2), an undecided gate (3), a machine or store that failed (4) and a kill (130 / 143). The verdict codes of run,
gate and search are covered where those commands are tested; this file covers the mapping every command shares and the
codes no other test reaches."""

from __future__ import annotations

import pytest

from compress.__main__ import main
from compress.base.errors import EXIT_CODES_HELP, CompressError, EnvironmentFailure, ExitCode
from compress.base.signals import Terminated
from compress.commands.exits import command_exits, exit_code_of


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (CompressError("stages.0: unknown key"), 2),
        (EnvironmentFailure("MLflow store: cannot write"), 4),
        (KeyboardInterrupt(), 130),
        (Terminated("terminated by signal 15"), 143),
        (RuntimeError("a bug"), 4),
    ],
)
def test_every_exception_maps_to_one_code_of_the_table(error, code, capsys):
    def failing(argv):
        raise error

    assert exit_code_of(error) == code
    assert command_exits(failing)([]) == code
    err = capsys.readouterr().err
    assert ("Traceback" in err) == isinstance(error, RuntimeError)  # only a bug shows its traceback


def test_an_interrupt_behind_a_cleanup_error_still_counts_as_the_interrupt():
    try:
        try:
            raise Terminated("terminated by signal 15")
        except Terminated:
            raise RuntimeError("a library failed while unwinding") from None
    except RuntimeError as error:
        assert exit_code_of(error) == ExitCode.TERMINATED


def test_the_table_is_in_the_top_level_help_and_the_readme(capsys):
    from pathlib import Path

    assert main(["--help"]) == 0
    assert EXIT_CODES_HELP in capsys.readouterr().out
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for code in ExitCode:
        assert f"| {int(code)} |" in readme, f"README's exit-code table lacks {code.name}"


def test_an_unknown_command_is_a_usage_error(capsys):
    assert main(["compres"]) == 2
    assert "unknown command 'compres'" in capsys.readouterr().err


def test_compare_reports_an_unreadable_store_as_a_failure_not_a_bug(tmp_path, monkeypatch, capsys):
    store = tmp_path / "mlflow.db"
    store.write_text("not a database")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    assert main(["compare"]) == 4
    err = capsys.readouterr().err
    assert f"error: MLflow store sqlite:///{store} cannot be read: " in err and "Traceback" not in err


def test_generate_with_a_checkpoint_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", f"checkpoint={tmp_path / 'missing'}", "prompt=hi"]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("gate.backend=engin", "gate.backend='engin' is unknown"),
        ("gate.engine.max_num_seq=4", "gate.engine: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ],
)
def test_a_gate_policy_typo_is_a_usage_error_not_a_block(override, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "gate"
    assert main(["gate", f"checkpoint={tmp_path}", f"baseline={tmp_path}", f"out={out}", override]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_gate_with_a_store_it_cannot_write_is_a_failure_not_a_usage_error(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the store's folder should be")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{blocked}/mlflow.db")
    assert main(["gate", f"checkpoint={tmp_path}", f"baseline={tmp_path}", f"out={tmp_path / 'gate'}"]) == 4
    assert f"error: MLflow store sqlite:///{blocked}/mlflow.db: cannot write" in capsys.readouterr().err

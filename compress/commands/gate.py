"""``python -m compress gate candidate=<ckpt> baseline=<model|ckpt> [gate=default|quick|none] [promote=true]
[out=<dir>] [gate.<key>=<value> ...]``: judge a checkpoint; exit 0 on pass, 1 on block, 2 on a usage error."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from compress.errors import CompressError
from compress.paths import artifacts_dir, recipes_dir

USAGE = __doc__.split(":", 1)[0].strip("`")
TOP_LEVEL = {"candidate", "baseline", "gate", "out", "promote"}


def load_policy(name: str, overrides: list[str]) -> dict:
    """``recipes/gate/<name>.yaml`` with ``gate.<key>=<value>`` overrides applied (dotted keys, YAML values)."""
    from omegaconf import OmegaConf

    path = recipes_dir() / "gate" / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(file.stem for file in path.parent.glob("*.yaml"))
        raise CompressError(f"no gate policy {name!r} in {path.parent}; choose one of {choices}")
    policy = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_container(policy)


def parse_arguments(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Top-level ``key=value`` arguments, and the ``gate.`` overrides without their prefix."""
    arguments, overrides = {}, []
    for argument in argv:
        key, separator, value = argument.partition("=")
        if not separator:
            raise CompressError(f"argument {argument!r} is not key=value; usage: {USAGE}")
        if key.startswith("gate."):
            overrides.append(f"{key.removeprefix('gate.')}={value}")
        elif key in TOP_LEVEL:
            arguments[key] = value
        else:
            raise CompressError(f"unknown argument {key!r}: use {sorted(TOP_LEVEL)} or gate.<key>=<value>")
    for required in ("candidate", "baseline"):
        if required not in arguments:
            raise CompressError(f"missing {required}=...; usage: {USAGE}")
    return arguments, overrides


def evaluation_texts(policy: dict) -> list[str]:
    """The held-out split of ``gate.data`` (default: the pipeline's default corpus), popped from the policy: the
    evaluators take text, not a data source."""
    from compress.config import build_section
    from compress.data import DataSpec, load_corpus

    return load_corpus(build_section(DataSpec, policy.pop("data", None), "gate.data")).evaluation


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from compress.tracking import RunLog, check_writable, record_verdict, tracking_uri
    from evals.gate import resolve_policy, run_gate

    try:
        arguments, overrides = parse_arguments(argv)
        if "promote" in arguments:
            overrides.append(f"registry.promote={arguments['promote']}")
        policy = load_policy(arguments.get("gate", "default"), overrides)
        texts = evaluation_texts(policy)
        experiment = resolve_policy(policy).experiment  # a bad policy is reported before MLflow hears of it
        uri = tracking_uri()
        check_writable(uri, "set MLFLOW_TRACKING_URI=<writable store>")  # before minutes of evaluation, not after
        candidate = arguments["candidate"]
        default_out = artifacts_dir() / "gates" / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(candidate).name}"
        out_dir = Path(arguments.get("out", default_out))
        run = RunLog(uri, experiment, None, tags={"compress.kind": "gate"})
        try:
            result = run_gate(candidate, arguments["baseline"], policy, out_dir, evaluation_texts=texts)
            checkpoint = Path(candidate).expanduser()
            record_verdict(run, result, result.files, checkpoint if checkpoint.is_dir() else None, own_run=True)
        except BaseException as error:
            run.finish("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
            raise
        run.finish()
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print((out_dir / "gate.md").read_text())
    print(f"gate {'PASSED' if result.passed else 'BLOCKED'}: report in {out_dir}")
    return 0 if result.passed else 1

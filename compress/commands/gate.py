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


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from evals.gate import run_gate

    try:
        arguments, overrides = parse_arguments(argv)
        if "promote" in arguments:
            overrides.append(f"registry.promote={arguments['promote']}")
        policy = load_policy(arguments.get("gate", "default"), overrides)
        candidate = arguments["candidate"]
        default_out = artifacts_dir() / "gates" / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(candidate).name}"
        out_dir = Path(arguments.get("out", default_out))
        result = run_gate(candidate, arguments["baseline"], policy, out_dir)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print((out_dir / "gate.md").read_text())
    print(f"gate {'PASSED' if result.passed else 'BLOCKED'}: report in {out_dir}")
    return 0 if result.passed else 1

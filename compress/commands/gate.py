"""``python -m compress gate checkpoint=<ckpt> baseline=<model|ckpt> [gate=default|quick|none] [promote=true]
[out=<dir>] [gate.<key>=<value> ...]``: judge a checkpoint; exit 0 on PASS, 1 on BLOCK, 3 on INCONCLUSIVE (the
interval of a blocking check straddles its limit: gate.decide=true adds windows), 2 on a usage error."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from compress.app.run_report import VERDICT_EXIT_CODES, verdict_line
from compress.base.errors import CompressError, interruption
from compress.base.paths import artifacts_dir, recipes_dir
from compress.base.signals import signals_recorded
from compress.commands.args import parse_options, usage, wants_help
from compress.commands.exits import command_exits

SYNOPSIS = __doc__.split(":", 1)[0].strip("`").replace("\n", " ")


@dataclass
class GateOptions:
    checkpoint: str  # the candidate
    baseline: str  # a model name, folder or checkpoint
    gate: str = "default"  # recipes/gate/<gate>.yaml; gate.<key>=<value> overrides its keys
    out: Path | None = None  # default <artifacts>/gates/<time>-<checkpoint name>
    promote: bool | None = None  # registry.promote of the policy


def load_policy(name: str, overrides: list[str]) -> dict:
    """``recipes/gate/<name>.yaml`` with ``gate.<key>=<value>`` overrides applied (dotted keys, YAML values)."""
    from omegaconf import OmegaConf

    path = recipes_dir() / "gate" / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(file.stem for file in path.parent.glob("*.yaml"))
        raise CompressError(f"no gate policy {name!r} in {path.parent}; choose one of {choices}")
    policy = OmegaConf.load(path)
    for override in overrides:  # one at a time, so a value YAML or OmegaConf cannot read is named in one line
        try:
            policy = OmegaConf.merge(policy, OmegaConf.from_dotlist([override]))
        except Exception as error:  # noqa: BLE001 - yaml's and omegaconf's parse and merge errors alike
            reason = " ".join(str(error).split("\n")[0].split())
            raise CompressError(
                f"gate.{override}: {reason}; give gate.<key>=<a YAML value> (quote odd strings)"
            ) from None
    return OmegaConf.to_container(policy)


def evaluation_texts(policy: dict) -> list[str]:
    """The held-out split of ``gate.data`` (default: the run's default headline text, out-of-domain for the default
    calibration data), popped from the policy: the evaluators take text, not a data source."""
    from compress.app.run_config import build_section
    from compress.base.data import DataSpec, load_corpus, out_of_domain

    data = policy.pop("data", None)
    return load_corpus(build_section(DataSpec, data, "gate.data") if data else out_of_domain()).evaluation


def run_passes(candidate: str, baseline_folder: Path | None, tokenizer, texts: list[str], policy):
    """The perplexity passes a run stored beside ``candidate`` when they are this gate's (same baseline, text and
    protocol, ``policy`` resolved): judging them prints the ratio and interval the run printed
    (``compress.app.stored_passes``)."""
    from compress.app.stored_passes import StoredPasses, find_passes, passes_path
    from compress.base.data import tokenize

    checkpoint = Path(candidate).expanduser()
    if not checkpoint.is_dir() or not passes_path(checkpoint).is_file():
        return StoredPasses(passes_path(checkpoint))  # not a run's checkpoint: nothing to say
    return find_passes(checkpoint, baseline_folder, tokenize(tokenizer, "\n\n".join(texts)), policy)


@command_exits
def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(usage(GateOptions, SYNOPSIS) + "\n  gate.<key>=<value>  (any key of recipes/gate/default.yaml)")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from compress.app.stored_passes import STORED_BY
    from compress.app.tracking import RunLog, check_writable, record_verdict, tracking_uri
    from compress.evals.gate import clear_verdict, describe_sides, resolve_policy, run_gate

    with signals_recorded():  # Ctrl-C or SIGTERM, never lost, ends the gate's MLflow run KILLED
        options, overrides = parse_options(GateOptions, argv, SYNOPSIS, passthrough="gate")
        if options.promote is not None:
            overrides.append(f"registry.promote={str(options.promote).lower()}")
        policy = load_policy(options.gate, overrides)
        texts = evaluation_texts(policy)
        resolved = resolve_policy(policy)  # a bad policy is reported before MLflow hears of it
        uri = tracking_uri()
        check_writable(uri, "set MLFLOW_TRACKING_URI=<writable store>")  # before minutes of evaluation, not after
        candidate = options.checkpoint
        # a baseline of another tokenizer: refused, nothing written
        (tokenizer, _, _), (_, _, baseline_folder) = describe_sides(candidate, options.baseline, texts)
        stored = run_passes(candidate, baseline_folder, tokenizer, texts, resolved)
        if stored.line():
            print(stored.line(), flush=True)
        out_dir = options.out or artifacts_dir() / "gates" / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(candidate).name}"
        clear_verdict(out_dir)  # before the MLflow run opens: a kill from here on leaves no verdict at all
        run = None
        try:  # the run opens inside the guard: a signal from its creation on ends it KILLED
            run = RunLog(uri, resolved.experiment, None, tags={"compress.kind": "gate"})
            result = run_gate(
                candidate, options.baseline, policy, out_dir, evaluation_texts=texts,
                measured=stored.measured, measured_by=STORED_BY,
            )  # fmt: skip
            checkpoint = Path(candidate).expanduser()
            record_verdict(run, result, result.files, checkpoint if checkpoint.is_dir() else None, own_run=True)
        except BaseException as error:
            if run is not None:
                run.finish("KILLED" if interruption(error) else "FAILED")
            raise
        run.finish()
    print((out_dir / "gate.md").read_text())
    line = verdict_line(result.to_dict() | {"headline": result.headline(), "roles": result.roles()})
    print(f"{line}\nreport in {out_dir}")
    return VERDICT_EXIT_CODES[result.verdict]

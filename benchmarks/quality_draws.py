"""The draws the quality table still lacks, measured by one resumable command on the current tree.

    python -m benchmarks.quality_draws --dry-run                     # list the draws it would run, run none
    python -m benchmarks.quality_draws --recipes gptq_int4 awq_int4  # run what those recipes lack
    python -m benchmarks.quality_draws --recipes 'gptq_int3 stages.0.act_order=true'  # a candidate setting
    python -m benchmarks.quality_draws                               # every README recipe, seeds 0 1 2
    # llm-compressor's preset on the ids awq_int4 cuts (32 self-sampled windows): the pair the quality table shows
    python -m benchmarks.quality_draws --recipes \\
        'llm-compressor:awq_gptq_w4a16_mse data.generated=1.0 data.num_samples=32'

Each missing draw (a recipe as shipped, or with the overrides its spec names; ``seed=N``) compresses the model
(``--model``) through ``compress.oneshot`` in a subprocess of its own, at the pinned torch thread count
(``--threads``, also ``OMP_NUM_THREADS`` of the subprocess), and its reloaded checkpoint is scored on every text of
the panel (Shakespeare, the gate's code and technical texts, in-domain pydoc) exactly as ``benchmarks.variants``
scores; a calibration-free recipe (``quality_rows.CALIBRATION_FREE``) needs seed 0 only. Draws land in
``benchmarks/results/quality-draws.{json,md}`` one by one, so an interrupted invocation keeps what it finished and
the next one runs only the rest; ``benchmarks.quality_table`` reads that file like any other. The baseline is scored
again at every start and must equal the file's (same model, texts and arithmetic), else the file is refused: its
ratios would not share one baseline. Each draw records its recipe's fingerprint (the stages as built, every default
filled in, and the calibration settings, hashed): a draw of an older version of the recipe or of a stage's defaults
(or one measured before fingerprints were recorded) counts as missing and is drawn again; a file of the first
version's fingerprints (the stages as written) is upgraded on reading (``upgraded``). A draw is found by its
fingerprint and seed, not by its name: draws of a candidate (``'RECIPE key=value ...'``) count for the recipe once the
recipe ships those settings, so flipping a recipe to a measured candidate needs no second run. Each row records when
it was measured, which ``benchmarks.quality_table`` reads against the recipe's change dates, the processor it ran on
(``cpu``: a time-capped stage's steps follow it) and the digest of the windows its checkpoint was calibrated on
(``calibration_sha256``: one seed's draws differed between two processors), which the table's pairs check.

A peer spec (``llm-compressor:<preset>``, then ``data.generated=`` or ``data.num_samples=``) runs that preset of
``benchmarks/peer_llmcompressor.py`` as ``benchmarks.variants`` does, on the calibration ids our recipe cuts with the
same settings and seed, so a pair's draws gather in this one file too; its fingerprint is the preset, those settings
and the installed llm-compressor's version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.quality import cpu_name, scored_baseline
from benchmarks.quality_readme import README_RECIPES
from benchmarks.quality_rows import calibration_free, row_seed, shipped
from benchmarks.variants import (
    PEER,
    PEER_OVERRIDES,
    compress_and_score,
    markdown,
    peer_options,
    run_command,
)
from compress.base.staging import write_file_atomically

if TYPE_CHECKING:
    from compress.app.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
NAME = "quality-draws"
BASELINE_TOLERANCE = 1e-4  # relative: the same model and texts score alike to the last digits on one machine
FINGERPRINT_VERSION = 2  # 2: the stages as built, defaults included; 1: as the recipe wrote them


def run_name(spec: str, seed: int) -> str:
    """The row key ``benchmarks.quality_table`` parses: the recipe and its overrides, then ``seed=N`` unless 0."""
    return spec if seed == 0 else f"{spec} seed={seed}"


def wanted(specs: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Every (spec, seed) to draw: a calibration-free spec needs its first seed only."""
    return [
        (spec, seed)
        for spec in specs
        for seed in (seeds[:1] if calibration_free(spec.split()[0], spec.split()[1:]) else seeds)
    ]


def peer_version() -> str:
    """The llm-compressor version ``benchmarks.variants`` runs: its venv's, else ``artifacts/peer-site``'s."""
    from importlib import metadata

    roots = [*(ROOT / "artifacts" / "peer-venv").glob("lib/python*/site-packages"), ROOT / "artifacts" / "peer-site"]
    for root in roots:
        for found in metadata.distributions(path=[str(root)]):
            if found.metadata["Name"] == "llmcompressor":
                return found.version
    raise ValueError(
        "llm-compressor is not installed for the peer: pip install --target artifacts/peer-site --no-deps "
        "llmcompressor==0.14.0.1 compressed-tensors loguru"
    )


def peer_fingerprint(spec: str) -> str:
    """What a draw of llm-compressor's preset depends on, hashed: the preset, the settings its calibration ids are
    cut with (the seed is the draw's) and the peer's version."""
    from benchmarks.peer_comparison import SCHEMES
    from compress.model.resume import settings_digest

    scheme, *overrides = spec.removeprefix(PEER).split()
    if scheme not in SCHEMES:
        raise ValueError(f"no llm-compressor preset {scheme!r}: pick one of {', '.join(SCHEMES)}")
    if any(override.startswith("seed=") for override in overrides):
        raise ValueError("a draw's seed is not part of its spec: the seeds come from --seeds")
    _, generated, num_samples = peer_options(overrides, takes=tuple(k for k in PEER_OVERRIDES if k != "seed"))
    return settings_digest(
        {"peer": scheme, "version": peer_version(), "generated": generated, "num_samples": num_samples}
    )


def recipe_fingerprint(spec: str) -> str:
    """What a draw of ``spec`` (a recipe, then any overrides, or a peer spec) depends on, hashed: its stages as built
    (every setting, the code's defaults included, so a changed default makes older draws stale) and its calibration
    settings."""
    if spec.startswith(PEER):
        return peer_fingerprint(spec)
    return built_fingerprint(composed(spec))


def composed(spec: str) -> RunConfig:
    """``spec`` (a recipe, then any overrides) composed as a run would."""
    from compress.app.recipe import compose

    recipe, *overrides = spec.split()
    return compose(recipe, overrides)


def built_fingerprint(config: RunConfig) -> str:
    """Version 2: the composed ``config``'s stages as built, defaults included, and its calibration settings."""
    from compress.model.resume import settings_digest
    from compress.stages import build_chain

    stages = [{"type": stage.name, **dataclasses.asdict(stage.config)} for stage in build_chain(config.stages)]
    data = dataclasses.asdict(config.data)
    return settings_digest({"stages": stages, "data": data, "calibration_batch_size": config.calibration_batch_size})


def written_fingerprint(config: RunConfig) -> str:
    """Version 1, the composed ``config``'s stages as the recipe writes them (no defaults), which files of draws
    recorded before FINGERPRINT_VERSION 2: read only to upgrade such a file (``upgraded``)."""
    from compress.model.resume import settings_digest

    plain = dataclasses.asdict(config)
    return settings_digest({key: plain[key] for key in ("stages", "data", "calibration_batch_size")})


def upgraded(report: dict) -> tuple[dict, int]:
    """``report`` with its version-1 fingerprints upgraded, and how many rows changed: a row whose stored fingerprint
    is what its spec writes today ran with today's recipe, so it gets today's full fingerprint (the upgrade trusts
    that no stage default changed since the row was drawn, as version 1 did); any other row keeps its old
    fingerprint and stays stale. Peer fingerprints did not change."""
    if report.get("fingerprint_version", 1) >= FINGERPRINT_VERSION:
        return report, 0
    from compress.base.errors import CompressError

    now: dict[str, tuple[str, str] | None] = {}  # spec → (version 1, version 2) today, None if it no longer composes
    rows, changed = {}, 0
    for name, row in report["rows"].items():
        spec = " ".join(word for word in name.split() if not word.startswith("seed="))
        if spec not in now and not spec.startswith(PEER):
            try:
                config = composed(spec)  # once for both versions
                now[spec] = (written_fingerprint(config), built_fingerprint(config))
            except (CompressError, ValueError):
                now[spec] = None
        if now.get(spec) and row.get("recipe_fingerprint") == now[spec][0]:
            row, changed = {**row, "recipe_fingerprint": now[spec][1]}, changed + 1
        rows[name] = row
    return {**report, "rows": rows, "fingerprint_version": FINGERPRINT_VERSION}, changed


def fingerprints(specs: list[str]) -> dict[str, str]:
    """Each spec's fingerprint, or one line naming the first spec that does not compose (a recipe that ships without
    what it needs, a bad override, a peer that is not installed) and its fix, before the baseline or any draw is
    run."""
    from compress.base.errors import CompressError

    found = {}
    for spec in specs:
        try:
            found[spec] = recipe_fingerprint(spec)
        except (CompressError, ValueError) as error:
            raise SystemExit(f"{spec}: {error}") from None
    return found


def missing(report: dict | None, specs: list[str], seeds: list[int], fingerprints: dict) -> list[tuple[str, int]]:
    """The draws ``report`` lacks: a draw is there when a row of the same seed carries the spec's current fingerprint
    (``fingerprints``) and no error, whatever it is named; a failed row, or one of another version of the recipe,
    counts as missing and is run again."""
    found = {
        (row.get("recipe_fingerprint"), row_seed(name))
        for name, row in (report or {}).get("rows", {}).items()
        if "error" not in row
    }
    return [(spec, seed) for spec, seed in wanted(specs, seeds) if (fingerprints[spec], seed) not in found]


def compress_seconds(recipes: list[str], results: Path, model: str) -> dict[str, float | None]:
    """The mean compression time quality.json holds for each recipe as shipped on ``model`` (a name, hub id or
    folder; the table keys models by their folder's name), for --dry-run's plan: the file is read once."""
    from compress.base.errors import CompressError
    from compress.model.sources import ModelSpec, resolve_model_path

    table = results / "quality.json"
    if not table.is_file():
        return dict.fromkeys(recipes)
    try:
        folder = Path(resolve_model_path(ModelSpec(path=model)))
    except CompressError as error:  # what the run itself would stop on: say it now, in one line
        raise SystemExit(f"error: {error}") from None
    runs = json.loads(table.read_text())["models"].get(folder.name, {}).get("runs", [])
    rows = {spec: shipped(runs, spec.split()[0]) for spec in recipes}  # a candidate: its recipe's time as shipped
    return {spec: row["seconds"] if row else None for spec, row in rows.items()}


def save_report(report: dict, results: Path, name: str) -> None:
    """The draws so far as ``NAME.json`` and its table as ``NAME.md``, rewritten after every draw: each file whole or
    as it was, so a kill mid-write loses at most the draw just measured, never the hours before it."""
    text = json.dumps(report, indent=2)
    write_file_atomically(results / f"{name}.json", lambda temporary: temporary.write_text(text))
    table = markdown(report)
    write_file_atomically(results / f"{name}.md", lambda temporary: temporary.write_text(table))


def check_same_baseline(stored: dict, fresh: dict, path: Path) -> None:
    for text, found in fresh.items():
        before = stored.get(text, {}).get("perplexity")
        if before is None or abs(before - found["perplexity"]) > BASELINE_TOLERANCE * before:
            raise SystemExit(
                f"{path}: its baseline {text} perplexity {before} differs from this machine's "
                f"{found['perplexity']:.4f}: move the file aside (or pass --name NEW) to start a new set of draws"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=README_RECIPES,
        help="recipe names, or 'RECIPE key=value ...' (default: README's)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2, help="torch threads, pinned and recorded")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-windows", type=int, default=None, help="cap windows per text (default: all)")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds one compression may take")
    parser.add_argument("--name", default=NAME, help="results file stem under --results")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--dry-run", action="store_true", help="list the draws still missing; run none")
    args = parser.parse_args()
    path = args.results / f"{args.name}.json"
    stored = json.loads(path.read_text()) if path.is_file() else None
    if stored is not None and stored.get("threads") != args.threads:
        raise SystemExit(f"{path} holds draws at {stored.get('threads')} torch threads: pass --threads "
                         f"{stored.get('threads')}, or --name NEW for draws at {args.threads}")  # fmt: skip
    if stored is not None and stored.get("fingerprint_version", 1) < FINGERPRINT_VERSION:  # saved even by --dry-run:
        stored, changed = upgraded(stored)  # it changes no draw, only what finds one
        save_report(stored, args.results, args.name)
        print(f"{path.name}: {changed} fingerprints upgraded to version {FINGERPRINT_VERSION}", flush=True)
    spec_fingerprints = fingerprints(args.recipes)
    todo = missing(stored, args.recipes, args.seeds, spec_fingerprints)
    print(f"{len(todo)} draws to run: {', '.join(run_name(r, s) for r, s in todo) or 'none'}", flush=True)
    if args.dry_run:
        seconds = compress_seconds(sorted({recipe for recipe, _ in todo}), args.results, args.model)
        for recipe, seed in todo:
            known = (
                "not measured before"
                if seconds[recipe] is None
                else f"~{seconds[recipe]:.0f} s to compress, by quality.json"
            )
            print(f"  {run_name(recipe, seed)}: {known}, then scoring on every text")
    if args.dry_run or not todo:
        return
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the compressing subprocesses inherit it
    torch.set_num_threads(args.threads)
    model_dir, ids, report = scored_baseline("python -m benchmarks.quality_draws", args.max_windows, args.model, True)
    report.pop("samples")
    if stored is not None:
        check_same_baseline(stored["baseline"], report["baseline"], path)
        for row in stored["rows"].values():  # written before rows were dated: by the invocation that wrote the file
            row.setdefault("date", stored["date"].removesuffix(" UTC"))
        report = {**stored, "command": report["command"], "date": report["date"]}
    report.setdefault("rows", {})
    report["fingerprint_version"] = FINGERPRINT_VERSION
    report["title"] = (
        "Draws for the quality table: each recipe as shipped (or a candidate setting of it), per calibration seed, "
        "on the text panel"
    )
    args.results.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quality-draws-") as tmp:
        for index, (spec, seed) in enumerate(todo):
            folder = Path(tmp) / str(index)
            recipe, *overrides = spec.split()
            command = run_command(recipe, [*overrides, f"seed={seed}"], args.model, model_dir, folder)
            row = {**compress_and_score(command, folder, ids, args.max_windows, args.timeout),
                   "recipe_fingerprint": spec_fingerprints[spec], "date": time.strftime("%Y-%m-%d %H:%M"),
                   "cpu": cpu_name(), "command": report["command"]}  # fmt: skip
            report["rows"][run_name(spec, seed)] = row
            print(f"{run_name(spec, seed)}: {json.dumps(row)}", flush=True)
            save_report(report, args.results, args.name)
    failed = [name for name, row in report["rows"].items() if "error" in row]
    if failed:  # kept in the file (the table skips them) and run again next time
        sys.exit(f"{len(failed)} draws failed: {', '.join(failed)}; see {args.name}.md")


if __name__ == "__main__":
    main()

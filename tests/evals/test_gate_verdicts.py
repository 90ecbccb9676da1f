"""Gate v2: intervals, the three verdicts, KL divergence from a cached baseline reference, and quick vs default.

The statistics are checked on numbers with known answers; the gate end to end on tiny random models with a real
tokenizer, where a slightly perturbed copy of the baseline is the candidate whose ratio the limits are placed around.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import save, scale_by_noise, tiny_model_for

from compress.base.data import DataSpec, load_corpus
from compress.commands.gate import load_policy
from compress.evals import sides
from compress.evals.divergence import DivergenceMeter, ReferenceRecorder, coarse_kl
from compress.evals.gate import run_gate, stats
from compress.evals.gate.checks import drop_check, ratio_check
from compress.evals.perplexity import perplexity

# the evaluation text alone: the domain panel (tested on its own below) would add checks to every verdict here
WINDOW_LAYERS = {"layers": ["perplexity", "kl"], "backend": "transformers", "domains": []}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    """A baseline and a candidate a few percent worse (its weights perturbed by 5% noise)."""
    root = tmp_path_factory.mktemp("pair")
    return {
        "baseline": save(tiny_model_for(tokenizer), tokenizer, root / "baseline"),
        "candidate": save(scale_by_noise(tiny_model_for(tokenizer), strength=0.05), tokenizer, root / "candidate"),
    }


@pytest.fixture(autouse=True)
def isolated_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))


# --- statistics with known answers ---


@pytest.mark.parametrize(("degrees", "table"), [(3, 3.1824), (7, 2.3646), (15, 2.1314), (30, 2.0423)])
def test_t_critical_values_match_the_table(degrees, table):
    assert stats._critical(0.95, degrees) == pytest.approx(table, rel=2e-3)


def test_an_interval_inside_passes_one_outside_blocks_one_across_is_inconclusive():
    interval = stats.mean_interval([1.0, 1.2, 0.8, 1.1, 0.9])
    assert interval.low < 1.0 < interval.high
    assert stats.verdict(interval, 2.0, at_most=True) == stats.PASS
    assert stats.verdict(interval, 0.5, at_most=True) == stats.BLOCK
    assert stats.verdict(interval, 1.0, at_most=True) == stats.INCONCLUSIVE
    assert stats.verdict(interval, 0.5, at_most=False) == stats.PASS
    assert stats.items_to_decide(interval, 1.0) is None  # the estimate on the limit: no item count decides it
    assert stats.items_to_decide(interval, 1.1) > interval.items


def test_paired_accuracies_that_never_flip_still_have_an_honest_width():
    """Ten prompts that agree cannot show a 2-point drop is impossible: the interval stays about ±16 points."""
    same = [1.0, 0.0] * 5
    interval = stats.paired_proportion_difference(same, same)
    assert interval.estimate == 0 and interval.low == pytest.approx(-interval.high)
    assert 0.14 < interval.high < 0.18
    check = drop_check("needle", "needle_accuracy", same, same, 2.0, 0.95)
    assert check.verdict == stats.INCONCLUSIVE and 80 < check.items_to_decide < 120  # if none flipped then either
    assert drop_check("needle", "needle_accuracy", same, same, 20.0, 0.95).verdict == stats.PASS


def test_a_ratio_straddling_the_limit_is_inconclusive_and_one_clearly_inside_passes():
    """Synthetic per-window NLLs: the candidate is worse by log(1.05) on average, with noise."""
    generator = torch.Generator().manual_seed(0)
    baseline = (3 + torch.rand(24, generator=generator)).tolist()
    shift = math.log(1.05) + 0.02 * torch.randn(24, generator=generator)
    candidate = [b + float(s) for b, s in zip(baseline, shift, strict=True)]
    straddling = ratio_check("perplexity", "perplexity", candidate, baseline, 1.05, 0.95)
    assert straddling.low < 1.05 < straddling.high and straddling.verdict == stats.INCONCLUSIVE
    assert "would decide it" in straddling.summary or "sits on the limit" in straddling.summary
    inside = ratio_check("perplexity", "perplexity", candidate, baseline, 1.10, 0.95)
    assert inside.verdict == stats.PASS and inside.high <= 1.10
    outside = ratio_check("perplexity", "perplexity", candidate, baseline, 1.01, 0.95)
    assert outside.verdict == stats.BLOCK and outside.low > 1.01


# --- KL divergence ---


def test_coarse_kl_is_a_lower_bound_of_the_full_kl_and_zero_for_equal_distributions():
    generator = torch.Generator().manual_seed(0)
    reference = torch.log_softmax(3 * torch.randn(64, 500, generator=generator), -1)
    candidate = torch.log_softmax(reference + 0.3 * torch.randn(64, 500, generator=generator), -1)
    full = (reference.exp() * (reference - candidate)).sum(-1)
    for top_k in (8, 64, 500):
        top = reference.topk(top_k, -1)
        coarse = coarse_kl(top.values, candidate.gather(1, top.indices))
        assert (coarse <= full + 1e-5).all()
        if top_k == 500:
            assert torch.allclose(coarse, full, atol=1e-5)
    top = reference.topk(8, -1)
    assert torch.allclose(coarse_kl(top.values, top.values), torch.zeros(64), atol=1e-6)


def test_kl_is_measured_in_the_perplexity_pass_without_changing_the_perplexity(tokenizer, texts):
    from compress.base.data import tokenize

    ids = tokenize(tokenizer, "\n\n".join(texts))
    baseline, candidate = tiny_model_for(tokenizer), scale_by_noise(tiny_model_for(tokenizer), strength=0.5)
    recorder = ReferenceRecorder(4, 63, top_k=16)
    plain = perplexity(baseline, ids, 64, 2, 4, progress=False)
    recorded = perplexity(baseline, ids, 64, 2, 4, progress=False, observer=recorder)
    assert recorded.perplexity == pytest.approx(plain.perplexity, rel=1e-6)
    assert math.exp(-recorder.target_logprob.double().mean()) == pytest.approx(plain.perplexity, rel=1e-5)
    itself = perplexity(baseline, ids, 64, 2, 4, progress=False, observer=DivergenceMeter(recorder.tensors()))
    assert itself.divergence["kl_mean"] == pytest.approx(0, abs=1e-6) and itself.divergence["same_top"] == 1.0
    worse = perplexity(candidate, ids, 64, 2, 4, progress=False, observer=DivergenceMeter(recorder.tensors()))
    assert worse.divergence["kl_mean"] > 1e-4 and len(worse.divergence["window_kl"]) == 4
    assert worse.divergence["kl_p99"] >= worse.divergence["kl_p50"]


# --- the gate end to end ---


def _ratio_interval(result):
    [check] = [check for check in result.layer("perplexity").checks if check.metric == "perplexity"]
    return check


def test_limits_around_a_measured_ratio_give_all_three_verdicts(pair, texts, tmp_path):
    # one check's three verdicts, so no familywise widening of its BLOCK (tested on its own below)
    policy = {
        **WINDOW_LAYERS, "familywise": False, "perplexity": {"seq_len": 128, "max_windows": 24},
        "kl": {"max_mean": 10.0},
    }  # fmt: skip
    first = run_gate(pair["candidate"], pair["baseline"], policy, tmp_path / "first", evaluation_texts=texts)
    check = _ratio_interval(first)
    assert check.low < check.estimate < check.high
    for limit, expected in ((check.estimate, "inconclusive"), (check.high * 1.02, "pass"), (check.low * 0.98, "block")):
        limited = {**policy, "perplexity": {**policy["perplexity"], "max_ratio": float(limit)}}
        result = run_gate(pair["candidate"], pair["baseline"], limited, tmp_path / expected, evaluation_texts=texts)
        assert result.verdict == expected, result.reasons
        layer = result.to_dict()["layers"][0]
        assert layer["verdict"] == expected and layer["low"] <= layer["estimate"] <= layer["high"]
        assert layer["limit"] == pytest.approx(limit)
    markdown = (tmp_path / "inconclusive" / "gate.md").read_text()
    assert "# Release gate: INCONCLUSIVE" in markdown and "95% interval" in markdown


def test_quick_and_default_gates_agree_within_their_intervals(pair, texts, tmp_path):
    """The quick gate scores fewer windows of the same length: a wider interval around the same ratio."""
    intervals = {}
    for name in ("quick", "default"):
        policy = load_policy(name, ["layers=[perplexity,kl]", "backend=transformers", "kl.max_mean=10"])
        result = run_gate(pair["candidate"], pair["baseline"], policy, tmp_path / name, evaluation_texts=texts)
        intervals[name] = _ratio_interval(result)
    quick, default = intervals["quick"], intervals["default"]
    assert quick.items < default.items
    assert quick.low <= default.high and default.low <= quick.high  # overlapping
    assert quick.high - quick.low > default.high - default.low


def test_decide_scores_more_windows_until_the_verdict_is_decided(pair, texts, tmp_path):
    policy = {**WINDOW_LAYERS, "perplexity": {"seq_len": 64, "max_windows": 4}, "kl": {"max_mean": 10.0}}
    first = _ratio_interval(
        run_gate(pair["candidate"], pair["baseline"], policy, tmp_path / "a", evaluation_texts=texts)
    )
    limit = first.high * 0.999  # inside the 4-window interval, above the estimate: more windows should settle it
    decided = {**policy, "decide": True, "perplexity": {**policy["perplexity"], "max_ratio": float(limit)}}
    result = run_gate(pair["candidate"], pair["baseline"], decided, tmp_path / "b", evaluation_texts=texts)
    check = _ratio_interval(result)
    assert check.items > 4
    assert check.confidence > 0.95  # widened for the repeated looks
    assert (
        result.verdict in ("pass", "block") or check.items == result.layer("perplexity").metrics["protocol"]["windows"]
    )


def test_a_second_gate_reads_the_cached_reference_and_never_loads_the_baseline(pair, texts, tmp_path, monkeypatch):
    policy = {**WINDOW_LAYERS, "perplexity": {"seq_len": 128, "max_windows": 8}, "kl": {"max_mean": 10.0}}
    first = run_gate(pair["candidate"], pair["baseline"], policy, tmp_path / "first", evaluation_texts=texts)
    assert first.layer("kl").metrics["candidate"]["reference_cached"] is None
    loaded = []
    real_load = sides.load_for_eval
    monkeypatch.setattr(sides, "load_for_eval", lambda source: loaded.append(source) or real_load(source))
    second = run_gate(pair["candidate"], pair["baseline"], policy, tmp_path / "second", evaluation_texts=texts)
    assert loaded == [pair["candidate"]]  # the baseline's windows came from the cache
    assert Path(second.layer("kl").metrics["candidate"]["reference_cached"]).is_file()
    for name in ("perplexity", "kl"):
        assert second.layer(name).estimate == pytest.approx(first.layer(name).estimate, rel=1e-5)
    tail_mass = [gate.layer("kl").metrics["candidate"]["reference_tail_mass"] for gate in (first, second)]
    assert 0 < tail_mass[0] < 1 and tail_mass[1] == pytest.approx(tail_mass[0], rel=1e-5)


def test_passes_the_caller_measured_are_judged_before_any_model_loads(pair, tokenizer, texts, tmp_path, monkeypatch):
    """`compress run` hands the gate its own perplexity passes: when they block, neither side is loaded for the
    later layers, which are skipped."""
    from transformers import AutoModelForCausalLM

    from compress.base.data import tokenize

    ids = tokenize(tokenizer, "\n\n".join(texts))
    measured = {
        side: perplexity(AutoModelForCausalLM.from_pretrained(pair[side]), ids, 128, 4, 6, progress=False).to_dict()
        for side in ("baseline", "candidate")
    }
    loaded = []
    monkeypatch.setattr(sides, "load_for_eval", lambda source: loaded.append(source))
    policy = {
        "layers": ["perplexity", "json"], "backend": "transformers", "domains": [],
        "perplexity": {"max_ratio": 0.99},
    }  # fmt: skip
    result = run_gate(
        pair["candidate"], pair["baseline"], policy, tmp_path, evaluation_texts=texts, measured=measured
    )  # fmt: skip
    assert result.verdict == "block" and loaded == [], result.reasons
    assert [layer.status for layer in result.layers] == ["fail", "skipped"]


def test_the_gate_command_exits_3_on_inconclusive_and_says_why(pair, tmp_path, monkeypatch, capsys):
    """INCONCLUSIVE fails closed with its own exit code, distinct from BLOCK's 1."""
    from compress.commands import gate as gate_command

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    texts = load_corpus(DataSpec()).evaluation
    policy = {**WINDOW_LAYERS, "perplexity": {"seq_len": 128, "max_windows": 12}, "kl": {"max_mean": 10.0}}
    measured = _ratio_interval(
        run_gate(pair["candidate"], pair["baseline"], policy, tmp_path / "m", evaluation_texts=texts)
    )
    args = [
        f"checkpoint={pair['candidate']}",
        f"baseline={pair['baseline']}",
        "gate=quick",
        f"out={tmp_path / 'g'}",
        "gate.layers=[perplexity]",
        "gate.perplexity.seq_len=128",
        "gate.perplexity.max_windows=12",
        f"gate.perplexity.max_ratio={(measured.estimate + measured.high) / 2}",
        "gate.data.source=pydoc",  # the text the limit was measured on
    ]
    assert gate_command.main(args) == 3
    out = capsys.readouterr().out
    assert "release gate: INCONCLUSIVE — perplexity ×" in out and "items would decide it" in out


def test_the_policy_defaults_are_the_default_gate():
    """quick.yaml changes sizes over the dataclass defaults, so those must be default.yaml's limits (the quick gate's
    KL limit was 0.1 where default.yaml says 0.05)."""
    from omegaconf import OmegaConf

    from compress.base.paths import recipes_dir
    from compress.evals.gate.policy import GatePolicy, policy_dict, resolve_policy

    default = OmegaConf.to_container(OmegaConf.load(recipes_dir() / "gate" / "default.yaml"))
    assert policy_dict(resolve_policy(default)) == policy_dict(GatePolicy())


def test_the_gate_scores_windows_spread_over_the_text_not_its_first_ones(pair, texts, tmp_path):
    """Windows side by side share a scene; a gate that scores a few of many windows takes them across the text."""
    policy = {**WINDOW_LAYERS, "perplexity": {"seq_len": 64, "max_windows": 4}, "kl": {"max_mean": 10.0}}
    result = run_gate(pair["candidate"], pair["baseline"], policy, tmp_path, evaluation_texts=texts)
    protocol = result.to_dict()["layers"][0]["metrics"]["protocol"]
    positions = protocol["window_positions"]
    assert len(positions) == 4 and positions[0] == 0 and max(positions) > 4 * 4  # spread, not 0-3


def test_the_domain_panel_judges_each_kind_of_text_and_names_the_worst(pair, texts, tmp_path):
    """gate.domains adds kinds of text to the perplexity and KL layers, each judged on its own interval; the verdict
    line quotes the worst of them, named."""
    policy = {
        **WINDOW_LAYERS, "domains": ["code"], "perplexity": {"seq_len": 64, "max_windows": 4},
        "kl": {"max_mean": 10.0},
    }  # fmt: skip
    result = run_gate(pair["candidate"], pair["baseline"], policy, tmp_path, evaluation_texts=texts)
    perplexity, kl = result.layers[0], result.layers[1]
    assert [check.metric for check in perplexity.checks] == ["perplexity", "perplexity [code]"]
    assert [check.metric for check in kl.checks] == ["kl_mean", "kl_mean [code]"]
    panel = perplexity.metrics["domains"]
    assert set(panel) == {"evaluation", "code"} and panel["code"]["windows"] == 4
    worst = perplexity.metrics["worst_domain"]
    assert panel[worst]["ratio"] == max(row["ratio"] for row in panel.values())
    assert (
        result.headline()
        == next(check for check in perplexity.checks if panel[worst]["ratio"] == check.estimate).describe()
    )
    code = next(check for check in perplexity.checks if check.metric == "perplexity [code]")
    assert code.describe().startswith("perplexity [code] ×")
    # MLflow refuses brackets in a metric's name: the panel's metrics are named with dots (a gate failed closed on it)
    from compress.evals.gate.report import summary_metrics

    names = summary_metrics(result)
    assert all(re.fullmatch(r"[\w\-. :/]+", name) for name in names), sorted(names)
    assert names["gate.ppl_ratio.code"] == code.estimate and "gate.kl_mean.code_high" in names


def test_a_pooled_accuracy_check_is_logged_under_a_name_mlflow_accepts():
    """A pooled check is named ``arc_easy+piqa/acc``: MLflow refuses the ``+`` and the gate would fail closed."""
    from mlflow.utils.validation import _validate_metric_name

    from compress.evals.gate.checks import noninferiority_check
    from compress.evals.gate.report import summary_metrics
    from compress.evals.gate.result import GateResult, LayerResult

    outcomes = [1.0, 0.0] * 50
    check = noninferiority_check("lm_eval", "arc_easy+piqa/acc", outcomes, outcomes, 3.0, 0.95, 0.975)
    layer = LayerResult("lm_eval", "pass", "pass", checks=[check])
    names = summary_metrics(GateResult("pass", [], [layer], "candidate", "baseline", "transformers", None, {}))
    assert {"gate.arc_easy_piqa.acc_low", "gate.arc_easy_piqa.acc_high"} <= set(names)
    for name in names:
        _validate_metric_name(name)

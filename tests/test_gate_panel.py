"""``benchmarks/gate_panel.py``: the domain panel's combined verdict and the coverage summary, on tiny deterministic
per-window scores judged by the gate's own checks."""

from __future__ import annotations

import math
import random

from benchmarks import gate_panel
from compress.commands.gate import load_policy
from compress.evals.gate import stats
from compress.evals.gate.policy import resolve_policy
from compress.evals.gate.runner import blocking_checks


def _text(name: str, windows: int, shift: dict[str, float], seed: int) -> dict:
    """A stored text entry: a baseline and candidates whose per-window NLL sits ``shift`` nats above it."""
    rng = random.Random(seed)
    base = [3.0 + rng.gauss(0, 0.3) for _ in range(windows)]
    models = {"baseline": {"window_nll": base}}
    for model, delta in shift.items():
        models[model] = {
            "window_nll": [value + delta + rng.gauss(0, 0.002) for value in base],
            "window_kl": [max(0.0, 0.001 + 10 * delta + rng.gauss(0, 0.0005)) for _ in base],
        }
    return {"text": name, "windows": windows, "models": models}


def _default():
    policy = resolve_policy(load_policy("default", []))
    return policy, stats.familywise_confidence(policy.confidence, blocking_checks(policy, policy.layers))


def test_one_bad_domain_blocks_the_panel_and_is_named_worst():
    code_regression = math.log(1.12)  # lossless on prose, 12% worse on code only
    texts = {
        "shakespeare/96": _text("shakespeare", 96, {"lossless": 0.0, "code_only": 0.0}, 1),
        "shakespeare/48": _text("shakespeare", 48, {"lossless": 0.0, "only_here": 0.0}, 9),  # fewer windows
        "python_code/64": _text("python_code", 64, {"lossless": 0.0, "code_only": code_regression}, 2),
        "python_docstrings/64": _text("python_docstrings", 64, {"lossless": 0.0, "code_only": 0.0}, 3),
    }
    policy, family = _default()
    found = gate_panel.panel_rates(texts, policy, family, ["dialogue", *policy.domains])
    lossless, bad = found["checkpoints"]["lossless"], found["checkpoints"]["code_only"]
    assert lossless["texts"] == {
        "dialogue": "shakespeare/96", "code": "python_code/64", "technical": "python_docstrings/64",
    }  # fmt: skip
    assert lossless["pass"] == 1.0 and lossless["slices"] == 200
    assert bad["block"] == 1.0 and bad["worst"] == {"code": 200}
    assert bad["full_ratio"]["code"] > 1.1 > bad["full_ratio"]["dialogue"]
    assert "only_here" not in found["checkpoints"]  # scored on one text: not a panel verdict
    lines = "\n".join(gate_panel.panel_markdown("default", family, found))
    assert "| code_only |" in lines and "code 100%" in lines


def test_a_panel_text_never_scored_is_named_and_left_out():
    texts = {"shakespeare/96": _text("shakespeare", 96, {"lossless": 0.0}, 1)}
    policy, family = _default()
    found = gate_panel.panel_rates(texts, policy, family, ["dialogue", "code"])
    assert found["missing"] == ["code"] and list(found["checkpoints"]) == ["lossless"]
    assert found["checkpoints"]["lossless"]["texts"] == {"dialogue": "shakespeare/96"}
    assert "not scored, so left out: code" in gate_panel.panel_markdown("default", family, found)[1]
    nothing = gate_panel.panel_rates({}, policy, family, ["dialogue"])
    assert "not calibrated" in gate_panel.panel_markdown("default", family, nothing)[1]


def test_gate_power_sizes_follow_the_preset_and_its_pooled_benchmarks():
    from benchmarks import gate_power

    full = resolve_policy(load_policy("full", []))
    assert gate_power.accuracy_items(full, "lm_eval") == 570 + 1838  # ARC-Easy and PIQA, pooled
    assert gate_power.accuracy_items(resolve_policy(load_policy("quick", [])), "lm_eval") == 200  # its limit
    assert sum(gate_power.benchmark_outcomes(full)) / 2408 > 0.6  # PIQA's 64% lifts ARC's 52%
    assert gate_power.stated_regression("perplexity", 1.05) == 1.1 and gate_power.stated_regression("kl", 0.05) == 0.1
    assert gate_power.stated_regression("long_context", 10.0) == 20.0

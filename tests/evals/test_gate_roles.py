"""Each layer's role in the verdict: latency blocks on a GPU and only reports on a CPU unless the policy says
otherwise, and the verdict line names which layers decided and which only reported."""

from __future__ import annotations

import pytest
from helpers import pydoc_tokenizer, save, tiny_model_for

from compress.app.run_report import verdict_line
from compress.base.data import DataSpec, load_corpus
from compress.base.errors import CompressError
from compress.commands.gate import load_policy
from compress.evals.gate import run_gate
from compress.evals.gate.layers import layer_blocking
from compress.evals.gate.policy import resolve_blocking, resolve_policy


@pytest.mark.parametrize(
    ("blocking", "device", "expected"),
    [("auto", "cpu", False), ("auto", "cuda", True), ("auto", None, True), (True, "cpu", True), (False, "cuda", False)],
)
def test_latency_blocks_on_a_gpu_and_advises_on_a_cpu_unless_told(blocking, device, expected):
    assert resolve_blocking(blocking, device) is expected
    policy = resolve_policy({"latency": {"blocking": blocking}})
    assert layer_blocking(policy, "latency", {"device": device} if device else {}) is expected


def test_the_default_policy_resolves_latency_from_the_device_and_refuses_other_words():
    assert load_policy("default", [])["latency"]["blocking"] == "auto"
    assert load_policy("default", ["latency.blocking=true"])["latency"]["blocking"] is True
    assert load_policy("quick", [])["latency"]["blocking"] is False
    with pytest.raises(CompressError, match="gate.latency.blocking='sometimes'; use true, false or auto"):
        resolve_policy({"latency": {"blocking": "sometimes"}})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tokenizer = pydoc_tokenizer()
    return save(tiny_model_for(tokenizer), tokenizer, tmp_path_factory.mktemp("roles") / "base")


@pytest.mark.parametrize("blocking", ["auto", True])
def test_latency_on_a_cpu_reports_unless_told_to_block_and_the_verdict_line_says_so(base, tmp_path, blocking):
    """A latency limit no model can meet (100× faster than itself): on the CPU with ``auto`` it is reported and the
    verdict is the perplexity layer's; told to block, latency's verdict is the gate's."""
    policy = {
        "backend": "transformers",
        "layers": ["perplexity", "latency"],
        "perplexity": {"seq_len": 64, "max_windows": 2},
        "latency": {"prompt_tokens": 16, "new_tokens": 2, "repeats": 3, "warmup": 0, "max_tpot_ratio": 0.01},
    }
    policy["latency"]["blocking"] = blocking
    texts = load_corpus(DataSpec()).evaluation
    result = run_gate(base, base, policy, tmp_path, evaluation_texts=texts)
    perplexity, latency = result.layers
    assert perplexity.role == "blocking" and perplexity.verdict == "pass"  # the model against itself
    assert latency.metrics["device"] == "cpu"
    if blocking == "auto":
        assert latency.role == "advisory" and latency.status in ("pass", "warn")
        assert result.verdict == "pass"
        ended = "" if latency.verdict == "pass" else f" ({latency.verdict})"
        assert result.roles() == f"blocking: perplexity; advisory: latency{ended}"
        assert verdict_line(result.to_dict() | {"headline": result.headline(), "roles": result.roles()}).endswith(
            f"PASS [blocking: perplexity; advisory: latency{ended}]"
        )
    else:
        assert latency.role == "blocking" and result.verdict == latency.verdict
    assert f"| latency | {latency.role} |" in (tmp_path / "gate.md").read_text()


def test_the_verdict_line_names_each_layer_s_role():
    gate = {
        "passed": False,
        "verdict": "block",
        "reasons": ["perplexity ×1.2130 (95% CI 1.1903–1.2362) > the 1.05× limit: BLOCK"],
        "headline": "perplexity ×1.2130 (95% CI 1.1903–1.2362) > the 1.05× limit: BLOCK",
        "roles": "blocking: perplexity (block); skipped: kl, latency",
    }
    assert verdict_line(gate, enforce=True) == (
        "release gate: BLOCKED — perplexity ×1.2130 (95% CI 1.1903–1.2362) > the 1.05× limit: BLOCK "
        "[blocking: perplexity (block); skipped: kl, latency] (gate.enforce=true: exiting 1)"
    )
    assert verdict_line({"passed": True, "verdict": "pass", "reasons": []}) == "release gate: PASSED"


def test_the_log_says_how_long_each_load_and_layer_took(base, tmp_path, caplog):
    """A run cut short writes no gate.json: its log alone must say where the gate's time went."""
    policy = {
        "backend": "transformers",
        "layers": ["perplexity", "latency"],
        "perplexity": {"seq_len": 64, "max_windows": 2},
        "latency": {"prompt_tokens": 16, "new_tokens": 2, "repeats": 2, "warmup": 0},
    }
    with caplog.at_level("INFO", logger="compress.evals.gate.runner"):
        run_gate(base, base, policy, tmp_path, evaluation_texts=load_corpus(DataSpec()).evaluation)
    lines = [record.getMessage() for record in caplog.records]
    timed = [line for line in lines if " measured in " in line and line.endswith(" s")]
    assert {line.split(" measured in ")[0] for line in timed} >= {"gate: latency (baseline)", "gate: latency"}
    assert "gate: perplexity" in {line.split(" measured in ")[0] for line in timed}
    assert any(line.startswith("gate: loaded the baseline (transformers) in ") for line in lines), lines

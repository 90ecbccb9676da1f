"""A peer run in ``benchmarks.variants`` must calibrate on the ids of the run it is paired with: the overrides that
decide those ids reach it, anything else is refused before hours of runs start."""

import pytest

from benchmarks.variants import peer_options


def test_a_bare_peer_run_gets_the_default_calibration():
    assert peer_options([]) == (0, 0.0, 64)


def test_seed_sampling_share_and_sample_count_reach_the_peer():
    assert peer_options(["seed=2", "data.generated=1.0", "data.num_samples=16"]) == (2, 1.0, 16)


def test_an_override_that_does_not_decide_the_ids_is_refused():
    with pytest.raises(ValueError, match="stages.0.bits"):
        peer_options(["stages.0.bits=3"])


def test_the_variants_command_refuses_a_bad_peer_setting_in_one_line_before_any_run(monkeypatch):
    from benchmarks import variants

    def no_baseline(*args, **kwargs):
        raise AssertionError("the baseline was scored before the bad setting was refused")

    monkeypatch.setattr(variants, "scored_baseline", no_baseline)
    run = "llm-compressor:gptq_w4a16 stages.0.bits=3"
    monkeypatch.setattr("sys.argv", ["variants", "gptq_int4", run, "--name", "x"])
    with pytest.raises(SystemExit, match=f"^{run}: a peer run takes only .*got stages.0.bits"):
        variants.main()


def test_every_scored_text_gets_its_columns_and_a_failed_run_keeps_the_table_square():
    from benchmarks.variants import markdown

    texts = ("out_of_domain", "code", "technical", "in_domain")
    base = {text: {"perplexity": 10.0, "tokens": 100} for text in texts}
    good = {text: {"perplexity": 11.0} for text in texts} | {"seconds": 4.0}
    report = {
        "title": "t", "model": "m", "machine": "x", "threads": 2, "date": "d", "command": "c", "baseline": base,
        "rows": {"gptq_int4": good, "llm-compressor:gptq_w4a16_mse": {"error": "boom", "seconds": 1.0}},
    }  # fmt: skip
    table = [line for line in markdown(report).splitlines() if line.startswith("|")]
    assert "| Shakespeare ppl | ratio | code ppl | ratio | technical ppl | ratio | in-domain ppl | ratio |" in table[0]
    assert len({line.count("|") for line in table}) == 1
    assert table[3].count("1.100x") == 4

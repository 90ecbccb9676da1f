"""The fresh-clone timing script's arithmetic and page, without cloning (the clone and run take minutes)."""

import math

from benchmarks.fresh_clone_run import markdown, ratio


def test_the_ratio_is_the_perplexity_ratio_of_the_two_passes():
    passes = {"baseline": {"mean_nll": 3.0}, "candidate": {"mean_nll": 3.1}}
    assert math.isclose(ratio(passes), math.exp(0.1))


def test_the_page_quotes_the_timings_ratio_and_gate():
    result = {
        "date": "2026-11-27 12:00 UTC", "commit": "abc1234", "cpu": "x, 2 cores", "load_average_before": [0.1],
        "command": "make run", "setup_s": 61.0, "make_run_s": 389.0, "make_run_exit": 0, "run_wall_s": 364.4,
        "phases_s": {"sample": 115.0}, "peak_rss_mb": 1770, "out_of_domain_ratio": 1.1698, "in_domain_ratio": 1.18,
        "gate": "perplexity ×1.1698: BLOCK",
    }  # fmt: skip
    page = markdown(result)
    assert "**389.0 s** (6.5 min)" in page and "×1.1698" in page and "sample 115.0 s" in page and "BLOCK" in page

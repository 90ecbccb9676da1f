"""The serving benchmark's traffic and its summary: Poisson arrivals of mixed-length prompts (what a chat server
sees), and the latency percentiles, throughput and goodput under an SLO that ``compress bench engine`` reports."""

from __future__ import annotations

import random
import statistics


def workload(count: int, rate: float, vocab: int, seed: int) -> list[tuple[float, list[int], int]]:
    """``(arrival offset s, prompt ids, output tokens)``: 75% prompts of 16-128 tokens, 25% of 256-768."""
    rng = random.Random(seed)
    clock, requests = 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        length = rng.randint(16, 128) if rng.random() < 0.75 else rng.randint(256, 768)
        requests.append((clock, [rng.randrange(vocab) for _ in range(length)], rng.randint(16, 128)))
    return requests


def summarize(arrivals: list[float], token_times: list[list[float]], slo_ttft: float, slo_tpot: float) -> dict:
    ttft = [times[0] - arrival for arrival, times in zip(arrivals, token_times, strict=True)]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:], strict=False)]
    span = max(t[-1] for t in token_times) - min(arrivals)
    good = sum(
        1
        for first, t in zip(ttft, token_times, strict=True)
        if first <= slo_ttft and (len(t) < 2 or (t[-1] - t[0]) / (len(t) - 1) <= slo_tpot)
    )

    def pct(values):
        q = statistics.quantiles(values, n=100, method="inclusive")
        return {"p50": q[49], "p95": q[94], "p99": q[98]}

    return {
        "ttft_s": pct(ttft),
        "tpot_s": pct(tpot),
        "itl_s": pct(itl),
        "throughput_tok_s": sum(len(t) for t in token_times) / span,
        "goodput_req_s": good / span,
        "makespan_s": span,
    }

"""Latency layer: time to first token (TTFT) and time per output token (TPOT) of candidate and baseline.

Both models run in the same process on the same prompt, in alternating order (candidate first, then baseline
first, ...) so drift in the machine's speed hits both alike. The gate judges only the ratios candidate / baseline:
absolute times on shared machines say more about the machine than about the checkpoint.
"""

from __future__ import annotations

import numpy as np

from evals.generation import Generator


def _summary(samples: list[tuple[float, float]]) -> dict:
    ttft_ms = np.array([ttft for ttft, _ in samples]) * 1e3
    tpot_ms = np.array([tpot for _, tpot in samples]) * 1e3
    return {
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p95_ms": float(np.percentile(ttft_ms, 95)),
        "tpot_p50_ms": float(np.percentile(tpot_ms, 50)),
        "tpot_p95_ms": float(np.percentile(tpot_ms, 95)),
    }


def measure_latency(
    candidate: Generator, baseline: Generator, prompt_ids: list[int], new_tokens: int, repeats: int, warmup: int
) -> dict:
    """Per-model p50/p95 of TTFT and TPOT and the candidate/baseline ratios of the p50s."""
    generators = {"candidate": candidate, "baseline": baseline}
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in generators}
    for round_index in range(warmup + repeats):
        order = list(generators) if round_index % 2 == 0 else list(reversed(generators))
        for label in order:
            timing = generators[label].time_generation(prompt_ids, new_tokens)
            if round_index >= warmup:
                samples[label].append(timing)
    result = {label: _summary(label_samples) for label, label_samples in samples.items()}
    result["ttft_ratio"] = result["candidate"]["ttft_p50_ms"] / result["baseline"]["ttft_p50_ms"]
    result["tpot_ratio"] = result["candidate"]["tpot_p50_ms"] / result["baseline"]["tpot_p50_ms"]
    result.update(prompt_tokens=len(prompt_ids), new_tokens=new_tokens, repeats=repeats)
    return result

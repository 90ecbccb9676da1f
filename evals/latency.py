"""Latency layer: time to first token (TTFT) and time per output token (TPOT) of candidate and baseline.

Given both models at once (``gate.models_in_memory: 2``) they run in alternating order on the same prompt (candidate
first, then baseline first, ...) so drift in the machine's speed hits both alike; given one at a time, each is timed
in its own phase of the gate. The gate judges only the ratios candidate / baseline: absolute times on shared machines
say more about the machine than about the checkpoint.
"""

from __future__ import annotations

import numpy as np

from compress.evals.generation import Generator


def _summary(samples: list[tuple[float, float]]) -> dict:
    ttft_ms = np.array([ttft for ttft, _ in samples]) * 1e3
    tpot_ms = np.array([tpot for _, tpot in samples]) * 1e3
    return {
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p95_ms": float(np.percentile(ttft_ms, 95)),
        "tpot_p50_ms": float(np.percentile(tpot_ms, 50)),
        "tpot_p95_ms": float(np.percentile(tpot_ms, 95)),
        "ttft_ms": ttft_ms.tolist(),  # per repeat, in order: the gate pairs repeat i of both sides
        "tpot_ms": tpot_ms.tolist(),
    }


def measure_latency(
    generators: dict[str, Generator], prompt_ids: list[int], new_tokens: int, repeats: int, warmup: int
) -> dict[str, dict]:
    """p50/p95 of TTFT and TPOT per generator, the generators taking turns in alternating order each round."""
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in generators}
    for round_index in range(warmup + repeats):
        order = list(generators) if round_index % 2 == 0 else list(reversed(generators))
        for label in order:
            timing = generators[label].time_generation(prompt_ids, new_tokens)
            if round_index >= warmup:
                samples[label].append(timing)
    return {label: _summary(label_samples) for label, label_samples in samples.items()}

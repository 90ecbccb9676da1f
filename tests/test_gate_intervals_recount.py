"""The coverage recount and operating characteristic judge the slices the gate would score, with its own checks."""

import random

import pytest

from benchmarks import gate_intervals
from compress.evals.gate.policy import resolve_policy
from compress.evals.gate.windows import spread_order


def test_layouts_give_disjoint_slices_of_the_asked_size():
    for layout in gate_intervals.LAYOUTS:
        slices = gate_intervals.layout_slices(1200, 32, layout)
        flat = [index for indices in slices for index in indices]
        assert all(len(indices) == 32 for indices in slices) and len(flat) == len(set(flat))
    gate = gate_intervals.layout_slices(1200, 12, "gate")
    assert len(gate) == 1200 // 56 and gate[1] == [56 + index for index in sorted(spread_order(56)[:12])]
    with pytest.raises(ValueError, match="unknown layout"):
        gate_intervals.layout_slices(100, 12, "random")


def _texts(shift: float) -> dict:
    rng = random.Random(0)
    base = [3.0 + rng.gauss(0, 0.3) for _ in range(1200)]
    model = {"window_nll": [value + shift + rng.gauss(0, 0.02) for value in base],
             "window_kl": [abs(rng.gauss(shift, shift / 3)) for _ in base]}  # fmt: skip
    return {"synthetic/1200": {"windows": 1200, "models": {"baseline": {"window_nll": base}, "m": model}}}


def test_the_recount_stores_every_slice_and_counts_misses_on_the_false_pass_side():
    policy = resolve_policy(None)
    found = gate_intervals.recount(_texts(0.01), policy)
    stored = found["slices"]["synthetic/1200"]["m"]
    assert len(stored["perplexity"]["contiguous"]["12"]["low"]) == 100
    cell = next(c for c in found["cells"] if c["metric"] == "kl" and c["layout"] == "spread" and c["size"] == 12)
    highs, truth = stored["kl"]["spread"]["12"]["high"], stored["whole_text"]["kl"]
    assert cell["above_upper"]["rate"] == pytest.approx(sum(truth > high for high in highs) / len(highs))


def test_the_operating_characteristic_passes_a_lossless_model_and_blocks_a_lossy_one():
    policy = resolve_policy(None)
    presets = {"default": (policy, 0.99, 32)}
    lossless = gate_intervals.operating_characteristic(_texts(0.001), presets)["default"]
    lossy = gate_intervals.operating_characteristic(_texts(0.5), presets)["default"]
    assert all(row["pass"]["rate"] == 1.0 for row in lossless["rows"])
    assert all(row["block"]["rate"] == 1.0 for row in lossy["rows"])
    assert lossy["goals"]["perplexity"]["at_or_past_limit"] == 1 and not lossy["goals"]["perplexity"]["pass_misses"]

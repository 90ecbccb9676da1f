"""The run report's phase spans (epoch seconds) let a sampler outside the process attribute its samples to a phase
(benchmarks/gpu_e2e.py); a CPU run records no GPU peaks."""

from __future__ import annotations

import time

from compress.app.run_report import Timer


def test_every_phase_is_recorded_as_a_span_in_order_and_repeats_are_summed():
    timer = Timer()
    before = time.time()
    for name in ("data", "sample", "data"):
        with timer.phase(name):
            time.sleep(0.01)
    after = time.time()
    assert [span[0] for span in timer.spans] == ["data", "sample", "data"]
    starts_and_ends = [t for _, start, end in timer.spans for t in (start, end)]
    assert before <= starts_and_ends[0] and starts_and_ends == sorted(starts_and_ends) and starts_and_ends[-1] <= after
    data = sum(end - start for name, start, end in timer.spans if name == "data")
    assert abs(timer.seconds["data"] - data) < 1e-6  # one measurement (epoch floats resolve ~0.2 µs), not two clocks
    assert timer.peak_gpu_mb == {}  # CUDA never initialised here


def test_each_phase_logs_its_seconds_as_it_ends_even_when_it_raises(caplog):
    """A run cut short writes no report.json; its log must still say what each finished phase took."""
    timer = Timer()
    with caplog.at_level("INFO", logger="compress.app.run_report"):
        with timer.phase("sample"):
            time.sleep(0.1)
        try:
            with timer.phase("compress"):
                raise RuntimeError("killed")
        except RuntimeError:
            pass
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["sample", "compress"]
    assert float(lines[0].split(": ")[1].removesuffix(" s")) >= 0.1

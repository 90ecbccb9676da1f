"""The run report says which phase raised the peak RSS, so a run that does not fit names the step to shrink."""

from __future__ import annotations

import os

from compress.app.run_report import Timer, peak_rss_mb


def _touch(megabytes: int) -> None:
    block = bytearray(megabytes * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])  # resident once written


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_phase_that_raises_the_peak_is_named_with_its_rise_and_one_below_the_peak_is_not():
    timer = Timer()
    above_peak = int(peak_rss_mb() - _resident_mb()) + 200  # earlier tests in this process may have set a high mark
    with timer.phase("allocate"):
        _touch(above_peak)
    with timer.phase("small"):
        _touch(16)
    assert timer.peak_rise_mb["allocate"] > 150
    assert "small" not in timer.peak_rise_mb  # below the high-water mark the first phase left
    assert set(timer.seconds) == {"allocate", "small"}

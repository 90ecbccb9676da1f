"""A peer run in ``benchmarks.variants`` must calibrate on the ids of the run it is paired with: the overrides that
decide those ids reach it, anything else is refused before hours of runs start."""

import pytest

from benchmarks.variants import peer_options


def test_a_bare_peer_run_gets_the_default_calibration():
    assert peer_options([]) == (0, 0.0, 64)


def test_seed_sampling_share_and_sample_count_reach_the_peer():
    assert peer_options(["seed=2", "data.generated=1.0", "data.num_samples=16"]) == (2, 1.0, 16)


def test_an_override_that_does_not_decide_the_ids_is_refused():
    with pytest.raises(SystemExit, match="stages.0.bits"):
        peer_options(["stages.0.bits=3"])

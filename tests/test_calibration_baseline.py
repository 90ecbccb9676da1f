"""The calibration benchmark's baseline pass is scored once per model and text: a second run reads the per-window
NLL and the KL reference from the cache (the same numbers), and a changed model or a longer ask scores again."""

from __future__ import annotations

import torch
from helpers import build_tiny_llama

from benchmarks.calibration_baseline import baseline_pass

SEQ_LEN, TOP_K = 16, 4


def _pass(model, folder, ids, windows, cache):
    return baseline_pass(model, folder, ids, windows, SEQ_LEN, TOP_K, cache)


def test_the_baseline_pass_is_cached_and_read_back_identically(tmp_path):
    model = build_tiny_llama()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    ids = torch.randint(0, 320, (SEQ_LEN * 6,), generator=torch.Generator().manual_seed(0))
    cache = tmp_path / "references"
    scored, reference = _pass(model, folder, ids, 6, cache)
    assert "cached_reference" not in scored and len(scored["window_nll"]) == 6
    again, cached = _pass(model, folder, ids, 4, cache)  # fewer windows: the first four of the cached six
    assert again["cached_reference"] and again["window_nll"] == scored["window_nll"][:4]
    assert set(cached) == set(reference) and all(torch.equal(cached[k], reference[k][:4]) for k in reference)

    longer, _ = _pass(model, folder, torch.cat([ids, ids[:SEQ_LEN]]), 7, cache)  # another text: scored
    assert "cached_reference" not in longer and longer["window_nll"][:6] == scored["window_nll"]
    more, _ = _pass(model, folder, ids, 6, cache)
    assert more["cached_reference"]
    build_tiny_llama(seed=1).save_pretrained(folder)  # the weights rewritten: the fingerprint changes
    changed, _ = _pass(build_tiny_llama(seed=1), folder, ids, 6, cache)
    assert "cached_reference" not in changed and changed["window_nll"] != scored["window_nll"]

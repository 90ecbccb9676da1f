"""The exact full-vocabulary KL (``gate.kl.full_vocab``) and the KL report of llama.cpp's perplexity tool, on tiny
random models with a real tokenizer: each figure against a direct torch computation from both models' logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import save, scale_by_noise, tiny_model_for

from compress.base.data import tokenize
from compress.base.errors import CompressError
from compress.evals.divergence import DivergenceMeter, FullReference, ReferenceRecorder, scratch_tensor
from compress.evals.gate import run_gate
from compress.evals.perplexity import evaluation_windows, perplexity

SEQ_LEN, WINDOWS, BATCH = 64, 4, 2
T_975_3_DEGREES = 3.1824  # Student t, two-sided 95%, 3 degrees of freedom (4 windows)


@pytest.fixture(scope="module")
def models(tokenizer):
    return tiny_model_for(tokenizer), scale_by_noise(tiny_model_for(tokenizer), strength=1.0)


@pytest.fixture(scope="module")
def ids(tokenizer, texts):
    return tokenize(tokenizer, "\n\n".join(texts))


@pytest.fixture(autouse=True)
def isolated_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))


def direct(models, ids) -> dict[str, torch.Tensor]:
    """Both models' log-probabilities at every scored position of the first windows, straight from their logits:
    the full KL, the top tokens and the actual next token's probabilities."""
    windows = evaluation_windows(ids, SEQ_LEN, WINDOWS)
    with torch.no_grad():
        baseline, candidate = (F.log_softmax(model(input_ids=windows).logits[:, :-1].float(), -1) for model in models)
    targets = windows[:, 1:, None]
    return {
        "kl": (baseline.exp() * (baseline - candidate)).sum(-1),
        "same_top": baseline.argmax(-1) == candidate.argmax(-1),
        "delta_p": candidate.gather(-1, targets)[..., 0].exp() - baseline.gather(-1, targets)[..., 0].exp(),
    }


def measured(models, ids, reference) -> DivergenceMeter:
    """The gate's way: the baseline's pass records ``reference``, the candidate's pass measures against it."""
    baseline, candidate = models
    perplexity(baseline, ids, SEQ_LEN, BATCH, WINDOWS, progress=False, observer=reference)
    tensors = reference if isinstance(reference, FullReference) else reference.tensors()
    meter = DivergenceMeter(tensors)
    perplexity(candidate, ids, SEQ_LEN, BATCH, WINDOWS, progress=False, observer=meter)
    return meter


def test_full_vocab_kl_is_the_full_kl_of_the_two_models_and_the_top_k_kl_stays_below_it(models, ids, tmp_path):
    truth = direct(models, ids)
    full = measured(models, ids, FullReference(WINDOWS, SEQ_LEN - 1, directory=tmp_path))
    top_k = measured(models, ids, ReferenceRecorder(WINDOWS, SEQ_LEN - 1, top_k=16))
    assert truth["kl"].mean() > 0.05  # far enough apart that KL(candidate ‖ baseline) differs from it
    # the baseline's log-probabilities are kept in fp16: ~1e-3 of each, renormalized
    assert torch.allclose(full.kl, truth["kl"], rtol=1e-2, atol=1e-4)
    assert full.summary()["kl_mean"] == pytest.approx(float(truth["kl"].double().mean()), rel=2e-3)
    assert (top_k.kl <= truth["kl"] + 1e-5).all()
    assert top_k.summary()["kl_mean"] < 0.99 * full.summary()["kl_mean"]
    assert [meter.summary()["kl_vocabulary"] for meter in (full, top_k)] == ["full", "top-16 plus the rest"]
    assert not list(tmp_path.iterdir())  # the reference's file has no name on disk, only its mapping


def test_the_full_vocab_kl_of_a_model_against_itself_is_zero(models, ids, tmp_path):
    baseline, _ = models
    itself = measured((baseline, baseline), ids, FullReference(WINDOWS, SEQ_LEN - 1, directory=tmp_path)).summary()
    assert itself["kl_mean"] == pytest.approx(0, abs=1e-5) and itself["same_top"] == 1.0
    assert itself["delta_p_mean"] == pytest.approx(0, abs=1e-6)


def test_the_summary_gives_llama_cpp_s_statistics_with_intervals_over_windows(models, ids, tmp_path):
    truth = direct(models, ids)
    summary = measured(models, ids, FullReference(WINDOWS, SEQ_LEN - 1, directory=tmp_path)).summary()
    percentiles = torch.tensor([0.999, 0.99, 0.95, 0.9, 0.5], dtype=torch.float64)
    expected = torch.quantile(truth["kl"].flatten().double(), percentiles).tolist()
    reported = [summary[key] for key in ("kl_p99.9", "kl_p99", "kl_p95", "kl_p90", "kl_p50")]
    assert reported == pytest.approx(expected, rel=2e-2, abs=1e-4)
    assert summary["kl_max"] == pytest.approx(float(truth["kl"].max()), rel=2e-2)
    assert summary["tokens"] == WINDOWS * (SEQ_LEN - 1)
    for name in ("delta_p", "same_top"):
        per_window = truth[name].double().mean(1)
        assert per_window.std() > 0  # an interval of width zero would match a token-level one as well
        mean = float(per_window.mean())
        half = T_975_3_DEGREES * float(per_window.std()) / math.sqrt(WINDOWS)  # over windows, not tokens
        estimate = summary["delta_p_mean" if name == "delta_p" else "same_top"]
        assert estimate == pytest.approx(mean, abs=1e-4)
        assert summary[f"{name}_low"] == pytest.approx(mean - half, abs=1e-3)
        assert summary[f"{name}_high"] == pytest.approx(mean + half, abs=1e-3)


@pytest.mark.parametrize("models_in_memory", [1, 2])
def test_the_gate_judges_the_full_vocab_kl_in_either_order_of_work(tokenizer, texts, tmp_path, models_in_memory):
    root = tmp_path / "models"
    baseline = save(tiny_model_for(tokenizer), tokenizer, root / "baseline")
    candidate = save(scale_by_noise(tiny_model_for(tokenizer), strength=0.05), tokenizer, root / "candidate")
    policy = {
        "layers": ["perplexity", "kl"], "backend": "transformers", "domains": [], "models_in_memory": models_in_memory,
        "cache_dir": str(tmp_path / "cache"), "perplexity": {"seq_len": SEQ_LEN, "max_windows": WINDOWS},
        "kl": {"max_mean": 10.0},
    }  # fmt: skip
    top_k = run_gate(candidate, baseline, policy, tmp_path / "top-k", evaluation_texts=texts).layer("kl")
    full_policy = {**policy, "kl": {"max_mean": 10.0, "full_vocab": True}}
    full = run_gate(candidate, baseline, full_policy, tmp_path / "full", evaluation_texts=texts)
    kl = full.layer("kl")
    assert kl.verdict == "pass", full.reasons
    assert kl.metrics["candidate"]["kl_vocabulary"] == "full" and kl.metrics["candidate"]["reference_cached"] is None
    assert top_k.metrics["candidate"]["kl_vocabulary"] == "top-32 plus the rest"
    assert 0 < top_k.estimate < kl.estimate  # the top-k figure is a lower bound
    assert not list((tmp_path / "cache").glob(".full-vocab-*"))
    markdown = (tmp_path / "full" / "gate.md").read_text()
    assert "## KL statistics" in markdown and "over the full vocabulary" in markdown and "mean Δp" in markdown


def test_a_full_vocab_reference_the_disk_cannot_hold_is_one_clear_error(tmp_path):
    petabytes = (10**9, 10**6)  # 2 PB of fp16
    with pytest.raises(CompressError, match=r"gate\.kl\.full_vocab=true .* point gate\.cache_dir at a disk"):
        scratch_tensor(petabytes, torch.float16, tmp_path)
    assert not list(tmp_path.iterdir())

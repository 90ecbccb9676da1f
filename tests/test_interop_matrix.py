"""``benchmarks/interop_matrix.py``'s pieces, in seconds: the transformers check on a tiny RTN checkpoint (same logits
as our reader), the reading of the vLLM script's output (a refusal's root cause, a killed generation), and the rows
and summary it writes, with and without vLLM."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_tokenizer

from benchmarks.interop_matrix import (
    RESULT_MARK,
    cheapest_first,
    checkpoint_format,
    fingerprint,
    merged,
    recipes,
    reusable,
    transformers_check,
    vllm_check,
    vllm_outcome,
)
from benchmarks.interop_report import format_row, render, summary
from compress import oneshot

RTN = [{"type": "rtn", "bits": 4, "group_size": 64, "symmetric": True, "ignore": ["lm_head"]}]


def test_transformers_reads_a_tiny_rtn_checkpoint_as_our_reader_does(tmp_path, artifacts):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    folder = oneshot(str(tmp_path / "model"), RTN, data=ids, output_dir=tmp_path / "checkpoint")
    assert checkpoint_format(folder) == "pack-quantized"
    check = transformers_check(folder, ["def f(x):", "The module"])
    assert check["loaded"] and check["ran"], check
    assert check["relative"] < 1e-5 and check["max_abs"] < 1e-4 and check["same_top1"] == 1.0
    # a later run reuses this row only for the same checkpoint and the same vLLM
    row = {"recipe": "r", "fingerprint": fingerprint(folder), "vllm_python": None}
    assert reusable({"r": row}, "r", folder, None) is row
    assert reusable({"r": row}, "r", folder, "/venv/bin/python") is None
    (folder / "extra.txt").write_text("changed")
    assert reusable({"r": row}, "r", folder, None) is None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_an_fp32_w4a4_checkpoint_is_compared_in_the_bf16_transformers_runs_it_in(tmp_path, artifacts, fmt):
    """compressed-tensors runs FP4 in bf16 only; W4A4's activation rounding makes fp32 against bf16 differ by whole
    FP4 steps (0.16-0.19 relative here, 0.24-0.56 on the default model), so the check runs our reader in bf16 too."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    stage = {"type": "rtn", "bits": 4, "symmetric": True, "format": fmt, "activations": "fp4", "ignore": ["lm_head"]}
    stage["group_size"] = 16 if fmt == "nvfp4" else 32
    folder = oneshot(str(tmp_path / "model"), [stage], data=ids, output_dir=tmp_path / "checkpoint")
    check = transformers_check(folder, ["def f(x):", "The module", "Once upon a time, in a small village,"])
    assert check["ran"] and check["dtype"] == "bfloat16", check
    assert check["relative"] < 1e-2 and check["same_top1"] == 1.0, check
    assert "ours run in bf16 too" in format_row({"recipe": fmt, "format": "f", "transformers": check, "vllm": {}})


def test_a_checkpoint_transformers_cannot_read_is_a_row_not_a_crash(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {}}))
    check = transformers_check(tmp_path, ["x"])
    assert not check["ran"] and check["error"].startswith("our reader: ")
    assert "**fails to load**" in format_row({"recipe": "r", "format": "dense", "transformers": check, "vllm": {}})


def test_a_refusal_reports_the_root_cause_not_the_wrapper():
    wrapper = "RuntimeError: Engine core initialization failed"
    stdout = RESULT_MARK + json.dumps({"accepted": False, "generated": False, "text": None, "error": wrapper})
    stderr = (
        "INFO loading\nValueError: Sparsity support has been removed from compressed-tensors.\n"
        f"{wrapper}. See root cause above.\n"
    )
    result = vllm_outcome(stdout, stderr, 0, 60)
    assert not result["accepted"]
    assert result["error"] == "ValueError: Sparsity support has been removed from compressed-tensors."


def test_a_generation_killed_at_the_timeout_was_still_accepted():
    stdout = RESULT_MARK + json.dumps({"accepted": True, "generated": False, "error": "generation did not finish"})
    result = vllm_outcome(stdout, "", None, 180)
    assert result["accepted"] and not result["generated"]
    assert result["error"] == "timed out after 180 s generating"
    killed_early = vllm_outcome("", "INFO Loading weights took 0.75 seconds\n", None, 180)
    assert killed_early["accepted"] and killed_early["error"] == "timed out after 180 s generating"


def test_rows_and_summary_with_and_without_vllm(tmp_path):
    ran = {"loaded": True, "ran": True, "dtype": "auto", "max_abs": 0.0, "relative": 0.0, "same_top1": 1.0}
    absent = vllm_check(None, tmp_path, 60)
    row = format_row({"recipe": "rtn_int4", "format": "pack-quantized", "transformers": ran, "vllm": absent})
    assert row.count("not installed") == 2 and row.startswith("| rtn_int4 | pack-quantized | loads; max abs")
    generated = {"accepted": True, "generated": True, "text": " Paris|x", "error": None}
    refused = {"accepted": False, "generated": False, "text": None, "error": "ValueError: no"}
    rows = [
        {"recipe": "a", "format": "f", "transformers": ran, "vllm": generated},
        {"recipe": "b", "format": "f", "transformers": ran, "vllm": refused},
        {"recipe": "c", "skipped": "--deadline-minutes 1 ran out"},
    ]
    assert 'yes: "Paris\\|x"' in format_row(rows[0]) and format_row(rows[1]).endswith("| ValueError: no |")
    assert format_row(rows[2]) == "| c | — | not run: --deadline-minutes 1 ran out | — | — | |"  # was a KeyError
    assert summary(rows) == "3 recipes: 2 load and run in transformers; in vLLM 1 accepted, 1 generate, 1 refused."
    assert summary([rows[0] | {"vllm": absent}]).endswith("vLLM not installed.")


def test_every_shipped_recipe_is_in_the_matrix_once():
    names = recipes()
    assert len(names) >= 23 and "_base" not in names and sorted(cheapest_first(names)) == names


def test_rows_of_recipes_not_asked_for_are_kept_from_the_previous_json():
    previous = {
        "gptq_int4": {"recipe": "gptq_int4", "old": True},
        "awq_int4": {"recipe": "awq_int4", "old": True},
        "gone_recipe": {"recipe": "gone_recipe"},
    }
    rows = merged([{"recipe": "awq_int4", "old": False}], previous)
    assert [(row["recipe"], row["old"]) for row in rows] == [("awq_int4", False), ("gptq_int4", True)]


def test_a_row_keeps_the_cpu_it_was_measured_on():
    """vLLM's CPU kernels differ by machine (int4 GEMM needs AMX): a row measured before on another CPU keeps that
    CPU, and the page names each row's CPU once they differ, instead of stamping this run's CPU on every row."""
    ran = {"loaded": True, "ran": True, "dtype": "auto", "max_abs": 0.0, "relative": 0.0, "same_top1": 1.0}
    vllm = {"accepted": True, "generated": False, "text": None, "error": "AttributeError: no cpu_gemm_wna16"}
    previous = {"gptq_int4": {"recipe": "gptq_int4", "format": "f", "transformers": ran, "vllm": vllm}}
    new = {"recipe": "awq_int4", "format": "f", "transformers": ran, "vllm": vllm, "cpu": "AMD EPYC"}
    rows = merged([new], previous, previous_cpu="Intel Xeon (amx_int8)")
    assert [row["cpu"] for row in rows] == ["AMD EPYC", "Intel Xeon (amx_int8)"]
    meta = {"date": "d", "cpu": "AMD EPYC", "versions": {}, "vllm": None, "command": "c"}
    page = render(rows, meta, [], ["p"])
    assert "| vLLM message | CPU |" in page and page.count("| Intel Xeon (amx_int8) |") == 1
    assert "rows measured on another CPU" in page
    alone = render(rows[:1], meta, [], ["p"])
    assert "| CPU |" not in alone and "| vLLM message |" in alone  # one CPU: said once, above the table

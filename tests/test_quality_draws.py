"""``benchmarks.quality_draws``: one resumable command measures the draws the quality table lacks. End to end on a
tiny random Llama: a real compression subprocess, the reloaded checkpoint scored on the whole text panel, the file
read back by the quality table; a second invocation runs nothing."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import quality_draws
from benchmarks.quality_table import build


def test_missing_draws_skip_calibration_free_seeds_and_rerun_failures_and_older_recipes():
    now = {"gptq_int4": "new", "rtn_int4": "r", "fp8_dynamic": "f"}
    stored = {"rows": {"gptq_int4": {"seconds": 1.0, "recipe_fingerprint": "new"},
                       "gptq_int4 seed=1": {"error": "exit 1", "seconds": 1.0, "recipe_fingerprint": "new"},
                       "gptq_int4 seed=2": {"seconds": 1.0, "recipe_fingerprint": "old"},
                       "rtn_int4": {"seconds": 1.0}}}  # fmt: skip
    todo = quality_draws.missing(stored, ["gptq_int4", "rtn_int4"], [0, 1, 2], now)
    assert todo == [("gptq_int4", 1), ("gptq_int4", 2), ("rtn_int4", 0)]
    stored["rows"]["gptq_int4 stages.0.x=1 seed=2"] = {"seconds": 1.0, "recipe_fingerprint": "new"}
    # a candidate's draw of the settings the recipe ships now counts for it, whatever the row is named
    assert quality_draws.missing(stored, ["gptq_int4"], [0, 1, 2], now) == [("gptq_int4", 1)]
    assert quality_draws.missing(None, ["fp8_dynamic"], [3, 4], now) == [("fp8_dynamic", 3)]


def test_llm_compressors_data_free_presets_are_one_draw_as_ours_are():
    """Its FP8 presets (per-channel weights, activations quantized at run time) and its round-to-nearest W4A16
    (min-max weights) read nothing from the calibration windows they are passed, as our fp8_dynamic, fp8_block and
    rtn_int4: one draw is every draw, not "1 of 3"; its GPTQ is drawn three times."""
    specs = [
        "llm-compressor:fp8_dynamic", "llm-compressor:fp8_block", "llm-compressor:rtn_w4a16",
        "llm-compressor:gptq_w4a16",
    ]  # fmt: skip
    assert quality_draws.wanted(specs, [0, 1, 2]) == [
        ("llm-compressor:fp8_dynamic", 0),
        ("llm-compressor:fp8_block", 0),
        ("llm-compressor:rtn_w4a16", 0),
        *[("llm-compressor:gptq_w4a16", seed) for seed in (0, 1, 2)],
    ]


def test_a_recipe_fingerprint_follows_its_stages_and_overrides():
    shipped = quality_draws.recipe_fingerprint("gptq_int4")
    assert shipped == quality_draws.recipe_fingerprint("gptq_int4 stages.0.act_order=true")  # what it ships
    assert shipped != quality_draws.recipe_fingerprint("gptq_int4 stages.0.act_order=false")
    assert shipped != quality_draws.recipe_fingerprint("gptq_int3")


def test_a_spec_that_does_not_compose_is_refused_by_name_before_any_draw():
    """lora_merge_awq_int4 ships no adapters: one line naming the spec and the fix, not a traceback after the
    baseline, and nothing drawn for the specs before it."""
    with pytest.raises(SystemExit) as refused:
        quality_draws.fingerprints(["gptq_int4", "lora_merge_awq_int4"])
    message = str(refused.value)
    assert message.startswith("lora_merge_awq_int4: ") and "stages.<i>.adapters" in message
    assert set(quality_draws.fingerprints(["gptq_int4"])) == {"gptq_int4"}


PEER_SPEC = "llm-compressor:awq_gptq_w4a16_mse data.generated=1.0 data.num_samples=32"


def install_peer(root: Path, version: str) -> None:
    """What ``pip install --target artifacts/peer-site llmcompressor==VERSION`` leaves for the version lookup."""
    for old in (root / "artifacts" / "peer-site").glob("llmcompressor-*.dist-info"):
        (old / "METADATA").unlink()
        old.rmdir()
    info = root / "artifacts" / "peer-site" / f"llmcompressor-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llmcompressor\nVersion: {version}\n")


def test_a_peer_spec_is_refused_by_name_until_the_peer_is_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(quality_draws, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"^llm-compressor:awq_gptq_w4a16_mse .*: llm-compressor is not installed"):
        quality_draws.fingerprints(["gptq_int4", PEER_SPEC])
    install_peer(tmp_path, "0.14.0.1")
    assert set(quality_draws.fingerprints([PEER_SPEC])) == {PEER_SPEC}
    refused = [
        (f"{PEER_SPEC} seed=1", "seeds come from --seeds"),
        ("llm-compressor:w9", "no llm-compressor preset"),
        (f"{PEER_SPEC} stages.0.bits=3", "takes only data.generated, data.num_samples; got stages.0.bits"),
    ]
    for bad, why in refused:
        with pytest.raises(SystemExit, match=why):
            quality_draws.fingerprints([bad])


def test_a_peer_draw_follows_its_preset_calibration_settings_and_version(tmp_path, monkeypatch):
    """Seeds of one peer spec gather in one file: a draw counts while the preset, the settings its ids are cut with
    and llm-compressor's version stay; another version's draws are run again."""
    monkeypatch.setattr(quality_draws, "ROOT", tmp_path)
    install_peer(tmp_path, "0.14.0.1")
    first = quality_draws.recipe_fingerprint(PEER_SPEC)
    assert first != quality_draws.recipe_fingerprint("llm-compressor:awq_gptq_w4a16_mse data.generated=1.0")
    assert first != quality_draws.recipe_fingerprint(PEER_SPEC.replace("awq_gptq_w4a16_mse", "gptq_w4a16_mse"))
    stored = {"rows": {f"{PEER_SPEC} seed=1": {"seconds": 1.0, "recipe_fingerprint": first}}}
    assert quality_draws.missing(stored, [PEER_SPEC], [0, 1, 2], {PEER_SPEC: first}) == [(PEER_SPEC, 0), (PEER_SPEC, 2)]
    install_peer(tmp_path, "0.15.0")
    newer = quality_draws.recipe_fingerprint(PEER_SPEC)
    assert newer != first and len(quality_draws.missing(stored, [PEER_SPEC], [0, 1, 2], {PEER_SPEC: newer})) == 3


def test_the_dry_run_plan_reads_each_recipes_time_from_the_quality_table(tiny_model_dir, tmp_path):
    row = {"recipe": "gptq_int4", "overrides": [], "ratios": {"out_of_domain": {}}, "draws": 3, "threads": 2}
    runs = [{**row, "seconds": 74.0}, {**row, "overrides": ["stages.0.act_order=false"], "seconds": 162.0}]
    (tmp_path / "quality.json").write_text(json.dumps({"models": {tiny_model_dir.name: {"runs": runs}}}))
    found = quality_draws.compress_seconds(["gptq_int4", "gptq_int3"], tmp_path, str(tiny_model_dir))
    assert found == {"gptq_int4": 74.0, "gptq_int3": None}
    assert quality_draws.compress_seconds(["gptq_int4"], tmp_path / "none", str(tiny_model_dir)) == {"gptq_int4": None}


def test_a_file_scored_against_another_baseline_is_refused():
    with pytest.raises(SystemExit, match="code perplexity 10.0 differs"):
        quality_draws.check_same_baseline({"code": {"perplexity": 10.0}}, {"code": {"perplexity": 10.1}}, Path("f"))
    quality_draws.check_same_baseline({"code": {"perplexity": 10.0}}, {"code": {"perplexity": 10.0002}}, Path("f"))


def test_one_command_measures_what_is_missing_and_the_table_reads_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    argv = ["quality_draws", "--recipes", "rtn_int4", "--model", str(tiny_model_dir), "--max-windows", "2",
            "--threads", "1", "--results", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    quality_draws.main()  # rtn_int4 is calibration-free: one draw, exit 0 (no SystemExit)
    report = json.loads((tmp_path / "quality-draws.json").read_text())
    assert list(report["rows"]) == ["rtn_int4"] and report["threads"] == 1
    assert set(report["rows"]["rtn_int4"]) >= {"out_of_domain", "code", "technical", "in_domain", "size_mb"}
    assert report["rows"]["rtn_int4"]["stages"]["0:rtn"]["algorithm"]  # what the stage did, from stages.json
    assert report["rows"]["rtn_int4"]["cpu"] and "calibration_sha256" not in report["rows"]["rtn_int4"]  # data-free
    assert report["rows"]["rtn_int4"]["command"] == report["command"]  # the invocation that measured it
    (run,) = build(["quality-draws"], tmp_path)[tiny_model_dir.name]["runs"]
    assert list(run["ratios"]) == ["out_of_domain", "code", "technical", "in_domain"] and run["threads"] == 1
    quality_draws.main()
    assert "0 draws to run: none" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv[:-4], "--threads", "2", "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="at 1 torch threads"):
        quality_draws.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--recipes", "gptq_int4", "--seeds", "0", "1", "--dry-run"])
    quality_draws.main()  # lists, runs nothing: the file keeps its one row
    assert "  gptq_int4 seed=1: not measured before" in capsys.readouterr().out
    assert list(json.loads((tmp_path / "quality-draws.json").read_text())["rows"]) == ["rtn_int4"]


def test_a_run_shown_under_a_shipped_name_is_that_recipe():
    """The quality table shows a run spelled as overrides under the recipe that ships them (SHIPPED_AS): only while
    both compose to the same stages (every setting, defaults included) and calibration, which is what decides a
    draw."""
    from benchmarks.quality_table import SHIPPED_AS
    from compress.app.recipe import compose
    from compress.stages import build_chain

    def composed(spec: str) -> tuple:
        recipe, *overrides = spec.split()
        config = compose(recipe, overrides)
        stages = [dataclasses.asdict(stage.config) for stage in build_chain(config.stages)]
        return stages, dataclasses.asdict(config.data), config.calibration_batch_size

    assert SHIPPED_AS
    for spelled, name in SHIPPED_AS.items():
        assert composed(spelled) == composed(name), spelled


def test_a_write_cut_short_keeps_every_earlier_draw_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """Hours of draws live in one file rewritten after every draw: a kill or a full disk in the middle of that write
    must leave the previous file whole, not a torn JSON that the next invocation cannot read."""
    before = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "quality-draws.json").read_text())
    quality_draws.save_report(before, tmp_path, "draws")
    after = {**before, "rows": {**before["rows"], "gptq_int4 seed=9": next(iter(before["rows"].values()))}}
    write_text = Path.write_text

    def torn(self: Path, text: str, *args, **kwargs) -> int:
        write_text(self, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError, match="No space"):
        quality_draws.save_report(after, tmp_path, "draws")
    monkeypatch.undo()
    assert json.loads((tmp_path / "draws.json").read_text()) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["draws.json", "draws.md"]


def test_a_changed_stage_default_makes_older_draws_stale(monkeypatch):
    """A draw depends on every setting its stages run with, not only those its recipe file writes down: a default
    changed in the code (here GPTQ's retries of a failed Cholesky, which gptq_int4 does not set) must change the
    fingerprint, so the older draws are drawn again."""
    from compress.stages.gptq import GPTQConfig, GPTQStage

    before = quality_draws.recipe_fingerprint("gptq_int4")

    @dataclasses.dataclass
    class DampedMore(GPTQConfig):
        max_damp_retries: int = GPTQConfig.max_damp_retries + 1

    monkeypatch.setattr(GPTQStage, "Config", DampedMore)
    assert quality_draws.recipe_fingerprint("gptq_int4") != before


def test_a_file_of_version_1_fingerprints_is_upgraded_where_its_rows_are_todays_recipe():
    """Draws recorded with the stages as written keep counting once the fingerprint covers the defaults too: a row
    whose old fingerprint is what its recipe writes today gets today's full fingerprint; a row of an older recipe,
    of a spec that no longer composes, or of a peer keeps its own."""
    written = quality_draws.written_fingerprint(quality_draws.composed("gptq_int4"))
    rows = {"gptq_int4": {"seconds": 1.0, "recipe_fingerprint": written},
            "gptq_int4 seed=1": {"seconds": 1.0, "recipe_fingerprint": "older"},
            "gptq_int4 stages.0.act_order=true seed=2": {"seconds": 1.0, "recipe_fingerprint": written},
            "gptq_int4 stages.0.gone=1": {"seconds": 1.0, "recipe_fingerprint": "x"},
            f"{PEER_SPEC} seed=1": {"seconds": 1.0, "recipe_fingerprint": "peer"}}  # fmt: skip
    report, changed = quality_draws.upgraded({"rows": rows})
    now = quality_draws.recipe_fingerprint("gptq_int4")
    assert changed == 2 and report["fingerprint_version"] == quality_draws.FINGERPRINT_VERSION
    assert [row["recipe_fingerprint"] for row in report["rows"].values()] == [now, "older", now, "x", "peer"]
    assert quality_draws.missing(report, ["gptq_int4"], [0, 1, 2], {"gptq_int4": now}) == [("gptq_int4", 1)]
    assert quality_draws.upgraded(report) == (report, 0)


def test_the_draws_files_in_the_repo_carry_todays_fingerprint_version():
    for path in (Path(__file__).parents[1] / "benchmarks" / "results").glob("quality-draws*.json"):
        assert json.loads(path.read_text()).get("fingerprint_version") == quality_draws.FINGERPRINT_VERSION, path


def test_a_calibrated_draw_records_the_digest_of_the_windows_its_checkpoint_names(tmp_path):
    from helpers import build_tiny_llama

    from benchmarks.variants import calibration_facts
    from compress import oneshot
    from compress.base.data import token_digest

    samples = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    chain = [{"type": "gptq", "bits": 4, "group_size": 32}]
    checkpoint = oneshot(build_tiny_llama(seed=3), chain, data=samples, output_dir=tmp_path / "ckpt")
    assert calibration_facts(checkpoint) == {"calibration_sha256": token_digest(samples)}
    assert calibration_facts(tmp_path) == {}  # a draw older than the record names none


def test_a_peer_checkpoint_names_its_windows_as_ours_does_so_their_pair_is_checked(tmp_path):
    """llm-compressor's checkpoint on the ids ours was calibrated on carries the same record: the pair of the two
    draws is shown to share its windows instead of being taken at its seed's word."""
    from helpers import build_tiny_llama

    from benchmarks.peer_llmcompressor import write_calibration
    from benchmarks.variants import calibration_facts
    from compress import oneshot

    samples = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    chain = [{"type": "gptq", "bits": 4, "group_size": 32}]
    ours = oneshot(build_tiny_llama(seed=3), chain, data=samples, output_dir=tmp_path / "ours")
    (tmp_path / "peer").mkdir()
    write_calibration(tmp_path / "peer", samples)
    assert (tmp_path / "peer" / "calibration.json").read_text() == (ours / "calibration.json").read_text()
    assert calibration_facts(tmp_path / "peer") == calibration_facts(ours) != {}


def test_a_draws_file_names_every_invocation_that_measured_its_rows_not_only_the_latest():
    from benchmarks.variants import markdown

    base = {"out_of_domain": {"perplexity": 10.0, "tokens": 100}}
    row = {"out_of_domain": {"perplexity": 11.0}, "seconds": 4.0}
    rows = {"a": row, "b": row | {"command": "first"}, "c": row | {"command": "first"}, "d": row | {"command": "last"}}
    report = {"title": "t", "model": "m", "machine": "x", "threads": 2, "date": "d", "command": "last",
              "baseline": base, "rows": rows}  # fmt: skip
    text = markdown(report)
    assert "- `first`: 2 runs (b, c)" in text and "- `last`: 1 run (d)" in text
    assert "- not recorded (rows measured before a row named its command; each row's `date` is in the JSON): 1 run" in (
        text
    )
    assert "Command: `c`" in markdown(report | {"command": "c", "rows": {"a": row}})  # one invocation: one line

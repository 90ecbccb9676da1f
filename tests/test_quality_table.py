"""The quality table and README's results section come from the result files through one script: a hand edit, a stale
table or a figure no file holds fails here. Reads JSON only (no model, no torch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from benchmarks import quality_table
from benchmarks.quality_readme import README, current_section, readme_section, replace_section
from benchmarks.quality_rows import extended_recipes, shipped_data_groups
from benchmarks.quality_table import (
    EXTENDS,
    RESULTS,
    SHIPPED_GROUPS,
    SOURCES,
    build,
    markdown,
    rival,
)

ROOT = Path(__file__).resolve().parents[1]


def stored_now() -> dict:
    return {"command": "python -m benchmarks.quality_table", "models": build(SOURCES, RESULTS)}


def test_readme_results_section_is_what_the_files_give():
    rendered = readme_section(json.loads(json.dumps(stored_now())))  # as written to disk: tuples become lists
    assert current_section(README.read_text(encoding="utf-8")) == rendered, (
        "README.md's results section differs from the result files: run `python -m benchmarks.quality_table`"
    )


def test_quality_files_are_what_the_files_give():
    stored = json.loads((RESULTS / "quality.json").read_text())
    fresh = json.loads(json.dumps(build(SOURCES, RESULTS)))
    assert stored["models"] == fresh, "quality.json is stale: run `python -m benchmarks.quality_table`"
    assert (RESULTS / "quality.md").read_text() == markdown(fresh, stored["command"]), "quality.md is stale"


def test_a_hand_edit_is_caught():
    readme = README.read_text(encoding="utf-8")
    edited = readme.replace("| `awq_int4` | 3 |", "| `awq_int4` | 4 |", 1)
    assert edited != readme
    assert current_section(edited) != readme_section(json.loads(json.dumps(stored_now())))
    assert replace_section(edited, current_section(readme)) == readme


def test_missing_markers_are_one_clear_error():
    with pytest.raises(SystemExit, match="lacks the markers"):
        current_section("# a README without the results markers\n")


def test_the_data_groups_read_from_the_recipes_defaults_are_those_their_text_names():
    ships = {}
    for path in (ROOT / "recipes").glob("[!_]*.yaml"):
        found = re.search(r"override data: (\w+)", path.read_text())
        if found:
            ships[path.stem] = found[1]
    assert ships == SHIPPED_GROUPS
    assert SHIPPED_GROUPS["awq_int4"] == "sampled" and "gptq_int4" not in SHIPPED_GROUPS


def test_data_groups_are_read_from_the_defaults(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - _base\n  - override data: sampled\n  - _self_\n")
    (tmp_path / "half.yaml").write_text("defaults:\n  - _base\n  - override data: half_sampled\n  - _self_\n")
    (tmp_path / "theirs.yaml").write_text("defaults:\n  - _base\n  - _self_\nstages: []\n")
    (tmp_path / "_base.yaml").write_text("defaults:\n  - override data: sampled\n")
    assert shipped_data_groups(tmp_path) == {"mine": "sampled", "half": "half_sampled"}


def test_a_runs_calibration_is_read_from_its_overrides_then_its_recipe_then_its_data_group(monkeypatch):
    """The windows a run calibrates on decide which draws pair: a recipe's own `data.num_samples` and its data
    group's `generated` share count, and an override beats both."""
    monkeypatch.setitem(quality_table.SHIPPED_GROUPS, "mine", "half_sampled")
    monkeypatch.setitem(quality_table.RECIPE_DATA, "mine", {"num_samples": 128})
    half = yaml.safe_load((ROOT / "recipes" / "data" / "half_sampled.yaml").read_text())["generated"]
    assert 0 < half < 1
    assert quality_table.calibration("mine", [], 0) == ("half_sampled", half, 128, 0)
    assert quality_table.calibration("mine", ["data.num_samples=8"], 1) == ("half_sampled", half, 8, 1)
    assert quality_table.calibration("mine", ["data=pydoc"], 0) == ("pydoc", 0.0, 128, 0)
    assert quality_table.calibration("mine", ["data=pydoc", "data.generated=1.0"], 0)[:2] == ("sampled", 1.0)
    assert quality_table.calibration("llm-compressor:gptq_w4a16", [], 2) == ("pydoc", 0.0, 64, 2)


def _file(path: Path, command: str, rows: dict, threads: int | None = None) -> None:
    base = {"out_of_domain": {"perplexity": 10.0, "tokens": 100}, "in_domain": {"perplexity": 5.0, "tokens": 90}}
    report = {"model": "m", "date": "2030-01-01 00:00", "command": command, "baseline": base, "rows": rows}
    if threads is not None:
        report["threads"] = threads
    path.write_text(json.dumps(report))


def _row(out: float, inside: float) -> dict:
    return {"out_of_domain": {"perplexity": out}, "in_domain": {"perplexity": inside}, "seconds": 1.0}


PANEL = ("out_of_domain", "code", "technical", "in_domain")


def _panel_row(value: float) -> dict:
    """One draw that scored ``value`` on every text of the panel (whose baseline is 10.0 on each)."""
    return {text: {"perplexity": value} for text in PANEL} | {"seconds": 1.0, "size_mb": 90.0}


def _panel_tables(tmp_path: Path, rows: dict, model: str = "m") -> dict:
    """The quality table built from one results file of ``rows``, at 2 threads, scored on the whole panel."""
    base = {text: {"perplexity": 10.0, "tokens": 100} for text in PANEL}
    report = {"model": model, "date": "2030-01-01 00:00", "command": "c", "threads": 2, "baseline": base, "rows": rows}
    (tmp_path / "p.json").write_text(json.dumps(report))
    return build(["p"], tmp_path)


def test_draws_threads_intervals_and_peer_pairs_are_computed(tmp_path: Path):
    rows = {"gptq_int4": _row(12.0, 6.0), "llm-compressor:gptq_w4a16": _row(15.0, 6.5)}
    _file(tmp_path / "a.json", "python -m benchmarks.variants ...", rows)
    seeds = {
        "gptq_int4 seed=1": _row(13.0, 6.0),
        "llm-compressor:gptq_w4a16 seed=1": _row(15.0, 6.5),
        "gptq_int4 seed=2": _row(11.0, 6.0),
        "llm-compressor:gptq_w4a16 seed=2": _row(14.0, 6.5),
    }
    _file(tmp_path / "b.json", "python -m benchmarks.variants ...", seeds)
    single = {"rtn_int4": _row(14.0, 7.0), "gptq_int3": _row(20.0, 8.0)}
    _file(tmp_path / "c.json", "OMP_NUM_THREADS=1 python -m benchmarks.variants ...", single)
    tables = build(["a", "b", "c"], tmp_path)["m"]
    runs = {run["run"]: run for run in tables["runs"]}
    gptq = runs["gptq_int4"]
    assert (gptq["draws"], gptq["seeds"], gptq["threads"]) == (3, [0, 1, 2], None)
    out = gptq["ratios"]["out_of_domain"]
    assert out["mean"] == pytest.approx(1.2) and out["values"] == pytest.approx([1.2, 1.3, 1.1])
    assert out["high"] - out["mean"] == pytest.approx(4.3027 * 0.1 / 3**0.5, rel=1e-4)  # t(2) * sd / sqrt(n)
    rtn = runs["rtn_int4"]
    assert (rtn["threads"], rtn["ratios"]["out_of_domain"]["low"]) == (1, None)  # one draw: no interval
    (pair,) = tables["pairs"]
    assert (pair["ours"], pair["peer"], pair["seeds"]) == ("gptq_int4", "llm-compressor:gptq_w4a16", [0, 1, 2])
    assert pair["difference"]["out_of_domain"]["values"] == pytest.approx([-0.3, -0.2, -0.3])
    assert pair["short_of_standard"] == ["threads not recorded", "not scored on code, technical"]
    assert "Earlier and exploratory pairs, short of the standard:" in markdown({"m": tables}, "cmd")
    table = markdown({"m": tables}, "cmd")
    assert "| `gptq_int3` | 1 (0) | 1 | 2.000 (1 draw: no interval) |" in table
    assert "| `rtn_int4` | 1 (0) | 1 | 1.400 (calibration-free: every draw is this one) |" in table


def test_rows_to_the_standard_stand_apart_from_earlier_ones_which_say_what_they_lack(tmp_path: Path):
    """Three draws at recorded threads on every text make a row of the first table; fewer draws, unrecorded threads or
    a text not scored put it in the second, whose last column names what it lacks (in quality.json too)."""
    panel = ("out_of_domain", "code", "technical", "in_domain")
    base = {text: {"perplexity": 10.0, "tokens": 100} for text in panel}
    row = {text: {"perplexity": 11.0} for text in panel} | {"seconds": 1.0}
    rows = {"gptq_int4": row, "gptq_int4 seed=1": row, "gptq_int4 seed=2": row, "gptq_int3": row}
    report = {"model": "m", "date": "2030-01-01 00:00", "command": "c", "baseline": base, "rows": rows, "threads": 2}
    (tmp_path / "p.json").write_text(json.dumps(report))
    tables = build(["p"], tmp_path)["m"]
    assert {run["run"]: run["short_of_standard"] for run in tables["runs"]} == {
        "gptq_int4": [],
        "gptq_int3": ["1 of 3 draws"],
    }
    table = markdown({"m": tables}, "cmd")
    first, earlier = table.split("Earlier and exploratory measurements")
    assert "| `gptq_int4` | 3 (0, 1, 2) | 2 |" in first and "`gptq_int3`" not in first.split("Measured to")[1]
    assert "| short of the standard by |" in earlier
    assert next(line for line in earlier.splitlines() if "`gptq_int3`" in line).endswith("| 1 of 3 draws |")


def test_a_recipe_is_paired_with_itself_under_changed_stage_settings_or_a_replaced_stage_list():
    def run(name: str) -> dict:
        recipe, *overrides = name.split()
        return {"recipe": recipe, "overrides": overrides}

    shipped = run("awq_int4")
    assert rival(shipped, run("awq_int4 stages.0.act_order=false")) == "setting"
    assert rival(shipped, run("awq_int4 stages=[{type:awq},{type:distill}]")) == "setting"
    assert rival(shipped, run("awq_int4 data.num_samples=64")) is None  # other calibration: not the same ids
    assert rival(shipped, run("gptq_int4 stages.0.act_order=false")) is None
    assert rival(run("awq_int4 data.num_samples=64"), run("awq_int4 stages.0.act_order=false")) is None


def test_a_recipe_that_adds_stages_to_another_is_paired_with_it():
    """awq_int4_train_scales is awq_int4's stages and data plus scale training: the pair says what the training buys."""

    def run(name: str) -> dict:
        recipe, *overrides = name.split()
        return {"recipe": recipe, "overrides": overrides}

    assert rival(run("awq_int4_train_scales"), run("awq_int4")) == "added stages"
    assert rival(run("awq_int4"), run("awq_int4_train_scales")) is None  # one direction: ours is the longer chain
    assert rival(run("awq_int4_train_scales"), run("awq_int4 data.num_samples=64")) is None  # other ids
    assert rival(run("awq_int4_train_scales"), run("gptq_int4")) is None


def test_the_recipes_that_add_stages_to_another_are_read_from_the_files(tmp_path: Path):
    assert EXTENDS == {"awq_int4_kv_int8": "awq_int4", "awq_int4_train_scales": "awq_int4",
                       "prune_2of4_distill": "prune_2of4", "prune_2of4_gptq_int4": "prune_2of4",
                       "rotate_autoround_int4": "autoround_int4"}  # fmt: skip
    rtn, gptq, distill, rotate = "{type: rtn}", "{type: gptq}", "{type: distill}", "{type: rotate}"
    files = {"a": [rtn], "ab": [rtn, gptq], "abc": [rtn, gptq, distill], "b": [gptq], "other_data": [rtn, gptq],
             "rb": [rotate, gptq]}  # fmt: skip
    for name, stages in files.items():
        data = "defaults: [_base, {override data: sampled}, _self_]\n" if name == "other_data" else ""
        (tmp_path / f"{name}.yaml").write_text(f"{data}stages: [{', '.join(stages)}]\n")
    found = extended_recipes(tmp_path)  # the nearest base, on the same calibration; stages added after it first
    assert found == {"ab": "a", "abc": "ab", "rb": "b"}


def test_panel_texts_get_a_column_each_shakespeare_first_in_domain_last(tmp_path: Path):
    panel = {"out_of_domain": 12.0, "zeta": 11.0, "technical": 13.0, "in_domain": 6.0, "code": 14.0}
    row = {text: {"perplexity": value} for text, value in panel.items()} | {"seconds": 1.0}
    base = {text: {"perplexity": 10.0, "tokens": 100} for text in panel}
    report = {"model": "m", "date": "2030-01-01 00:00", "command": "c", "baseline": base, "rows": {"rtn_int4": row}}
    (tmp_path / "p.json").write_text(json.dumps(report))
    tables = build(["p"], tmp_path)["m"]
    assert list(tables["runs"][0]["ratios"]) == ["out_of_domain", "code", "technical", "zeta", "in_domain"]
    header = next(line for line in markdown({"m": tables}, "cmd").splitlines() if line.startswith("| run |"))
    assert "| Shakespeare | code (stdlib source) | technical (stdlib docstrings) | zeta | in-domain |" in header


def test_the_work_left_is_read_from_the_rows():
    from benchmarks.quality_rows import TEXTS_GOAL, shipped_recipes, still_to_measure

    every_text = {text: {"mean": 1.1} for text in TEXTS_GOAL}
    runs = [
        {"run": "gptq_int4", "recipe": "gptq_int4", "overrides": [], "draws": 1, "threads": None,
         "ratios": {"out_of_domain": {"mean": 1.3}}},
        {"run": "rtn_int4", "recipe": "rtn_int4", "overrides": [], "draws": 1, "threads": 2, "ratios": every_text},
        {"run": "fp8_dynamic", "recipe": "fp8_dynamic", "overrides": [], "draws": 3, "threads": 2,
         "ratios": every_text},
    ]  # fmt: skip
    left = still_to_measure(runs)
    assert "- `gptq_int4`: 1 of 3 draws; threads not recorded; not scored on code, technical, in_domain" in left
    assert "- `awq_int4`: not measured as shipped" in left
    assert not [line for line in left if "rtn_int4" in line or "fp8_dynamic`" in line]  # calibration-free: 1 is all
    assert len(left) == len(shipped_recipes()) - 2
    # a recipe that ships without what it needs has no row to draw: the line says so instead of asking for draws
    assert (
        "- `lora_merge_awq_int4`: not measurable as shipped: needs your PEFT adapters (stages.0.adapters); it "
        "ships none" in left
    )


def test_a_peer_pair_scored_on_the_panel_is_quoted_on_every_out_of_domain_text():
    from benchmarks.quality_readme import _pairs

    gap = {"mean": 0.03, "low": 0.01, "high": 0.05, "n": 3}
    shakespeare = {"mean": -0.02, "low": -0.03, "high": -0.01, "n": 3}
    pair = {"ours": "gptq_int4", "peer": "llm-compressor:gptq_w4a16_mse", "kind": "peer", "seeds": [0, 1, 2],
            "difference": {"out_of_domain": shakespeare, "code": gap, "in_domain": gap},
            "short_of_standard": []}  # fmt: skip
    setting = {**pair, "peer": "gptq_int4 stages.0.act_order=false", "kind": "setting"}  # not a peer: not quoted
    (line,) = _pairs({"pairs": [pair, setting]})
    assert line.endswith("Shakespeare -0.020 (-0.030 to -0.010, 3 draws), code +0.030 (+0.010 to +0.050, 3 draws)")


def test_a_row_is_spelled_by_its_own_date_against_every_change_of_its_recipe(tmp_path: Path, monkeypatch):
    """A recipe changed twice: a row older than both gets both changes' overrides back; a file that gathers several
    invocations (quality_draws) dates each row, and that date, not the file's, decides."""
    changes = [("2030-01-01 00:00", ["stages.0.rounding=rtn"], ["stages.0.rounding=gptq"]),
               ("2030-06-01 00:00", ["stages.0.act_order=false"], ["stages.0.act_order=true"])]  # fmt: skip
    monkeypatch.setitem(quality_table.CHANGED, "awq_int4", changes)
    spell = quality_table.as_measured
    assert spell("awq_int4 data=pydoc", "2029-12-31 00:00") == (
        "awq_int4 stages.0.rounding=rtn stages.0.act_order=false data=pydoc"
    )
    assert spell("awq_int4", "2030-02-01 00:00") == "awq_int4 stages.0.act_order=false"
    assert spell("awq_int4 stages.0.act_order=true", "2030-02-01 00:00") == "awq_int4"  # the candidate now shipped
    assert spell("awq_int4 stages.0.rounding=gptq", "2030-07-01 00:00") == "awq_int4"
    rows = {"awq_int4": _row(12.0, 6.0) | {"date": "2030-02-01 00:00"}, "awq_int4 seed=1": _row(13.0, 6.0)}
    _file(tmp_path / "d.json", "python -m benchmarks.quality_draws", rows)  # the file: 2030-01-01, after change 1
    runs = sorted(run["run"] for run in build(["d"], tmp_path)["m"]["runs"])
    assert runs == ["awq_int4 stages.0.act_order=false"]


def test_a_setting_changed_twice_is_spelled_with_the_value_the_row_ran_with(monkeypatch):
    """Both changes list the same key: a row older than both ran with the first change's value, not both values."""
    changes = [("2030-01-01 00:00", ["stages.0.iterations=40", "stages.0.lr=0.005"], ["stages.0.lr=null"]),
               ("2030-06-01 00:00", ["stages.0.iterations=50"], ["stages.0.iterations=200"])]  # fmt: skip
    monkeypatch.setitem(quality_table.CHANGED, "autoround_int4", changes)
    spell = quality_table.as_measured
    assert spell("autoround_int4", "2029-12-31 00:00") == "autoround_int4 stages.0.iterations=40 stages.0.lr=0.005"
    assert spell("autoround_int4", "2030-02-01 00:00") == "autoround_int4 stages.0.iterations=50"
    assert spell("autoround_int4 stages.0.iterations=200", "2030-02-01 00:00") == "autoround_int4"


def test_a_row_that_replaced_a_whole_group_is_not_given_a_key_inside_it(monkeypatch):
    """A change of `data.generated`: a row that chose its own data group (`data=sampled`) ran with that group's
    share, not with the value the recipe had before; a row that kept the recipe's group gets the old value back."""
    changes = [("2030-01-01 00:00", ["data.generated=0.0"], ["data.generated=0.5"])]
    monkeypatch.setitem(quality_table.CHANGED, "autoround_int4", changes)
    spell = quality_table.as_measured
    assert spell("autoround_int4 data=sampled", "2029-12-31 00:00") == "autoround_int4 data=sampled"
    assert spell("autoround_int4", "2029-12-31 00:00") == "autoround_int4 data.generated=0.0"
    assert spell("autoround_int4 data.generated=0.5", "2030-02-01 00:00") == "autoround_int4"


def test_a_shipped_recipe_is_paired_with_its_other_stage_settings_on_the_same_draws(tmp_path: Path):
    """What a shipped setting buys, by the same paired arithmetic as a peer pair; a data override changes the
    calibration ids and a row with overrides of its own is not 'as shipped': neither is paired."""
    rows = {"gptq_int4": _row(12.0, 6.0), "gptq_int4 seed=1": _row(13.0, 6.0),
            "gptq_int4 stages.0.act_order=false": _row(13.0, 6.5), "gptq_int4 stages.0.act_order=false seed=1":
            _row(13.5, 6.5), "gptq_int4 data=pydoc": _row(14.0, 6.0)}  # fmt: skip
    _file(tmp_path / "s.json", "python -m benchmarks.quality_draws", rows, threads=2)
    (pair,) = build(["s"], tmp_path)["m"]["pairs"]
    assert (pair["ours"], pair["peer"], pair["kind"], pair["seeds"]) == (
        "gptq_int4", "gptq_int4 stages.0.act_order=false", "setting", [0, 1])  # fmt: skip
    assert pair["difference"]["out_of_domain"]["values"] == pytest.approx([-0.1, -0.05])


def test_draws_whose_checkpoints_name_different_calibration_windows_are_not_paired(tmp_path: Path):
    """One seed need not be the same windows on another processor (the same code calibrated another seed-0 AWQ on
    another one): where both draws record their windows' digest and the digests differ, that seed is no pair."""
    rows = {"gptq_int4": _row(12.0, 6.0) | {"calibration_sha256": "a"},
            "gptq_int4 seed=1": _row(13.0, 6.0) | {"calibration_sha256": "b"},
            "gptq_int4 seed=2": _row(11.0, 6.0),
            "gptq_int4 stages.0.act_order=false": _row(13.0, 6.5) | {"calibration_sha256": "a"},
            "gptq_int4 stages.0.act_order=false seed=1": _row(13.5, 6.5) | {"calibration_sha256": "c"},
            "gptq_int4 stages.0.act_order=false seed=2": _row(12.0, 6.5) | {"calibration_sha256": "d"}}  # fmt: skip
    _file(tmp_path / "s.json", "python -m benchmarks.quality_draws", rows, threads=2)
    (pair,) = build(["s"], tmp_path)["m"]["pairs"]
    assert pair["seeds"] == [0, 2]  # seed 1: two windows; seed 2: one digest unrecorded, as every older row's
    assert pair["difference"]["out_of_domain"]["values"] == pytest.approx([-0.1, -0.1])


def test_a_pair_says_on_which_seeds_the_digests_showed_the_windows_shared(tmp_path: Path):
    """A seed paired at its word (a draw older than the digests) and one whose two checkpoints named the same windows
    are not the same evidence: the pair lists the checked seeds and its line says so."""
    rows = {"gptq_int4": _row(12.0, 6.0) | {"calibration_sha256": "a"},
            "gptq_int4 seed=1": _row(13.0, 6.0),
            "gptq_int4 stages.0.act_order=false": _row(13.0, 6.5) | {"calibration_sha256": "a"},
            "gptq_int4 stages.0.act_order=false seed=1": _row(13.5, 6.5) | {"calibration_sha256": "c"}}  # fmt: skip
    _file(tmp_path / "s.json", "python -m benchmarks.quality_draws", rows, threads=2)
    models = build(["s"], tmp_path)
    (pair,) = models["m"]["pairs"]
    assert (pair["seeds"], pair["windows_checked"]) == ([0, 1], [0])
    (line,) = [line for line in markdown(models, "cmd").splitlines() if line.startswith("| `gptq_int4` | `gptq")]
    assert "2 (0, 1; windows checked: 0)" in line


def test_the_pick_ranks_every_int4_g64_recipe_file_without_a_list_to_update(tmp_path: Path):
    """A new int4 g64 recipe is a candidate by its file (a hard-coded list left awq_int4_train_scales out); one that
    also quantizes the KV cache, prunes, needs adapters or stores FP4 is not."""
    from benchmarks.quality_pick import int4_g64_recipes

    found = int4_g64_recipes()
    assert {"rtn_int4", "awq_int4", "gptq_int4", "autoround_int4", "rotate_gptq_int4"} < set(found)
    assert "awq_int4_train_scales" in found
    assert not {"awq_int4_kv_int8", "prune_2of4_gptq_int4", "lora_merge_awq_int4", "nvfp4a16", "gptq_int3"} & set(found)
    (tmp_path / "mine_int4.yaml").write_text("stages:\n  - {type: gptq, bits: 4, group_size: 64}\n")
    (tmp_path / "mine_g128.yaml").write_text("stages:\n  - {type: gptq, bits: 4, group_size: 128}\n")
    assert int4_g64_recipes(tmp_path) == ["mine_int4"]


def test_the_pick_ranks_on_the_mean_over_every_out_of_domain_text_not_on_shakespeare(tmp_path: Path):
    def row(shakespeare: float, code: float, technical: float) -> dict:
        texts = {"out_of_domain": shakespeare, "code": code, "technical": technical, "in_domain": 6.0}
        return {text: {"perplexity": value} for text, value in texts.items()} | {"seconds": 1.0, "size_mb": 90.0}

    rows = {}
    for seed, wobble in enumerate((0.0, 0.1, -0.1)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"awq_int4{suffix}"] = row(11.0 + wobble, 13.0 + wobble, 13.0 + wobble)  # lower on Shakespeare only
        rows[f"gptq_int4{suffix}"] = row(12.0 + wobble, 11.0 + wobble, 11.0 + wobble)
        rows[f"rotate_gptq_int4{suffix}"] = {**row(10.0, 10.0, 10.0), "technical": None}  # not scored on all three
        rows[f"rtn_int4{suffix}"] = {**row(10.5, 10.5, 10.5), "size_mb": 200.0}  # lowest, but larger than gptq's
    for draw in rows.values():
        if draw["technical"] is None:
            del draw["technical"]
    tables = _panel_tables(tmp_path, rows)["m"]
    chosen = tables["pick"]
    assert (chosen["recipe"], chosen["runner_up"]) == ("gptq_int4", "awq_int4")
    assert chosen["panel"]["values"] == pytest.approx([(1.2 + 1.1 + 1.1) / 3, (1.21 + 1.11 + 1.11) / 3,
                                                       (1.19 + 1.09 + 1.09) / 3])  # fmt: skip
    assert chosen["verdict"].startswith("ahead: difference -0.100 (-0.123 to -0.077, Welch's 95% interval: 3 and 3")
    assert "Pick: `gptq_int4`, out-of-domain mean 1.133 (" in markdown({"m": tables}, "cmd")
    assert (chosen["larger"]["recipe"], chosen["larger"]["size_mb"]) == ("rtn_int4", 200.0)


def test_the_pick_reads_the_paired_difference_where_best_and_runner_up_share_their_draws(tmp_path: Path):
    """Seeds move both recipes alike (same calibration ids): the unpaired intervals overlap, but the difference draw
    by draw is the same every time, so the pick is ahead, and says it by the paired interval."""

    rows = {}
    for seed, wobble in enumerate((0.0, 0.5, -0.5)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"awq_int4{suffix}"] = _panel_row(11.2 + wobble)
        rows[f"awq_int4_train_scales{suffix}"] = _panel_row(11.0 + wobble)
        rows[f"gptq_int4{suffix}"] = _panel_row(13.0)
    chosen = _panel_tables(tmp_path, rows)["m"]["pick"]
    assert (chosen["recipe"], chosen["runner_up"]) == ("awq_int4_train_scales", "awq_int4")
    assert chosen["panel"]["high"] > chosen["runner_up_panel"]["low"]  # unpaired: they would overlap
    assert (
        chosen["verdict"] == "ahead: paired difference -0.020 (-0.020 to -0.020, 3 draws on the same calibration ids)"
    )


def test_the_pick_tests_unpaired_recipes_by_welchs_interval_of_their_difference_not_by_overlap(tmp_path: Path):
    """Two recipes on different calibration ids: their own 95% intervals overlap, yet the interval of the difference
    of their means excludes zero (overlap is a far stricter test than the difference's own interval), so the pick
    is ahead and says so with Welch's interval."""
    rows = {}
    for seed, wobble in enumerate((0.0, 0.1, -0.1)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"awq_int4{suffix}"] = _panel_row(10.0 + wobble)
        rows[f"gptq_int4{suffix}"] = _panel_row(10.35 + wobble)
    chosen = _panel_tables(tmp_path, rows)["m"]["pick"]
    assert (chosen["recipe"], chosen["runner_up"]) == ("awq_int4", "gptq_int4")
    assert chosen["panel"]["high"] > chosen["runner_up_panel"]["low"]  # their own intervals overlap
    assert chosen["verdict"] == (
        "ahead: difference -0.035 (-0.058 to -0.012, Welch's 95% interval: 3 and 3 draws on different calibration ids)"
    )


def test_a_calibration_free_runner_up_is_one_exact_value_not_an_unestablished_single_draw(tmp_path: Path):
    """rtn_int4's one draw is every draw (no calibration): the pick against it is the best recipe's own interval
    less that value, not 'not established'."""
    rows = {"rtn_int4": _panel_row(10.5)}
    for seed, wobble in enumerate((0.0, 0.1, -0.1)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"gptq_int4{suffix}"] = _panel_row(10.0 + wobble)
    chosen = _panel_tables(tmp_path, rows)["m"]["pick"]
    assert (chosen["recipe"], chosen["runner_up"]) == ("gptq_int4", "rtn_int4")
    assert chosen["verdict"] == (
        "ahead: difference -0.050 (-0.075 to -0.025, 95% t over 3 draws against the calibration-free recipe's one "
        "value)"
    )


def test_one_lucky_draw_neither_leads_the_pick_nor_enters_the_readme_rows(tmp_path: Path):
    """A recipe lowest on every text but with one draw is short of the standard: the pick ranks only rows to it, and
    the README names the short recipe and what it lacks instead of quoting it (read from the rows, not from a list
    kept by hand)."""
    from benchmarks.quality_readme import MODEL

    rows = {"awq_int4_train_scales": _panel_row(10.5)}  # one draw, lowest
    for seed, wobble in enumerate((0.0, 0.1, -0.1)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"awq_int4{suffix}"] = _panel_row(11.0 + wobble)
        rows[f"gptq_int4{suffix}"] = _panel_row(12.0 + wobble)
    stored = {"command": "python -m benchmarks.quality_table", "models": _panel_tables(tmp_path, rows, MODEL)}
    assert stored["models"][MODEL]["pick"]["recipe"] == "awq_int4"
    section = readme_section(json.loads(json.dumps(stored)))
    assert "| `awq_int4_train_scales` |" not in section
    assert "`awq_int4_train_scales`: 1 of 3 draws" in section


def test_the_share_of_the_reference_loss_removed_is_computed_with_its_interval_and_verdict(tmp_path: Path):
    """The issue's AutoRound goal (>= 35% of gptq_int4's loss over fp32 removed, >= 40% at int3) is read from the
    rows by a script, with an interval over both recipes' draws and a verdict, not worked out by hand in a note."""
    from benchmarks.quality_goals import share_removed

    found = share_removed([1.10, 1.11, 1.09], [1.20, 1.22, 1.18])  # loss 0.10 against 0.20: half of it removed
    assert found["share"] == pytest.approx(0.5)
    assert found["low"] < 0.5 < found["high"]
    assert share_removed([1.10, 1.10, 1.10], [1.20, 1.20, 1.20])["low"] == pytest.approx(0.5)  # no spread: exact

    rows = {}
    for seed, wobble in enumerate((0.0, 0.01, -0.01)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"autoround_int4{suffix}"] = _panel_row(11.8 + wobble)  # 0.18 over fp32 against gptq's 0.20: 10% removed
        rows[f"gptq_int4{suffix}"] = _panel_row(12.0 + wobble)
    tables = _panel_tables(tmp_path, rows)["m"]
    (goal,) = tables["goals"]
    assert (goal["ours"], goal["reference"], goal["goal"]) == ("autoround_int4", "gptq_int4", 0.35)
    assert goal["panel"]["share"] == pytest.approx(0.1)
    assert goal["verdict"] == "missed"
    assert "`autoround_int4` against `gptq_int4`" in markdown({"m": tables}, "cmd")


def test_the_int4_ceiling_on_the_default_model_is_read_from_the_rows_with_its_interval_and_verdict(tmp_path: Path):
    """The issue's "best int4 leads" goal (a shipped int4 g64 recipe at most x1.08 out of domain on the default
    model): met only when the 95% interval of the out-of-domain mean stays at or under it, missed when it stays
    over, else undecided; on another model no ceiling is set."""
    from benchmarks.quality_readme import MODEL

    rows = {}
    for seed, (low, high) in enumerate(((10.70, 10.90), (10.75, 10.95), (10.80, 11.00))):
        suffix = f" seed={seed}" if seed else ""
        rows[f"rotate_autoround_int4{suffix}"] = _panel_row(low)  # x1.075 mean: under 1.08, its interval too wide
        rows[f"autoround_int4{suffix}"] = _panel_row(high)  # x1.095: over 1.08
    tables = _panel_tables(tmp_path, rows, MODEL)[MODEL]
    ceilings = {goal["ours"]: goal for goal in tables["goals"] if "ceiling" in goal}
    assert ceilings["rotate_autoround_int4"]["panel"]["mean"] == pytest.approx(1.075)
    assert ceilings["rotate_autoround_int4"]["verdict"] == "undecided"
    assert ceilings["autoround_int4"]["verdict"] == "missed"
    text = markdown({MODEL: tables}, "cmd")
    assert "- `rotate_autoround_int4` (goal: at most ×1.08 over fp32 on the mean of the 3 out-of-domain texts" in text
    assert not [goal for goal in _panel_tables(tmp_path, rows, "m")["m"]["goals"] if "ceiling" in goal]


def test_a_row_whose_stage_stopped_at_its_time_cap_says_how_many_steps_each_draw_took(tmp_path: Path):
    """A time-capped distillation takes as many steps as the machine allows (121 on one processor, 30 on another):
    the row's interval then holds the machine too, so the table says each draw's steps against those asked."""
    capped = {"1:distill": {"steps": 121, "steps_asked": 200}, "0:awq": {}}
    rows = {"awq_int4_train_scales": _panel_row(11.0) | {"stages": capped},
            "awq_int4_train_scales seed=1": _panel_row(11.2) | {"stages": {"1:distill": {"steps": 30,
                                                                                        "steps_asked": 200}}},
            "awq_int4_train_scales seed=2": _panel_row(11.1) | {"stages": {"1:distill": {"steps": 200,
                                                                                        "steps_asked": 200}}},
            "gptq_int4": _panel_row(11.5), "gptq_int4 seed=1": _panel_row(11.6),
            "gptq_int4 seed=2": _panel_row(11.4)}  # fmt: skip
    tables = _panel_tables(tmp_path, rows)
    runs = {run["run"]: run for run in tables["m"]["runs"]}
    assert runs["awq_int4_train_scales"]["capped"] == {"1:distill": [121, 30, 200]}
    assert "capped" not in runs["gptq_int4"]
    table = markdown(tables, "cmd")
    assert "`awq_int4_train_scales`: 1:distill 121, 30, 200 of 200 steps (seeds 0, 1, 2)" in table


def test_the_readme_table_shows_each_recipes_cost_and_the_processors_that_measured_it(tmp_path: Path):
    """A user choosing a recipe weighs its quality against its cost (AutoRound takes about 18x GPTQ's time): the
    README's table quotes each row's mean compress seconds, and names the processors its draws recorded, since a
    time follows the machine (draws from before processors were recorded are said to be so)."""
    from benchmarks.quality_readme import MODEL

    rows = {}
    for seed, wobble in enumerate((0.0, 0.1, -0.1)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"awq_int4{suffix}"] = _panel_row(11.0 + wobble) | {"seconds": 200.0 + 10 * seed, "cpu": "AMD EPYC"}
        rows[f"gptq_int4{suffix}"] = _panel_row(12.0 + wobble) | {"seconds": 70.0}
    stored = {"command": "python -m benchmarks.quality_table", "models": _panel_tables(tmp_path, rows, MODEL)}
    runs = {run["run"]: run for run in stored["models"][MODEL]["runs"]}
    assert runs["awq_int4"]["processors"] == ["AMD EPYC"]
    assert runs["gptq_int4"]["processors"] == []
    assert [found["cpu"] for found in runs["awq_int4"]["per_draw"]] == ["AMD EPYC"] * 3
    section = readme_section(json.loads(json.dumps(stored)))
    assert "| MB | compress s |" in section
    assert "| 90.0 | 210 |" in section  # awq_int4: the mean of 200, 210 and 220
    assert "| 90.0 | 70 |" in section
    assert "processors: AMD EPYC (`awq_int4`); not recorded (`gptq_int4`)" in section


def test_two_calibration_free_runs_differ_by_one_exact_gap_not_an_unestablished_draw(tmp_path: Path):
    """Our fp8_dynamic against llm-compressor's: neither reads its windows, so their one difference is every
    draw's, and the pair is said to be so rather than "1 draw: no interval"; a calibrated pair of one draw is not."""
    rows = {"fp8_dynamic": _panel_row(10.2), "llm-compressor:fp8_dynamic": _panel_row(10.3),
            "gptq_int4": _panel_row(11.0), "llm-compressor:gptq_w4a16": _panel_row(11.5)}  # fmt: skip
    found = {(p["ours"], p["peer"]): p for p in _panel_tables(tmp_path, rows)["m"]["pairs"]}
    fp8 = found[("fp8_dynamic", "llm-compressor:fp8_dynamic")]
    assert fp8["difference"]["out_of_domain"]["mean"] == pytest.approx(-0.01)
    assert all(stats["calibration_free"] for stats in fp8["difference"].values())
    assert fp8["panel"]["calibration_free"] and not fp8["short_of_standard"]
    gptq = found[("gptq_int4", "llm-compressor:gptq_w4a16")]
    assert not any(stats.get("calibration_free") for stats in gptq["difference"].values())
    assert "1 of 3 draws" in "; ".join(gptq["short_of_standard"])
    from benchmarks.quality_readme import _signed

    assert _signed(fp8["difference"]["out_of_domain"]) == "-0.010 (both calibration-free)"
    assert _signed(gptq["difference"]["out_of_domain"]) == "-0.050 (1 draw)"


def test_the_peer_presets_still_to_pair_are_read_from_the_pairs_not_kept_by_hand(tmp_path: Path):
    """The issue asks llm-compressor like for like wherever it has the algorithm: each shipped recipe and the preset it
    competes with is listed until their pair meets the standard, with what it lacks (a peer of one draw) or that no
    pair exists; presets kept for their history only (AWQ then round-to-nearest) are not asked for."""
    from benchmarks.quality_rows import peers_to_pair
    from benchmarks.quality_table import ORDER

    rows = {"llm-compressor:gptq_w4a16": _panel_row(12.5)}
    for seed, wobble in enumerate((0.0, 0.1, -0.1)):
        suffix = f" seed={seed}" if seed else ""
        rows[f"gptq_int4{suffix}"] = _panel_row(12.0 + wobble)
        rows[f"llm-compressor:gptq_w4a16_mse{suffix}"] = _panel_row(12.2 + wobble)
    tables = _panel_tables(tmp_path, rows)["m"]
    lines = peers_to_pair(tables["runs"], tables["pairs"], ORDER)
    assert "- `gptq_int4` − `llm-compressor:gptq_w4a16`: 1 of 3 draws" in lines
    assert not [line for line in lines if "`llm-compressor:gptq_w4a16_mse`" in line]  # paired to the standard
    assert "- `fp8_dynamic` − `llm-compressor:fp8_dynamic`: no pair on the same windows and threads" in lines
    assert not [line for line in lines if "awq_w4a16`" in line or "autoround" in line]
    assert "\n".join(lines) in markdown({"m": tables}, "python -m benchmarks.quality_table")


def test_the_readme_quotes_one_pair_per_peer_preset_the_one_to_the_standard():
    """An old pair short of the standard (threads not recorded) and a new one to it, of the same recipe and preset:
    the README quotes the new one only, not both one after the other."""
    from benchmarks.quality_readme import _pairs

    exact = {"mean": 0.001, "low": None, "high": None, "n": 1, "calibration_free": True}
    old = {
        "ours": "fp8_dynamic",
        "peer": "llm-compressor:fp8_dynamic",
        "kind": "peer",
        "seeds": [0],
        "difference": {"out_of_domain": exact | {"mean": 0.0}},
        "short_of_standard": ["threads not recorded"],
    }
    new = old | {"difference": {"out_of_domain": exact, "code": exact}, "short_of_standard": []}
    for order in ([old, new], [new, old]):
        assert _pairs({"pairs": order}) == [
            "`fp8_dynamic` − `llm-compressor:fp8_dynamic` Shakespeare +0.001 (both calibration-free), "
            "code +0.001 (both calibration-free)"
        ]


def test_autoround_int4s_draws_before_half_sampled_calibration_stay_apart_from_those_after():
    """autoround_int4 calibrated on pydoc alone until 2026-12-06, on half model-sampled windows since: a draw of
    the pydoc recipe, one that set a data key of its own (data.seq_len) included, is never counted as shipped, and
    a draw of the candidate is."""
    spell = quality_table.as_measured
    tuned = "autoround_int4 stages.0.iterations=200 stages.0.batch_size=2 data.seq_len=512"
    assert spell(tuned, "2026-11-29 11:10") == "autoround_int4 data.generated=0.0"
    assert spell("autoround_int4", "2026-11-29 12:46") == "autoround_int4 data.generated=0.0"
    assert spell("autoround_int4 data.generated=0.5", "2026-12-06 03:55") == "autoround_int4"
    assert spell("autoround_int4 data=half_sampled", "2026-12-06 03:55") == "autoround_int4"
    assert spell("autoround_int4 data=sampled", "2026-11-29 15:08") == "autoround_int4 data=sampled"

"""Chain order is checked from what each stage declares (its flags), never from which class it is."""

from dataclasses import dataclass

import pytest

from compress.base.errors import CompressError
from compress.stages import STAGES, Stage, build_chain


@dataclass
class _NoArgs:
    pass


def _stage(name: str, **flags) -> type[Stage]:
    """A stage that does nothing but declare ``flags``; none of the real classes is its ancestor."""
    return type(name, (Stage,), {"name": name, "Config": _NoArgs, **flags})


FLAGGED = {
    "quantizer": _stage("quantizer", quantizes_weights=True),
    "pruner": _stage("pruner", prunes_weights=True),
    "folder": _stage("folder", needs_dense_weights=True),
    "kv": _stage("kv", quantizes_kv_cache=True),
    "merger": _stage("merger", merges_adapters=True, needs_calibration=False, layerwise=False),
    "healer": _stage("healer", heals=True, layerwise=False),
    "scaler": _stage("scaler", heals=True, needs_quantized_weights=True, layerwise=False),
    "plain": _stage("plain"),
}


@pytest.fixture
def flagged(monkeypatch):
    for name, stage in FLAGGED.items():
        monkeypatch.setitem(STAGES, name, stage)


def _chain(*names: str) -> list[Stage]:
    return build_chain([{"type": name} for name in names])


@pytest.mark.parametrize(
    ("order", "message"),
    [
        (("quantizer", "merger"), r"stages.1 \(merger\) comes after stages.0 \(quantizer\); merge adapters first"),
        (("pruner", "merger"), r"stages.1 \(merger\) comes after stages.0 \(pruner\)"),
        (("plain", "healer"), r"stages.1 \(healer\) has nothing to heal"),
        (("quantizer", "folder"), r"stages.1 \(folder\) folds scales into dense weights, but stages.0 \(quantizer\)"),
        (("kv", "quantizer", "kv"), r"stages.2 \(kv\) would overwrite the KV-cache scales of stages.0 \(kv\)"),
        (("quantizer", "plain", "quantizer"), r"stages.2 \(quantizer\) would quantize weights that stages.0"),
        (("quantizer", "pruner"), r"stages.1 \(pruner\) would prune weights that stages.0 \(quantizer\)"),
        (("pruner", "pruner"), r"stages.1 \(pruner\): stages.0 already prunes"),
        (("pruner", "scaler"), r"stages.1 \(scaler\) trains what a weight quantizer packs, and no stage before it"),
    ],
)
def test_illegal_orders_are_refused_from_the_flags_alone(flagged, order, message):
    with pytest.raises(CompressError, match=message):
        _chain(*order)


def test_legal_order_passes_and_the_healer_learns_its_teacher(flagged):
    stages = _chain("merger", "folder", "pruner", "healer", "quantizer", "scaler", "kv", "plain")
    assert stages[3].teacher_position == 2  # the model just before the first compression
    assert stages[5].teacher_position == 2


def test_only_the_kv_stage_has_a_kv_cache_scheme():
    stages = build_chain([{"type": "gptq"}, {"type": "kv_cache", "dtype": "int8"}])
    assert stages[0].kv_cache_scheme is None
    assert next(s.kv_cache_scheme for s in stages if s.quantizes_kv_cache)["type"] == "int"


def test_every_registered_stage_declares_what_it_does():
    declared = {
        flag: sorted(name for name, stage in STAGES.items() if getattr(stage, flag))
        for flag in ("merges_adapters", "heals", "needs_dense_weights", "quantizes_kv_cache", "prunes_weights")
    }
    assert declared == {
        "merges_adapters": ["lora_merge"],
        "heals": ["distill"],
        "needs_dense_weights": ["rotate", "smoothquant"],
        "quantizes_kv_cache": ["kv_cache"],
        "prunes_weights": ["magnitude_prune", "sparsegpt", "wanda"],
    }
    assert sorted(name for name, stage in STAGES.items() if stage.quantizes_weights) == [
        "awq",
        "fp8",
        "gptq",
        "mixed",
        "rtn",
        "signround",
        "w8a8",
    ]


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_says_what_it_runs_in_one_line(name):
    """The report quotes ``algorithm()`` for every stage: it must work on the stage's defaults (no prepare yet)."""
    try:
        stage = STAGES[name].from_args({}, 0)
    except CompressError:  # a stage that cannot be built without an argument (an adapter path)
        pytest.skip(f"{name} needs arguments")
    line = stage.algorithm()
    assert line and "\n" not in line

"""The plan prices sampled calibration windows on the device that samples them, and says in one line when sampling
is most of the run, with the override that avoids it."""

from compress.app.preflight import Plan, Probe, estimate, model_shape
from compress.app.recipe import compose
from compress.stages import build_chain


def _plan(folder, recipe: str, *overrides: str, accelerated: bool = False) -> Plan:
    config = compose(recipe, ["data.num_samples=64", "data.seq_len=512", *overrides], str(folder))
    stages = build_chain(config.stages)
    return estimate(model_shape(folder), stages, config, "tiny", Probe(10.0), 1000, accelerated)


def test_sampling_is_priced_per_device(tiny_model_dir):
    on_cpu = _plan(tiny_model_dir, "awq_int4", "stages.0.group_size=32")
    on_gpu = _plan(tiny_model_dir, "awq_int4", "stages.0.group_size=32", accelerated=True)
    assert on_gpu.seconds["sample"] < on_cpu.seconds["sample"] / 10
    shape = model_shape(tiny_model_dir)
    steps = 2 * 512  # 64 windows, 2 batches of 16 decoded together, 512 tokens each: a step reads every weight once
    assert on_gpu.seconds["sample"] == steps * shape.params * shape.dtype_bytes / 1e12
    assert on_cpu.seconds == _plan(tiny_model_dir, "awq_int4", "stages.0.group_size=32").seconds


def test_a_plan_that_is_mostly_sampling_names_the_override(tiny_model_dir):
    plan = _plan(tiny_model_dir, "awq_int4", "stages.0.group_size=32")
    assert plan.seconds["sample"] > sum(plan.seconds.values()) / 2
    [warning] = [line for line in plan.lines() if "sampling" in line]
    assert "most of the run" in warning and "data.generated=0" in warning and "data=<your text>" in warning
    text = _plan(tiny_model_dir, "awq_int4", "stages.0.group_size=32", "data=pydoc")
    assert not [line for line in text.lines() if "most of the run" in line]

"""Property-based: any recipe override or gate policy value, however odd (random keys, wrong types, numbers out of
range, strings with quotes, brackets, interpolations or unicode on real keys), is either accepted or refused as one
usage error line (``CompressError``, exit 2), never a traceback. Composed and checked in-process exactly as the CLI
does before any model loads (``compress.commands.run.validate``, the gate command's policy), so each example costs
milliseconds; examples are derandomized so CI sees the same ones every time."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compress.base.errors import CompressError, EnvironmentFailure, ExitCode
from compress.commands.exits import exit_code_of
from compress.evals.gate.policy import GatePolicy

RUN_KEYS = [
    "seed", "device", "calibration_batch_size", "resume", "data.num_samples", "data.seq_len", "data.generated",
    "data.eval_fraction", "data.source", "data.path", "data.split", "eval.seq_len", "eval.batch_size",
    "eval.max_windows", "eval.reference", "eval.perplexity", "eval.data", "eval.data.source", "output.run_name",
    "output.save_dtype", "output.dir", "tracking.enabled", "tracking.experiment", "plan.enforce", "model.dtype",
    "model.lazy", "model.allow_pickle", "gate.enforce", "gate.backend", "gate.layers", "gate.perplexity.max_ratio",
    "gate.perplexity.seq_len", "gate.models_in_memory", "stages.0.bits", "stages.0.group_size", "stages.0.symmetric",
    "stages.0.ignore", "stages.0.type", "stages.1.bits", "stages.7.bits", "recipe", "model", "data", "gate",
]  # fmt: skip
GATE_KEYS = [f"gate.{field.name}" for field in dataclasses.fields(GatePolicy)] + [
    "gate.perplexity.max_ratio", "gate.perplexity.max_windows", "gate.kl.top_k", "gate.needle.context_lengths",
    "gate.lm_eval.limit", "gate.engine.kv_cache_dtype", "gate.engine.block_size", "gate.data.source",
]  # fmt: skip
ODD = [
    "null", "~", "???", "${oc.env:HOME}", "${nope}", "[1,2]", "[]", "{a: 1}", "{}", "'quoted'", '"x"', "a,b", "1e999",
    "-0", "0x10", "nan", "-inf", "true", "[lm_head, 'x']", "a=b", "=", "", " ", "\\", "${", "}", "[", "é", "../..",
]  # fmt: skip

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
values = st.one_of(numbers, st.booleans().map(lambda b: str(b).lower()), st.sampled_from(ODD), st.text(max_size=12))
random_keys = st.from_regex(r"[a-z_]{1,8}(\.[a-z0-9_]{1,8}){0,2}", fullmatch=True)
RUN_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip


def assert_clean(error: BaseException, overrides: list[str]) -> None:
    """One usage line (exit 2); an unwritable output folder is the machine's, exit 4, and one line too."""
    assert isinstance(error, CompressError), (overrides, repr(error))
    expected = ExitCode.FAILED if isinstance(error, EnvironmentFailure) else ExitCode.USAGE
    assert exit_code_of(error) == expected and str(error).strip(), (overrides, repr(error))
    assert "\n" not in str(error), (overrides, str(error))
    if isinstance(error, EnvironmentFailure):
        assert any(o.startswith(("output.dir=", "tracking.")) for o in overrides), (overrides, str(error))


def compose_and_check(model: str, recipe: str, overrides: list[str]) -> None:
    """What `python -m compress run recipe=<recipe> model=<model> <overrides>` does before it loads a model."""
    from compress.commands.run import validate

    try:
        validate(recipe, [f"model={model}", *overrides], multirun=False)
    except Exception as error:  # noqa: BLE001 - the property: only a CompressError may come out
        assert_clean(error, overrides)


@pytest.fixture(scope="module")
def recipes() -> list[str]:
    from compress.app.recipe import available

    return available()


@RUN_SETTINGS
@given(data=st.data(), pairs=st.lists(st.tuples(st.sampled_from(RUN_KEYS), values), min_size=1, max_size=3))
def test_any_value_on_a_real_run_key_is_accepted_or_one_usage_line(tiny_model_dir, artifacts, recipes, data, pairs):
    recipe = data.draw(st.sampled_from(recipes))
    compose_and_check(str(tiny_model_dir), recipe, [f"{key}={value}" for key, value in pairs])


@RUN_SETTINGS
@given(pairs=st.lists(st.tuples(random_keys, values), min_size=1, max_size=2), prefix=st.sampled_from(["", "+", "~"]))
def test_a_random_key_is_accepted_or_one_usage_line(tiny_model_dir, artifacts, pairs, prefix):
    compose_and_check(str(tiny_model_dir), "rtn_int4", [f"{prefix}{key}={value}" for key, value in pairs])


@settings(RUN_SETTINGS, max_examples=60)  # no composition by Hydra: milliseconds each
@given(pairs=st.lists(st.tuples(st.sampled_from(GATE_KEYS), values), min_size=1, max_size=3))
def test_any_gate_policy_value_is_accepted_or_one_usage_line(artifacts, pairs):
    """What `python -m compress gate ... gate.<key>=<value>` does with its policy before it loads anything."""
    from compress.commands.args import parse_options
    from compress.commands.gate import SYNOPSIS, GateOptions, load_policy
    from compress.evals.gate import resolve_policy

    argv = ["checkpoint=a", "baseline=b", *(f"{key}={value}" for key, value in pairs)]
    try:
        options, overrides = parse_options(GateOptions, argv, SYNOPSIS, passthrough="gate")
        policy = load_policy(options.gate, overrides)
        policy.pop("data", None)  # a data source is read, not composed: its keys are checked when it is loaded
        resolve_policy(policy)
    except Exception as error:  # noqa: BLE001 - the property: only a CompressError may come out
        assert_clean(error, argv)


@pytest.mark.parametrize("value", ["=", "${", "[", "}"])
def test_a_gate_value_yaml_cannot_read_is_one_usage_line(artifacts, capsys, value):
    """Found by the property above: the gate command merged its overrides unguarded, so YAML's and OmegaConf's parse
    errors (``gate.enabled==``) ended in a traceback and exit 4."""
    from compress.__main__ import main

    assert main(["gate", "checkpoint=a", "baseline=b", f"gate.enabled={value}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1 and f"error: gate.enabled={value}:" in err, err


def test_an_interpolation_into_a_section_is_one_usage_line(tiny_model_dir, artifacts):
    """Found by probing every run key with odd values: ``eval.data=${oc.env:HOME}`` typed the section as a string
    (interpolations were resolved after the type check) and the checks failed on it with an AttributeError."""
    from compress.commands.run import validate

    with pytest.raises(CompressError, match="DataSpec") as raised:
        validate("rtn_int4", [f"model={tiny_model_dir}", "eval.data=${oc.env:HOME}"], multirun=False)
    assert exit_code_of(raised.value) == ExitCode.USAGE and "\n" not in str(raised.value)


@pytest.mark.parametrize("override", ["stages.0.type={a: 1}", "stages.0.type=[1,2]", "recipe=${nope}"])
def test_odd_values_the_probe_found_are_one_usage_line(tiny_model_dir, artifacts, override):
    """Found by probing every run key with odd values: a mapping or list as a stage type raised TypeError
    (unhashable) and an unresolvable interpolation on ``recipe`` escaped as InterpolationKeyError."""
    from compress.commands.run import validate

    with pytest.raises(CompressError) as raised:
        validate("gptq_int4", [f"model={tiny_model_dir}", override], multirun=False)
    assert exit_code_of(raised.value) == ExitCode.USAGE and "\n" not in str(raised.value)

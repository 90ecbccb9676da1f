"""Gate layers on their own: the JSON state machine, constrained decoding, needle haystacks, KV fake quantization."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model_for

from compress.evals.generation import TransformersGenerator
from compress.evals.json_grammar import DONE, completion, parse_prefix
from compress.evals.json_validity import PROMPTS, evaluate_json, extract_object
from compress.evals.needle import NEEDLE, haystack, retrieved
from compress.grids.kv_quant import fake_quantize_kv

VALID = ['{"a": [1, -2.5e+3, true, null, {"b": "x\\u00e9\\n"}], "c": {}}', "{}", '{ "k" : [ ] }', '{"n": 0.5E-2}']
INVALID = ["[1]", '{"a": 01}', '{"a": }', "{,}", '{"a": 1,}', '{"a" 1}', '{"a": tru}', '{"a": 1]', '{"a": -}', "{} x"]


@pytest.mark.parametrize("document", VALID)
def test_state_machine_accepts_json_and_completes_every_prefix(document):
    assert parse_prefix(document)[0] == DONE
    for end in range(len(document)):
        completed = document[:end] + completion(parse_prefix(document[:end]))
        json.loads(completed)
        assert parse_prefix(completed)[0] == DONE


@pytest.mark.parametrize("document", INVALID)
def test_state_machine_rejects_invalid_json(document):
    state = parse_prefix(document)
    assert state is None or state[0] != DONE


def test_constrained_mode_always_yields_valid_json(tokenizer):
    """A random model emits no JSON on its own; constrained, every reply parses, even with a tight token budget."""
    model = tiny_model_for(tokenizer)
    generator = TransformersGenerator(model, tokenizer)
    free = evaluate_json(generator, tokenizer, model.config.vocab_size, 24, 3, constrained=False)
    assert free["json_validity"] == 0.0
    for budget in (12, 40):
        constrained = evaluate_json(generator, tokenizer, model.config.vocab_size, budget, 3, constrained=True)
        assert constrained["json_validity"] == 1.0, constrained["samples"]
        for sample in constrained["samples"]:
            assert isinstance(json.loads(sample["reply"]), dict)


def test_schema_compliance_is_checked_against_each_prompt_schema():
    from jsonschema import Draft202012Validator

    weather = next(prompt for prompt in PROMPTS if prompt.name == "weather_tool")
    good = extract_object('Sure: {"city": "Paris", "unit": "celsius"} done')
    bad = extract_object('{"city": "Paris", "unit": "kelvin"}')
    assert Draft202012Validator(weather.schema).is_valid(good)
    assert not Draft202012Validator(weather.schema).is_valid(bad)
    assert extract_object('{"city": "Paris"') is None


def test_haystack_has_exact_length_and_hides_the_needle_at_its_depth(tokenizer):
    filler = tokenizer("lorem ipsum dolor sit amet " * 400, add_special_tokens=False)["input_ids"]
    needle_text = NEEDLE.format(key=48213)
    positions = []
    for depth in (0.0, 0.5, 1.0):
        prompt = haystack(tokenizer, filler, 200, depth, 48213, seed=3)
        assert len(prompt) == 200
        assert prompt == haystack(tokenizer, filler, 200, depth, 48213, seed=3)
        text = tokenizer.decode(prompt)
        assert needle_text in text and text.endswith("The pass key is")
        positions.append(text.index(needle_text))
    assert positions[0] < positions[1] < positions[2]
    assert retrieved(" 48213. Remember", 48213) and not retrieved(" 4821", 48213)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_kv_fake_quantization_error_is_bounded_per_token(dtype):
    x = torch.randn(1, 2, 5, 16) * torch.logspace(-2, 2, 5)[None, None, :, None]
    error = (fake_quantize_kv(x, dtype) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    bound = amax / 127 / 2 if dtype == torch.int8 else amax / 8  # fp8 e4m3: 3 mantissa bits
    assert (error <= bound + 1e-7).all()
    assert (fake_quantize_kv(x, dtype) != x).any()

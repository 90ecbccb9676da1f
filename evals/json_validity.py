"""JSON-validity layer: can the model still produce the structured output that tool calls and extraction rely on?

Each prompt carries a JSON Schema. Validity: the reply contains a JSON object that parses (from its first ``{``;
chatter around it is tolerated, a truncated or malformed object is not). Compliance: that object also satisfies the
schema. In constrained mode decoding is restricted to valid JSON (``compress.evals.json_grammar``), so validity must be
100%: it tests the constraint, not the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from compress.evals.generation import Generator
from compress.evals.json_grammar import JsonConstraint, JsonVocabulary


@dataclass(frozen=True)
class JsonPrompt:
    name: str
    request: str
    schema: dict


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties)}


STRING, INTEGER, NUMBER, BOOLEAN = ({"type": kind} for kind in ("string", "integer", "number", "boolean"))

PROMPTS = [
    JsonPrompt(
        "weather_tool",
        "Call the tool get_weather for Paris in celsius. Reply with the arguments only.",
        _object({"city": STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
    ),
    JsonPrompt(
        "person_extraction",
        "Extract the person from this sentence: 'Alice Martin is 34 years old and lives in Lyon.'",
        _object({"name": STRING, "age": INTEGER, "city": STRING}),
    ),
    JsonPrompt(
        "search_tool",
        "Call the tool search_web to look up 'python 3.12 release date', returning 5 results.",
        _object({"query": STRING, "max_results": INTEGER}),
    ),
    JsonPrompt(
        "product_extraction",
        "Extract the product: 'The Acme X200 headphones cost 89.99 dollars and are in stock.'",
        _object({"product": STRING, "price": NUMBER, "in_stock": BOOLEAN}),
    ),
    JsonPrompt(
        "calendar_tool",
        "Call the tool create_event: a meeting called 'Budget review' on 2024-05-03 at 14:00 for 30 minutes.",
        _object({"title": STRING, "date": STRING, "time": STRING, "duration_minutes": INTEGER}),
    ),
    JsonPrompt(
        "email_tool",
        "Call the tool send_email to bob@example.com with subject 'Lunch' and body 'See you at noon.'",
        _object({"to": STRING, "subject": STRING, "body": STRING}),
    ),
    JsonPrompt(
        "tags_extraction",
        "List the programming languages mentioned: 'We rewrote the Perl scripts in Go and kept the Rust core.'",
        _object({"languages": {"type": "array", "items": STRING}}),
    ),
    JsonPrompt(
        "order_extraction",
        "Extract the order: 'Order 1182: 3 notebooks and 2 pens, shipped to Berlin.'",
        _object(
            {
                "order_id": INTEGER,
                "items": {"type": "array", "items": _object({"name": STRING, "quantity": INTEGER})},
                "destination": STRING,
            }
        ),
    ),
    JsonPrompt(
        "sentiment_extraction",
        "Classify the sentiment of: 'The battery died after two days, very disappointed.'",
        _object({"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}, "confidence": NUMBER}),
    ),
    JsonPrompt(
        "timer_tool",
        "Call the tool set_timer for 10 minutes with the label 'tea'.",
        _object({"minutes": INTEGER, "label": STRING}),
    ),
]


def render_prompt(tokenizer, prompt: JsonPrompt) -> list[int]:
    """The request and its schema, in the model's chat template when it has one."""
    instruction = (
        f"{prompt.request}\nAnswer with a single JSON object that follows this JSON Schema:\n"
        f"{json.dumps(prompt.schema)}"
    )
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": "You reply with JSON only."},
            {"role": "user", "content": instruction},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(f"{instruction}\nJSON: ", add_special_tokens=False)["input_ids"]


def extract_object(text: str):
    """The JSON object that starts at the first ``{`` of ``text``, or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def evaluate_json(
    generator: Generator, tokenizer, vocab_size: int, max_new_tokens: int, num_prompts: int | None, constrained: bool
) -> dict:
    """``json_validity`` and ``json_schema_compliance`` (fractions) plus each prompt's reply."""
    from jsonschema import Draft202012Validator

    prompts = PROMPTS[:num_prompts] if num_prompts else PROMPTS
    vocabulary = JsonVocabulary(tokenizer, vocab_size) if constrained else None
    rendered = [render_prompt(tokenizer, prompt) for prompt in prompts]
    if vocabulary is None:
        outputs = generator.generate_batch(rendered, [max_new_tokens] * len(rendered))
    else:  # each prompt's constraint follows its own tokens, one step at a time
        outputs = [generator.generate(ids, max_new_tokens, JsonConstraint(vocabulary)) for ids in rendered]
    samples = []
    for prompt, output in zip(prompts, outputs, strict=True):
        reply = tokenizer.decode(output, skip_special_tokens=True)
        value = extract_object(reply)
        compliant = value is not None and Draft202012Validator(prompt.schema).is_valid(value)
        samples.append({"prompt": prompt.name, "reply": reply, "valid": value is not None, "compliant": compliant})
    return {
        "json_validity": sum(sample["valid"] for sample in samples) / len(samples),
        "json_schema_compliance": sum(sample["compliant"] for sample in samples) / len(samples),
        "constrained": constrained,
        "prompts": len(samples),
        "samples": samples,
    }

"""``python -m compress generate checkpoint=PATH prompt="..." [max_tokens=64 temperature=0 top_p=1 top_k=0
seed= kv_cache_dtype=auto chat=auto stream=true]``: generate text with the compress engine."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from compress.errors import CompressError

USAGE = "python -m compress generate checkpoint=PATH prompt=TEXT [key=value ...]"
OPTIONS = {
    "checkpoint": None,
    "prompt": None,
    "max_tokens": "64",
    "temperature": "0",
    "top_p": "1",
    "top_k": "0",
    "seed": "",
    "kv_cache_dtype": "auto",
    "chat": "auto",
    "stream": "true",
}


def _choice(*choices: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in choices:
            raise ValueError(f"choose {' or '.join(choices)}")
        return value

    return check


CONVERTERS: dict[str, tuple[Callable[[str], object], str]] = {
    "max_tokens": (int, "an integer ≥ 1"),
    "top_k": (int, "an integer ≥ 0 (0: off)"),
    "temperature": (float, "a number ≥ 0"),
    "top_p": (float, "a number in (0, 1]"),
    "seed": (lambda value: int(value) if value else None, "an integer, or empty for none"),
    "chat": (_choice("auto", "true", "false"), "auto, true or false"),
    "stream": (_choice("true", "false"), "true or false"),
}


def parse(argv: list[str]) -> dict:
    """``key=value`` arguments → typed options and ``params`` (checked ``SamplingParams``); every problem is a
    one-line ``CompressError``."""
    options: dict = dict(OPTIONS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in OPTIONS:
            raise CompressError(f"bad argument {arg!r}: use key=value with key in {', '.join(OPTIONS)}")
        options[key] = value
    missing = [key for key, value in options.items() if value is None]
    if missing:
        raise CompressError(f"missing {', '.join(f'{key}=...' for key in missing)}; usage: {USAGE}")
    for key, (convert, expected) in CONVERTERS.items():
        try:
            options[key] = convert(options[key])
        except ValueError:
            raise CompressError(f"{key}={options[key]!r}: give {expected}") from None
    from compress.engine import SamplingParams
    from compress.engine.config import EngineConfig

    try:  # the engine's own checks, before the model loads
        options["params"] = SamplingParams(
            temperature=options["temperature"],
            top_p=options["top_p"],
            top_k=options["top_k"],
            max_tokens=options["max_tokens"],
            seed=options["seed"],
        )
        EngineConfig(kv_cache_dtype=options["kv_cache_dtype"])
    except ValueError as error:
        raise CompressError(str(error)) from None
    folder = Path(options["checkpoint"]).expanduser()
    if not (folder / "config.json").is_file():
        raise CompressError(
            f"checkpoint={options['checkpoint']}: no config.json there; give a checkpoint folder "
            "(e.g. artifacts/runs/<run-id>/checkpoint)"
        )
    return options


def _generate(options: dict) -> None:
    from compress.engine import LLM

    params = options["params"]
    try:
        llm = LLM(options["checkpoint"], kv_cache_dtype=options["kv_cache_dtype"])
        prompt = options["prompt"]
        template = getattr(llm.tokenizer, "chat_template", None)
        if options["chat"] == "true" or (options["chat"] == "auto" and template):
            prompt = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        if options["stream"] == "true":
            for event in llm.stream(prompt, params):
                print(event.text, end="", flush=True)
            print()
        else:
            print(llm.generate(prompt, params)[0].text)
    except (ValueError, OSError) as error:  # the engine's errors about this checkpoint or request
        raise CompressError(" ".join(str(error).split())) from None


def main(argv: list[str]) -> int:
    try:
        options = parse(argv)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        _generate(options)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0

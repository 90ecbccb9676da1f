"""``python -m compress generate checkpoint=PATH prompt="..." [max_tokens=64 temperature=0 top_p=1 top_k=0
seed=null kv_cache_dtype=auto chat=auto stream=true]``: generate text with the compress engine."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from compress.base.errors import CompressError
from compress.commands.args import parse_options, usage, wants_help
from compress.commands.exits import command_exits

if TYPE_CHECKING:
    from compress.engine import SamplingParams

SYNOPSIS = "python -m compress generate checkpoint=PATH prompt=TEXT [key=value ...]"


@dataclass
class GenerateOptions:
    checkpoint: str
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    kv_cache_dtype: str = "auto"
    chat: Literal["auto", "true", "false"] = "auto"  # auto: the tokenizer's chat template when it has one
    stream: bool = True


def parse(argv: list[str]) -> tuple[GenerateOptions, SamplingParams]:
    """The options and their checked ``SamplingParams``: the engine's own checks run before the model loads, and
    every problem is a one-line ``CompressError``."""
    options, _ = parse_options(GenerateOptions, argv, SYNOPSIS)
    from compress.engine import SamplingParams
    from compress.engine.engine_config import EngineConfig

    try:
        params = SamplingParams(
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            max_tokens=options.max_tokens,
            seed=options.seed,
        )
        EngineConfig(kv_cache_dtype=options.kv_cache_dtype)
    except ValueError as error:
        raise CompressError(str(error)) from None
    folder = Path(options.checkpoint).expanduser()
    if not (folder / "config.json").is_file():
        raise CompressError(
            f"checkpoint={options.checkpoint}: no config.json there; give a checkpoint folder "
            "(e.g. artifacts/runs/<run-id>/checkpoint)"
        )
    return options, params


def _generate(options: GenerateOptions, params: SamplingParams) -> None:
    from compress.engine import LLM

    try:
        llm = LLM(options.checkpoint, kv_cache_dtype=options.kv_cache_dtype)
        prompt = options.prompt
        template = getattr(llm.tokenizer, "chat_template", None)
        if options.chat == "true" or (options.chat == "auto" and template):
            prompt = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        if options.stream:
            for event in llm.stream(prompt, params):
                print(event.text, end="", flush=True)
            print()
        else:
            print(llm.generate(prompt, params)[0].text)
    except (ValueError, OSError) as error:  # the engine's errors about this checkpoint or request
        raise CompressError(" ".join(str(error).split())) from None


@command_exits
def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(usage(GenerateOptions, SYNOPSIS))
        return 0
    try:
        options, params = parse(argv)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    _generate(options, params)
    return 0

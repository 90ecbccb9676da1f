"""``python -m compress generate checkpoint=PATH prompt="..." [max_tokens=64 temperature=0 top_p=1 top_k=0
seed= kv_cache_dtype=auto chat=auto stream=true]``: generate text with the compress engine."""

from __future__ import annotations

import sys

OPTIONS = {
    "checkpoint": None, "prompt": None, "max_tokens": "64", "temperature": "0", "top_p": "1", "top_k": "0",
    "seed": "", "kv_cache_dtype": "auto", "chat": "auto", "stream": "true",
}


def parse(argv: list[str]) -> dict[str, str]:
    options = dict(OPTIONS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in OPTIONS:
            raise ValueError(f"bad argument {arg!r}: use key=value with key in {', '.join(OPTIONS)}")
        options[key] = value
    missing = [key for key, value in options.items() if value is None]
    if missing:
        raise ValueError(f"missing {', '.join(f'{key}=...' for key in missing)}")
    return options


def main(argv: list[str]) -> int:
    try:
        options = parse(argv)
    except ValueError as error:
        print(f"error: {error}\nusage: python -m compress generate checkpoint=PATH prompt=TEXT [key=value ...]",
              file=sys.stderr)
        return 2
    from compress.engine import LLM, SamplingParams

    llm = LLM(options["checkpoint"], kv_cache_dtype=options["kv_cache_dtype"])
    prompt = options["prompt"]
    template = getattr(llm.tokenizer, "chat_template", None)
    if options["chat"] == "true" or (options["chat"] == "auto" and template):
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    params = SamplingParams(
        temperature=float(options["temperature"]), top_p=float(options["top_p"]), top_k=int(options["top_k"]),
        max_tokens=int(options["max_tokens"]), seed=int(options["seed"]) if options["seed"] else None,
    )
    if options["stream"] == "true":
        for event in llm.stream(prompt, params):
            print(event.text, end="", flush=True)
        print()
    else:
        print(llm.generate(prompt, params)[0].text)
    return 0

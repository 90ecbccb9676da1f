"""``python -m compress plan recipe=<name> [model=...] [key=value ...]``: what a run of this recipe will need.

Prints the predicted peak host RAM, accelerator memory, disk and wall time per phase (``compress.app.preflight``)
without reading any weight: the model's ``config.json`` and safetensors headers, its tokenizer (to count evaluation
tokens) and a half-second probe of this machine. ``run`` prints the same plan first and refuses, before any work, when
free disk or available RAM is below it (``plan.enforce=false`` to try anyway). Exit status 0, or a usage error (2).
"""

from __future__ import annotations

import sys
from pathlib import Path

from compress.app.recipe import available, check_overrides, compose_job, resolve_shortcuts
from compress.base.errors import CompressError
from compress.commands.exits import command_exits, exit_code_of


@command_exits
def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    from compress.app.preflight import available_ram_mb, plan_for
    from compress.app.run_config import register_schema
    from compress.model.sources import check_model_source, resolve_model_path
    from compress.stages import build_chain

    try:
        recipes = [a.split("=", 1)[1] for a in argv if a.startswith("recipe=")]
        overrides = [a for a in argv if not a.startswith("recipe=")]
        if not recipes or recipes[-1] not in available():
            raise CompressError(f"choose a recipe: recipe=<name>; available: {', '.join(available())}")
        register_schema()
        config = compose_job(recipes[-1], check_overrides(recipes[-1], resolve_shortcuts(overrides)))
        check_model_source(config.model)
        folder = Path(resolve_model_path(config.model))
        if not folder.is_dir():
            raise CompressError(
                f"model {config.model.path!r} is not a local folder: the plan reads its config.json and safetensors "
                "headers; download it first (huggingface-cli download <id> --local-dir <folder>) and pass the folder"
            )
        plan = plan_for(config, build_chain(config.stages), folder)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return int(exit_code_of(error))
    print("\n".join(plan.lines()))
    print(f"  this machine: {available_ram_mb():.0f} MB RAM available")
    return 0

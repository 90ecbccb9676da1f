"""``python -m compress config [section or key] [--markdown]``: every configuration key (run, model, data, eval,
output, tracking, plan, each gate layer, the gate's engine, each stage type, search) with its type, default and
meaning, read from the typed classes that check them. ``compress config gate`` shows the gate's sections,
``compress config stages.gptq`` one stage, ``compress config gate.perplexity.max_ratio`` one key; ``--markdown``
writes docs/config.md's text (``python -m compress config --markdown > docs/config.md``)."""

from __future__ import annotations

import sys

from compress.base.errors import CompressError
from compress.commands.args import wants_help
from compress.commands.exits import command_exits


@command_exits
def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(__doc__)
        return 0
    from compress.commands.config_reference import markdown, sections, select, text

    as_markdown = "--markdown" in argv
    wanted = [arg for arg in argv if arg != "--markdown"]
    if len(wanted) > 1 or any(arg.startswith("-") for arg in wanted):
        raise CompressError(f"give at most one section or key, and --markdown; got {' '.join(argv)}")
    found = select(sections(), wanted[0]) if wanted else sections()
    sys.stdout.write(markdown(found) if as_markdown else text(found))
    return 0

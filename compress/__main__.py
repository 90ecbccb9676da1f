"""``python -m compress <command> ...``: each command lives in ``compress.commands.<command>`` and is imported
only when asked for, so a bare GPU box can run ``generate``/``bench`` without the pipeline's dependencies."""

from __future__ import annotations

import importlib
import sys

from compress.base.errors import EXIT_CODES_HELP, ExitCode

COMMANDS = {
    "run": "run a recipe: calibrate, compress, save a checkpoint, evaluate, gate, log to MLflow",
    "plan": "what a run will need (RAM, disk, time per phase), predicted without reading any weight",
    "search": "the smallest mixed-precision checkpoint within a bits budget that passes the gate",
    "gate": "judge a candidate checkpoint against a baseline; exit 0 pass, 1 block, 3 inconclusive",
    "config": "every configuration key: type, default and meaning (`config gate`, `config --markdown`)",
    "compare": "table and Pareto plot of logged runs",
    "generate": "generate text from a checkpoint with the compress engine",
    "bench": "benchmarks: `bench kernels` (vs torch), `bench peers` (vs torch int4/int8/fp8, gemlite), `bench engine`",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print("usage: compress <command> [key=value ...]   (or: python -m compress <command> ...)\n\ncommands:")
        for name, summary in COMMANDS.items():
            print(f"  {name:<10} {summary}")
        print(f"\n{EXIT_CODES_HELP}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return int(ExitCode.USAGE)
    module = importlib.import_module(f"compress.commands.{command}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

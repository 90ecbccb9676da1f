"""``python -m compress bench kernels|engine [...]``: dispatch to the benchmark that owns each target."""

from __future__ import annotations

import importlib
import sys

TARGETS = {"kernels": "kernels.bench", "engine": "compress.engine.bench"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TARGETS:
        print(f"usage: python -m compress bench {{{'|'.join(TARGETS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(TARGETS[argv[0]])
    return int(module.main(argv[1:]) or 0)

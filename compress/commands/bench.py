"""``python -m compress bench kernels|engine|peers [...]``: dispatch to the benchmark script that owns each target.

The benchmarks live in the checkout's ``benchmarks/`` folder, outside the runtime packages (``kernels``,
``compress``), so a wheel ships no benchmark code. ``benchmarks`` is a namespace package of the checkout's root:
this command puts that root first on ``sys.path`` (the same checkout as this ``compress``) and imports the script.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from compress.commands.exits import command_exits

TARGETS = {
    "kernels": "benchmarks.bench_kernels",
    "engine": "benchmarks.bench_engine",
    "peers": "benchmarks.kernel_peers",
}
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]


def load_target(name: str) -> ModuleType:
    """The benchmark module of ``name`` from this checkout's ``benchmarks/`` folder."""
    if not (CHECKOUT_ROOT / "benchmarks" / f"{TARGETS[name].rsplit('.', 1)[1]}.py").is_file():
        raise FileNotFoundError(
            f"`bench {name}` needs the source checkout's benchmarks/ folder (not part of the installed package); "
            f"run it from a clone of the repository ({CHECKOUT_ROOT} has none)"
        )
    if sys.path[:1] != [str(CHECKOUT_ROOT)]:
        sys.path.insert(0, str(CHECKOUT_ROOT))
    return importlib.import_module(TARGETS[name])


@command_exits
def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TARGETS:
        print(f"usage: python -m compress bench {{{'|'.join(TARGETS)}}} [options]", file=sys.stderr)
        return 2
    try:
        module = load_target(argv[0])
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return int(module.main(argv[1:]) or 0)

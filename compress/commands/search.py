"""``python -m compress search recipe=<base recipe> [gate=quick] search.budget_bits=<bits/weight>
[search.candidates=[int3_g64,int4_g64,int8,fp8,bf16]] [search.max_trials=N] [key=value ...]``: the smallest
mixed-precision checkpoint within the budget that passes the gate (see ``compress.search``). Other keys are the
``run`` command's (``model=``, ``data.num_samples=``, ``gate.perplexity.max_ratio=``, ``tracking.enabled=`` ...).
Exit 0 with a passing checkpoint, 1 when a limit stopped the search, 2 on a usage error."""

from __future__ import annotations

import logging
import sys

from compress.base.errors import CompressError
from compress.base.signals import signals_recorded
from compress.commands.exits import command_exits

USAGE = __doc__.split(":", 1)[0].strip("`")


def search_spec(overrides: list[str]):
    """``search.<key>=<value>`` overrides (without the prefix) over ``SearchSpec``'s defaults, type-checked."""
    from omegaconf import OmegaConf

    from compress.base.typed import typed
    from compress.search import SearchSpec

    spec = typed(SearchSpec, OmegaConf.from_dotlist(overrides), "search")
    spec.check()
    return spec


@command_exits
def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from compress.commands.run import available, validate

    search = [a.removeprefix("search.") for a in argv if a.startswith("search.")]
    recipes = [a.split("=", 1)[1] for a in argv if a.startswith("recipe=")]
    rest = [a for a in argv if not a.startswith(("search.", "recipe="))]
    try:
        if not recipes or recipes[-1] not in available():
            raise CompressError(f"choose a base recipe: recipe=<name>; available: {', '.join(available())}")
        spec = search_spec(search)
        _, [config] = validate(recipes[-1], rest, multirun=False)
    except CompressError as error:
        print(f"error: {error}; usage: {USAGE}", file=sys.stderr)
        return 2
    from compress.search import run_search

    with signals_recorded():  # Ctrl-C and SIGTERM unwind, never lost: the MLflow runs end KILLED
        result = run_search(config, spec)
    if result.mlflow_run_id:
        print(f"MLflow run: {result.mlflow_run_id} (one child run per trial)")
    print("\n" + (result.folder / "search.md").read_text().rstrip())  # ends with the one outcome line
    return result.exit_code

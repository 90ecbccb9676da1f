"""Every command ends the same way (``ExitCode``): a verdict the command returns, or an exception mapped here, so
CI can tell a blocked checkpoint from a typo, a crash and a kill."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable

from compress.base.errors import CompressError, EnvironmentFailure, ExitCode, interruption
from compress.base.signals import Terminated


def exit_code_of(error: BaseException) -> ExitCode:
    stop = interruption(error)
    if stop is not None:
        return ExitCode.TERMINATED if isinstance(stop, Terminated) else ExitCode.INTERRUPTED
    if isinstance(error, EnvironmentFailure):
        return ExitCode.FAILED
    if isinstance(error, CompressError):
        return ExitCode.USAGE
    return ExitCode.FAILED


def command_exits(main: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """A command's ``main`` that returns its code instead of raising: a CompressError prints its one line (usage: 2;
    an environment failure: 4), an interrupt prints one line (130 / 143), anything else is a bug: traceback, 4."""

    @functools.wraps(main)
    def wrapper(argv: list[str]) -> int:
        try:
            return int(main(argv) or 0)
        except SystemExit:
            raise
        except BaseException as error:
            code = exit_code_of(error)
            if code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
                print(f"interrupted: {interruption(error)}", file=sys.stderr)
            elif isinstance(error, CompressError):
                print(f"error: {error}", file=sys.stderr)
            else:
                traceback.print_exc()
                print(
                    f"error: unexpected {type(error).__name__}: {error} (a bug; the traceback is above)",
                    file=sys.stderr,
                )
            return int(code)

    return wrapper

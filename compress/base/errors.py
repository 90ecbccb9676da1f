"""One exception type for problems the user can fix: the CLI prints its message alone, without a traceback.

The one "did you mean" helper lives here too, so every layer that refuses a name (a config key, a stage argument, a
module pattern) suggests the closest valid one the same way.
"""

import difflib
from enum import IntEnum


class CompressError(Exception):
    """Bad input or configuration; the message names the problem and the fix."""


class EnvironmentFailure(CompressError):
    """The input was fine but something it relies on failed (an MLflow store that cannot be written, a full disk):
    one line like any CompressError, with its own exit code, since fixing the command line will not help."""


class ExitCode(IntEnum):
    """What every command exits with (the README's table, ``compress --help``); CI can branch on it."""

    OK = 0  # done; the gate passed
    BLOCKED = 1  # the gate blocked; search found no passing checkpoint within its limits
    USAGE = 2  # bad input (argument, recipe, config, model, data, pattern, baseline): refused, nothing written
    CANNOT_JUDGE = 3  # the gate could not decide: INCONCLUSIVE when enforced
    FAILED = 4  # the machine or a store failed, or a bug: the message (and a bug's traceback) says which
    INTERRUPTED = 130  # Ctrl-C
    TERMINATED = 143  # SIGTERM


EXIT_CODES_HELP = (
    "exit codes: 0 ok/pass · 1 blocked (search: nothing passed within its limits) · 2 usage or config error · "
    "3 could not judge (inconclusive, enforced) · 4 failed (machine, store or bug) · 130 Ctrl-C · 143 SIGTERM"
)


def interruption(error: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM behind ``error``: library code interrupted mid-cleanup can raise its own error while
    the interrupt propagates (omegaconf did, inside the gate), and the run must still end as killed."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def did_you_mean(name: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing when none is close."""
    hint = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def unknown_key_error(where: str, key: str, valid: list[str]) -> CompressError:
    return CompressError(f"{where}: unknown key {key!r}{did_you_mean(key, valid)}; valid keys: {', '.join(valid)}")

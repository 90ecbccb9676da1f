"""One exception type for problems the user can fix: the CLI prints its message alone, without a traceback.

The one "did you mean" helper lives here too, so every layer that refuses a name (a config key, a stage argument, a
module pattern) suggests the closest valid one the same way.
"""

import difflib


class CompressError(Exception):
    """Bad input or configuration; the message names the problem and the fix."""


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

"""One exception type for problems the user can fix: the CLI prints its message alone, without a traceback."""


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

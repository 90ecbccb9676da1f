"""One exception type for problems the user can fix: the CLI prints its message alone, without a traceback."""


class CompressError(Exception):
    """Bad input or configuration; the message names the problem and the fix."""

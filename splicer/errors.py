"""The one exception type the CLI turns into a one-line message."""


class SplicerError(Exception):
    """A problem with the user's input or environment.

    The message names the problem and the fix in one line; the CLI prints it without a
    traceback and exits non-zero.
    """

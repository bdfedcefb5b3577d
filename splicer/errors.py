"""The one exception type the CLI turns into a one-line message."""


class SplicerError(Exception):
    """A problem with the user's input or environment.

    The message names the problem and the fix in one line; the CLI prints it without a
    traceback and exits non-zero.
    """


def exit_code(run) -> int:
    """run() for a module's command line (`python -m splicer.X`): its exit code, or, when it raises SplicerError, the
    message as one line on stderr (as the splicer CLI prints it) and exit code 2."""
    import sys

    try:
        return run()
    except SplicerError as e:
        print(f"splicer: error: {e}", file=sys.stderr)
        return 2

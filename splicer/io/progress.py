"""Stage lines: one line when a long stage starts and one when it ends, with its elapsed time.

On a terminal the progress bars say where a run is; in a log, under CI or in a GPU machine's captured output, bars
are either noise or nothing, and a 10-minute run would otherwise print nothing until the end. So stage lines go to
stderr when it is not a terminal (unless quiet), and always to the run's own log file when it has one.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import SplicerError


class Stages:
    def __init__(self, quiet: bool = False, log_path: Path | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.to_stream = not quiet and not _is_terminal(self.stream)
        self.log_path = log_path

    def line(self, text: str, log_only: bool = False) -> None:
        if self.to_stream and not log_only:
            print(f"splicer: {text}", file=self.stream, flush=True)
        if self.log_path is not None:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(f"{stamp} {text}\n")

    def notice(self, text: str) -> None:
        """A line the user must see whatever the output (work about to be redone, a result to read with care): on
        the stream even on a terminal, where stage lines are left to the progress bars, and in the log."""
        self.line(text, log_only=True)
        print(f"splicer: {text}", file=self.stream, flush=True)

    @contextmanager
    def stage(self, name: str):
        self.line(f"{name}: started")
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as e:
            # A refusal is said once, in the CLI's one error line; the log keeps where it happened.
            self.line(
                f"{name}: stopped after {time.perf_counter() - t0:.1f} s ({e.__class__.__name__}: {e})",
                log_only=isinstance(e, SplicerError),
            )
            raise
        self.line(f"{name}: done in {time.perf_counter() - t0:.1f} s")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


SILENT = Stages(quiet=True)

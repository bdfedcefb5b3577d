"""What the command line prints must reach any terminal: a stdout that cannot encode a character (PYTHONIOENCODING=ascii,
a latin-1 console, a C locale without UTF-8) gets an ASCII spelling of the few symbols splicer's tables use, and
backslash escapes for anything else, instead of a UnicodeEncodeError at the first Δ."""

from __future__ import annotations

import codecs
import sys

HANDLER = "splicer-ascii"
ASCII = {
    "Δ": "d",
    "−": "-",
    "±": "+/-",
    "×": "x",
    "‖": "||",
    "§": "S",
    "…": "...",
    "≈": "~",
    "≤": "<=",
    "≥": ">=",
    "→": "->",
    "←": "<-",
    "·": "*",
    "µ": "u",
    "—": "--",
    "–": "-",
    "’": "'",
    "“": '"',
    "”": '"',
}


def _fallback(e: UnicodeError):
    if not isinstance(e, UnicodeEncodeError):
        raise e
    text = e.object[e.start : e.end]
    return "".join(ASCII.get(c) or c.encode("ascii", "backslashreplace").decode("ascii") for c in text), e.end


def printable_everywhere() -> None:
    """Make stdout and stderr replace what their encoding cannot hold (see the module's docstring)."""
    codecs.register_error(HANDLER, _fallback)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors=HANDLER)
        except (AttributeError, ValueError, OSError):  # not a text stream of io's (a test's capture, a closed stream)
            pass

"""A caller's text as error messages quote it: short, whatever the caller sent."""

from __future__ import annotations

# Characters of a caller's text an error message quotes: repr() of a 1 MiB model name
# took 4 ms with the GIL held, on every call naming it (`benchmarks/attacks.py` row 11:
# an honest call 9.4x slower under such callers, 3.1x with names cut short).
QUOTED_CHARS = 100


def quoted(text: str) -> str:
    """`text` as repr() gives it, cut to QUOTED_CHARS with its length said."""
    if len(text) <= QUOTED_CHARS:
        return repr(text)
    return f"{text[:QUOTED_CHARS]!r}... ({len(text)} characters)"

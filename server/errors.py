"""Errors the server reports to callers, each tied to one gRPC status code by name.

The engine raises these without importing gRPC; the service maps `code` to a status.
"""


class PergradServerError(Exception):
    """A request the server cannot serve as asked; the message tells the caller why."""

    code = "INTERNAL"


class InvalidArgument(PergradServerError):
    code = "INVALID_ARGUMENT"


class NotFound(PergradServerError):
    code = "NOT_FOUND"


class FailedPrecondition(PergradServerError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(PergradServerError):
    code = "RESOURCE_EXHAUSTED"


class Cancelled(PergradServerError):
    """The caller went away (cancelled, or past its deadline); the work stopped."""

    code = "CANCELLED"


# Characters of a caller's text an error message quotes: repr() of a 1 MiB model name
# took 4 ms with the GIL held, on every call naming it.
QUOTED_CHARS = 100


def quoted(text: str) -> str:
    """`text` as repr() gives it, cut to QUOTED_CHARS with its length said."""
    if len(text) <= QUOTED_CHARS:
        return repr(text)
    return f"{text[:QUOTED_CHARS]!r}... ({len(text)} characters)"

"""Errors the server reports to callers, each tied to one gRPC status code by name.

The engine raises these without importing gRPC; the service maps `code` to a status.
"""


class PergradServerError(Exception):
    """A request the server cannot serve as asked; the message tells the caller why."""

    code = "INTERNAL"


class InvalidArgument(PergradServerError):
    code = "INVALID_ARGUMENT"


class RefusedUnparsed(InvalidArgument):
    """A request refused from its bytes before it was parsed, and the model they name
    (None if none could be read): a refused update still counts for its model."""

    def __init__(self, message: str, *, model: str | None) -> None:
        super().__init__(message)
        self.model = model


class NotFound(PergradServerError):
    code = "NOT_FOUND"


class FailedPrecondition(PergradServerError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(PergradServerError):
    code = "RESOURCE_EXHAUSTED"


class RequestTooLarge(ResourceExhausted):
    """A request over a bound on one request (--max-batch, or what one call alone may
    hold): refused for what it holds, as an INVALID_ARGUMENT one is."""


def over_max_batch(what: str, batch: int, max_batch: int) -> RequestTooLarge:
    """The refusal of a batch over --max-batch (`what`: the tensor that holds it)."""
    return RequestTooLarge(
        f"{what}: batch of {batch} exceeds --max-batch {max_batch} "
        "(ModelInfo.limits.max_batch); split it"
    )


class Cancelled(PergradServerError):
    """The caller went away (cancelled, or past its deadline); the work stopped."""

    code = "CANCELLED"

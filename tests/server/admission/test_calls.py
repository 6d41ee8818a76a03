"""A call's record travels on its context (`calls.Context`): the servicer reads it there,
and everything else it asks of the context is gRPC's own."""

from __future__ import annotations

import copy

from pergrad.server.admission import calls


class _GrpcContext:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"


def test_the_record_rides_on_the_context_and_the_rest_is_grpcs() -> None:
    record = calls.Call("caller")
    context = calls.Context(_GrpcContext(), record)
    assert calls.of(context) is record
    assert context.peer() == "ipv4:127.0.0.1:5"
    calls.of(context).refused_for_content = True
    assert record.refused_for_content


def test_a_call_no_guard_started_has_a_blank_record() -> None:
    assert calls.of(_GrpcContext()) == calls.Call("")


def test_a_copy_of_the_context_is_made_without_asking_grpc() -> None:
    context = calls.Context(_GrpcContext(), calls.Call("caller"))
    assert copy.copy(context).record is context.record

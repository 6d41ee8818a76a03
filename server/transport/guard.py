"""Keeping idle and slow callers from holding the server's capacity.

A sync gRPC server runs each call on a thread, which a call waiting on its client holds
for as long as the client likes. So this interceptor gives every call it admits a thread
at once, against the places of its kind (the rows of `admission.limits`; beyond them,
RESOURCE_EXHAUSTED at once, on the refusals' threads), and a worker's place only once
its request has arrived (a stream, as it starts): callers that send nothing hold threads
and places, never the workers, and one caller computes one-request calls on half of them
at most. Every call's requests, and a stream's responses, pass under the stall timer
(`stalls`), a one-request method served as request-streaming so that waiting for its
request is timed too; a call to the service holds its request's bytes (`Admission.hold`)
from its first message to its end. Calls to the open services (no token) run on pools of
their own, one connection's on half of their places at most (`_open_share`), and may
evict one that waits on its client (`pools`). A caller whose requests
refused for their content came to more than its budget of bytes lately (`budgets`) has
its calls refused unread: each was received and copied before it could be refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import Message

from pergrad.server.admission import calls
from pergrad.server.admission.budgets import refused_bytes
from pergrad.server.admission.inflight import Admission
from pergrad.server.admission.limits import REFUSED_BYTES, REFUSED_WINDOW_S, Capacities, share
from pergrad.server.admission.pools import Place, Pool, take_each
from pergrad.server.errors import PergradServerError
from pergrad.server.metrics import ServerMetrics
from pergrad.server.status import RefusedRequest
from pergrad.server.transport.auth import token_key
from pergrad.server.transport.chunked import RequestBounds, whole_request
from pergrad.server.transport.grpc_private import is_non_blocking, non_blocking, run_on
from pergrad.server.transport.handlers import behavior_of, refusal, replaced
from pergrad.server.transport.open_services import full, open_parser
from pergrad.server.transport.stalls import StallTimer, TimedCall
from pergrad.wire.chunked_requests import comes_in_parts
from pergrad.wire.rpc import OPEN_SERVICES, split_method


class CallGuard(grpc.ServerInterceptor):
    def __init__(
        self, limits: Capacities, admission: Admission, metrics: ServerMetrics, *, tokens: bool
    ) -> None:
        stall_s = limits["stall_s"]
        self._timer = StallTimer(stall_s, metrics.call_stalled)
        self._on_refused_unread = metrics.call_refused_unread
        self._admission = admission
        self._bounds = RequestBounds(limits.count("request_bytes"), limits.count("batch"), stall_s)
        self._refused = refused_bytes()
        # A caller may hold half of each pool: of the calls and streams to the service
        # per token (without tokens a caller is known only once its handler runs).
        self._tokens = tokens
        most, workers, streams, opened, watches = (
            limits.count(n) for n in ("calls", "workers", "streams", "open_calls", "watch_streams")
        )
        self._calls = Pool(most, per_caller=share(most) if tokens else None)
        self._workers = Pool(workers, per_caller=share(workers))
        self._streams = Pool(streams, per_caller=share(streams) if tokens else None)
        self._open = Pool(opened, per_caller=share(opened), evict=True)
        self._open_streams = Pool(limits.count("open_streams"))
        self._watches = Pool(watches, evict=True)
        self._open_pool = ThreadPoolExecutor(max_workers=opened, thread_name_prefix="pergrad-open")
        self._watch_pool = ThreadPoolExecutor(
            max_workers=watches, thread_name_prefix="pergrad-watch"
        )

    def close(self) -> None:
        self._timer.stop()
        for pool in (self._open_pool, self._watch_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Runs on gRPC's polling thread as the call arrives: it takes the call's places
        or refuses it here, by a handler on the refusals' threads (`handlers.refusal`)."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        open_service = split_method(method)[0] in OPEN_SERVICES
        behavior = behavior_of(handler)
        watch = is_non_blocking(behavior)
        if watch and handler.request_streaming:  # none is served: unguarded, it would pass
            raise TypeError(f"{method}: a non-blocking request stream cannot be timed")
        # The caller, where a token names it (the token check ran first); else its
        # connection, known once the handler runs.
        token = None
        if not open_service and self._tokens:
            token = token_key(handler_call_details.invocation_metadata)
        kind = self._watches if watch else self._open if open_service else self._calls
        wanted = [(kind, token)]
        if handler.request_streaming:  # never a Watch (an error above)
            wanted.append((self._open_streams if open_service else self._streams, token))
        places = take_each(wanted)
        if places is None:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            return refusal(handler.response_streaming, code, full(open_service))
        call = None if open_service else calls.Call(token or "")
        arrival = _Arrival(handler, behavior, method, places, call)
        guarded = self._watch_handler(arrival) if watch else self._guarded(arrival)
        if open_service:
            run_on(guarded, self._watch_pool if watch else self._open_pool)
        deserializer = handler.request_deserializer
        parse = open_parser(deserializer) if call is None else call.reading(deserializer)
        return replaced(handler, guarded, request_streaming=True, request_deserializer=parse)

    def _guarded(self, arrival: _Arrival) -> Callable[..., Any]:
        """The call's behaviour, holding its places until it ends, and a call to an open
        service (no record) one of its connection's share (`_open_share`)."""
        call = arrival.call

        def handle(iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            for place in arrival.places:
                place.hold_until_done(context)
            if call is None:
                self._open_share(arrival.places[0], context)
                return self._serve(arrival, iterator, context)
            call.caller = call.caller or context.peer()  # no token: its connection
            self._within_refused_budget(call.caller, arrival.method, context)
            try:
                return self._serve(arrival, iterator, context)
            except BaseException:
                self._count(call)
                raise

        return handle

    def _watch_handler(self, arrival: _Arrival) -> Callable[..., Any]:
        """A non-blocking handler (health Watch): its places held until the call ends,
        its thread given back once its request is read."""

        def handle_watch(
            iterator: Iterator[Any], context: grpc.ServicerContext, send: Callable[..., None]
        ) -> None:
            for place in arrival.places:
                place.hold_until_done(context)
            timed = TimedCall(self._timer, context, arrival.method, arrival.waiting)
            return arrival.behavior(timed.one_request(iterator), context, send)

        non_blocking(handle_watch)
        return handle_watch

    def _serve(
        self, arrival: _Arrival, iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Any:
        """The call served under the stall timer, its record (calls to the service) kept
        current and handed to the servicer on its context, its request priced and a
        worker's place taken."""
        handler, call = arrival.handler, arrival.call
        timed = TimedCall(self._timer, context, arrival.method, arrival.waiting)
        served = context if call is None else calls.Context(context, call)
        if handler.request_streaming:
            if call is not None:
                self._workers.wait_for(None, context)
            result = arrival.behavior(timed.requests(iterator), served)
        else:
            whole = functools.partial(self._whole, call=call, context=context)
            request = timed.one_request(iterator, whole)
            if call is not None and not isinstance(request, RefusedRequest):
                self._workers.wait_for(call.caller, context)  # a refusal is answered at once
            result = arrival.behavior(request, served)
        if not handler.response_streaming:
            return result
        return timed.responses(result, functools.partial(self._count, call))

    def _within_refused_budget(
        self, caller: str, method: str, context: grpc.ServicerContext
    ) -> None:
        """Refuse the call before its request is read while its caller's refused bytes
        are over their budget (`budgets.Budget`, windowed), counting it."""
        wait_s = self._refused.wait_s(caller)
        if wait_s > 0:
            self._on_refused_unread(method)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this caller's requests refused in the last {REFUSED_WINDOW_S:g} s "
                f"for what they held came to more than {REFUSED_BYTES >> 20} MiB: its "
                "calls are refused unread for "
                f"{wait_s:.1f} s more; fix what those refusals named",
            )

    def _count(self, call: calls.Call | None) -> None:
        """A call refused for its content: its request's bytes, against its caller's
        budget."""
        if call is not None and call.request_bytes and call.refused_for_content:
            self._refused.charge(call.caller, call.request_bytes)

    def _open_share(self, place: Place, context: grpc.ServicerContext) -> None:
        """Count the call's open place against its connection, or refuse the call at once:
        one connection's silent calls cannot hold every place (calls to health and
        reflection need no token, so their caller is their connection, known once the
        handler runs)."""
        if not place.claim(context.peer()):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this connection holds {self._open.per_caller} calls to health and "
                "reflection already; end one, or open another connection",
            )

    def _whole(
        self,
        first: Any,
        rest: Iterator[Any],
        call: calls.Call | None,
        context: grpc.ServicerContext,
    ) -> Any:
        """A call to the service's one request, its bytes held (`_hold`) from its first
        message, which declares them, to the call's end, and its chunks read then
        (`chunked.whole_request`: the servicer gets a `Whole` of a request that may come
        in chunks, any other message as it is); a refusal on the way, the hold's too,
        handed to the servicer to answer (and count: a refused step is a failed update)."""
        if call is None or not isinstance(first, Message):
            return first  # an open service's, or malformed: its handler refuses it
        hold = functools.partial(self._hold, call=call, context=context)
        try:
            whole = whole_request(first, rest, call=call, bounds=self._bounds, hold=hold)
        except PergradServerError as err:
            return RefusedRequest(err, model=getattr(first, "model", None))
        return whole if comes_in_parts(first) else first

    def _hold(self, nbytes: int, call: calls.Call, context: grpc.ServicerContext) -> None:
        """Price the request's bytes from its arrival to the call's end
        (`Admission.hold`: ResourceExhausted if they do not fit), kept on its record:
        calls queued for a worker hold their requests too."""
        release = self._admission.hold(nbytes, call.caller)
        call.held_bytes = nbytes
        if not context.add_callback(release):
            release()


class _Arrival(NamedTuple):
    """A call the guard admitted, as it arrived: its handler, behaviour and method, the
    places it holds, and its record (None for a call to an open service, which has
    none)."""

    handler: grpc.RpcMethodHandler
    behavior: Callable[..., Any]
    method: str
    places: list[Place]
    call: calls.Call | None

    @property
    def waiting(self) -> Place | None:
        """An open call's place, which it may lose while it waits on its client."""
        return self.places[0] if self.call is None else None

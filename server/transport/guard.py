"""Keeping idle and slow callers from holding the server's capacity.

A sync gRPC server runs each call in a thread; a call that waits on its client (a
request that never comes, a stream that sends no next request, a client that reads no
response) holds its thread for as long as the client likes. So every call admitted gets
a thread of its own at once, and computing takes one of `workers` permits besides: a
call to the service takes one only once its request has arrived (a stream, as it
starts), so callers that send nothing hold threads and places, never the workers, and
never make a call whose request has arrived wait for them; and a caller (its token, or
its connection without tokens) has at most half of them (at least one) computing
one-request calls at once, so that its many calls leave workers to the others (its
request streams, a worker each for as long as they last, are bounded by their places,
per token: a caller's idle streams never hold up its own calls). This interceptor:
- cancels a call that has waited on its client for `stall_timeout_s` (time the handler
  spends computing does not count: only waiting for a request, or for gRPC to send a
  response, which the client's reading paces);
- serves every method that takes one request as request-streaming (the same on the
  wire, `handlers.as_request_stream`) and reads that request itself, so that waiting for
  it is timed too (gRPC would read it before any handler runs, for as long as it takes);
  a call that ends with no request, or sends a second, is INVALID_ARGUMENT; a call to
  the service holds its request's bytes (`Admission.hold`) from then until it ends, so
  calls queued for a worker are priced too;
- admits every call itself, as it arrives, against places of its kind, each given back
  when its call ends: `max_calls` calls to the service (running or waiting for a
  worker), of which `max_streams` request streams (StreamPerExampleGradients,
  SetWeights), `per_caller_streams` per token where the server has tokens, and of all
  those, `per_caller_calls` per token (so one token cannot fill the queue);
  `max_open_calls` calls to health Check and reflection, of which
  `max_open_streams` reflection streams; `max_watch_streams` health Watch streams.
  Beyond a limit a call is refused at once with RESOURCE_EXHAUSTED, on the refusals'
  threads. gRPC's own limit (`maximum_concurrent_rpcs`) lies above the sum, so it never
  refuses a call the guard admitted, and no place needs to expire;
- runs every call to an open service on a pool of its own, a thread per place (health
  Watches on one of theirs, with places of their own): a caller without a token cannot
  reach the workers, nor make a health check wait, and watchers cannot take a health
  check's place. An open call (or Watch) arriving when every place of its kind is taken
  takes the place of the one that has waited on its client longest, for
  EVICTABLE_AFTER_S at least (cancelled): callers that send nothing cannot lock out
  those that do; and a connection's calls to health Check and reflection hold half of
  the places at most (refused once their handler runs, before their request is read;
  until then each holds a place), so one connection's silent calls cannot keep every
  place;
- lets non-blocking handlers (health Watch) return as soon as their request is read:
  they then hold no thread, only their Watch place until they end;
- refuses a caller's calls to the service before their request is read while the
  requests it had refused for what they held (malformed, naming what is not served, over
  a bound on one request: marked on the call's record, `admission.calls`) came to more
  than its budget of bytes in the last seconds (`refused.RefusedBytes`): each was
  received and copied before it could be refused, and a caller sending large ones in a
  loop would make the server copy for nothing, with the GIL every call waits for;
- refuses a request to an open service over OPEN_REQUEST_BYTES before it is parsed
  (RESOURCE_EXHAUSTED): gRPC has copied it into Python by then, unless the open services
  have a server of their own (`--open-services-port`), whose C core refuses it first;
  and one that does not parse, INVALID_ARGUMENT (gRPC's own answer is INTERNAL).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from pergrad.server.admission import calls
from pergrad.server.admission.inflight import Admission
from pergrad.server.admission.limits import OPEN_REQUEST_BYTES, share
from pergrad.server.admission.pools import Place, Pool, Shares, wait_for_permit
from pergrad.server.admission.refused import RefusedBytes
from pergrad.server.errors import InvalidArgument, ResourceExhausted
from pergrad.server.status import (
    RefusedRequest,
    Sized,
    sized,
)
from pergrad.server.transport.auth import token_key
from pergrad.server.transport.grpc_private import is_non_blocking, non_blocking, run_on
from pergrad.server.transport.handlers import (
    as_request_stream,
    behavior_of,
    declared_kind_of,
    refusal,
    replaced,
)
from pergrad.server.transport.interceptors import ended_by_client
from pergrad.wire.rpc import OPEN_SERVICES, split_method

_LOGGER = logging.getLogger(__name__)
_NOTHING = object()
_STALLED = "{method}: cancelled, its client sent nothing for the stall timeout"
_ENDED = "{method}: cancelled while its request was awaited"


def _open_parser(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """An open service's deserializer (None: the bytes themselves): a request over
    OPEN_REQUEST_BYTES is not parsed, and one that does not parse is INVALID_ARGUMENT
    (gRPC would answer INTERNAL)."""

    def parse_checked(data: bytes) -> Any:
        if len(data) > OPEN_REQUEST_BYTES:
            return RefusedRequest(
                ResourceExhausted(
                    f"a request of {len(data)} bytes; health and reflection take "
                    f"{OPEN_REQUEST_BYTES} at most"
                )
            )
        try:
            return parse(data) if parse else data
        except DecodeError as err:
            return RefusedRequest(InvalidArgument(f"not a valid request: {err}"))

    return parse_checked


class _Waits:
    """Calls waiting on their clients, and a thread that cancels those waiting too long."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        self._timeout_s = timeout_s
        self._on_stall = on_stall
        self._waiting: dict[int, tuple[float, grpc.ServicerContext, str]] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="pergrad-stalls", daemon=True).start()

    def start(self, context: grpc.ServicerContext, method: str) -> int:
        token = next(self._tokens)
        with self._lock:
            self._waiting[token] = (time.monotonic(), context, method)
        return token

    def end(self, token: int) -> bool:
        """Stop timing; False if the call was cancelled as stalled meanwhile."""
        with self._lock:
            return self._waiting.pop(token, None) is not None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self._timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [
                    (token, context, method)
                    for token, (since, context, method) in self._waiting.items()
                    if now - since > self._timeout_s
                ]
                for token, _, _ in stalled:
                    del self._waiting[token]
            for _, context, method in stalled:
                _LOGGER.info("cancelled %s: its client stalled for %.0f s", method, self._timeout_s)
                self._on_stall(method)
                context.cancel()


class CallGuard(grpc.ServerInterceptor):
    def __init__(
        self,
        *,
        stall_timeout_s: float,
        workers: int,
        max_calls: int,
        max_streams: int,
        max_open_calls: int,
        max_open_streams: int,
        max_watch_streams: int,
        per_caller_streams: int | None = None,
        per_caller_calls: int | None = None,
        admission: Admission | None = None,
        on_stall: Callable[[str], None] = lambda method: None,
        on_refused_unread: Callable[[str], None] = lambda method: None,
    ) -> None:
        self._waits = _Waits(stall_timeout_s, on_stall)
        self._on_refused_unread = on_refused_unread
        self._admission = admission
        self._refused = RefusedBytes()
        self._calls = Pool(max_calls)
        self._permits = threading.Semaphore(workers)
        self._shares = Shares(share(workers))
        self._streams = Pool(max_streams)
        self._per_caller_streams = per_caller_streams
        self._caller_streams: dict[str, Pool] = {}
        self._per_caller_calls = per_caller_calls
        self._caller_calls: dict[str, Pool] = {}
        self._callers_lock = threading.Lock()
        self._open = Pool(max_open_calls, evict=True)
        self._open_shares = Shares(share(max_open_calls))
        self._open_streams = Pool(max_open_streams)
        self._watches = Pool(max_watch_streams, evict=True)
        self._open_pool = ThreadPoolExecutor(
            max_workers=max_open_calls, thread_name_prefix="pergrad-open"
        )
        self._watch_pool = ThreadPoolExecutor(
            max_workers=max_watch_streams, thread_name_prefix="pergrad-watch"
        )

    def close(self) -> None:
        self._waits.stop()
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
        if watch and handler.request_streaming:
            return handler  # none is served; it could not be read under the stall timer
        # The caller, where a token names it (the token check ran first); else its
        # connection, known once the handler runs.
        token = None
        if not open_service and self._per_caller_calls is not None:
            token = token_key(handler_call_details.invocation_metadata)
        kinds = [self._watches if watch else self._open if open_service else self._calls]
        kinds += self._token_places(self._caller_calls, self._per_caller_calls, token)
        if handler.request_streaming:  # a Watch is not: it returned above otherwise
            kinds.append(self._open_streams if open_service else self._streams)
            kinds += self._token_places(self._caller_streams, self._per_caller_streams, token)
        places = self._take(kinds)
        if places is None:
            return refusal(declared_kind_of(handler), _refuse(open_service))
        guarded = self._guarded(behavior, method, handler, places, watch, open_service, token)
        if open_service:
            run_on(guarded, self._watch_pool if watch else self._open_pool)
        parse = handler.request_deserializer
        if open_service:
            parse = _open_parser(parse)
        if handler.request_streaming:
            return replaced(handler, guarded, request_deserializer=sized(parse))
        return as_request_stream(handler, guarded, sized(parse))

    def _token_places(
        self, table: dict[str, Pool], limit: int | None, token: str | None
    ) -> list[Pool]:
        """The call's token's places of a kind (the token file bounds the table), when
        the server has tokens; without them, at arrival, a call has no identity to share
        by."""
        if limit is None or token is None:
            return []
        with self._callers_lock:
            if token not in table:
                table[token] = Pool(limit)
            return [table[token]]

    @staticmethod
    def _take(kinds: list[Pool]) -> list[Place] | None:
        """A place of each kind, or none at all."""
        taken: list[Place] = []
        for places in kinds:
            place = places.take()
            if place is None:
                for held in taken:
                    held.give_back()
                return None
            taken.append(place)
        return taken

    def _guarded(
        self,
        behavior: Callable[..., Any],
        method: str,
        handler: grpc.RpcMethodHandler,
        places: list[Place],
        watch: bool,
        open_service: bool,
        token: str | None,
    ) -> Callable[..., Any]:
        """The call's behaviour, holding its places until it ends (a Watch holds no
        thread once its request is read), and a call to another open service one of its
        connection's share (`_open_share`)."""
        waiting = places[0] if open_service else None
        if watch:

            def handle_watch(
                iterator: Iterator[Any], context: grpc.ServicerContext, send: Callable[..., None]
            ) -> None:
                for place in places:
                    place.hold_until_done(context)
                request = self._request(iterator, context, method, waiting)
                return behavior(request, context, send)

            non_blocking(handle_watch)
            return handle_watch

        def handle(iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            for place in places:
                place.hold_until_done(context)
            if open_service:
                self._open_share(context)
                return served(iterator, context, None)
            call = calls.started(context, context.peer() if token is None else token)
            self._within_refused_budget(call.caller, method, context)
            count = functools.partial(self._count, call)
            try:
                return served(iterator, context, call, count)
            except BaseException:
                count()
                raise

        def served(
            iterator: Iterator[Any],
            context: grpc.ServicerContext,
            call: calls.Call | None,
            on_error: Callable[[], None] = lambda: None,
        ) -> Any:
            """The call served, its record (`call`: calls to the service) kept current."""
            if handler.request_streaming:
                if call is not None:
                    wait_for_permit(self._permits, context)
                requests = self._requests(iterator, context, method, waiting, call)
                result = behavior(requests, context)
            else:
                request = self._request(iterator, context, method, waiting, call)
                if call is not None:
                    self._hold(request, call, context)
                    self._shares.take(call.caller, context)
                    wait_for_permit(self._permits, context)
                result = behavior(request, context)
            if handler.response_streaming:
                return self._responses(result, context, method, on_error)
            return result

        return handle

    def _within_refused_budget(
        self, caller: str, method: str, context: grpc.ServicerContext
    ) -> None:
        """Refuse the call before its request is read while its caller's refused bytes
        are over their budget (`refused.RefusedBytes`), counting it."""
        wait_s = self._refused.wait_s(caller)
        if wait_s > 0:
            self._on_refused_unread(method)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this caller's requests refused in the last {self._refused.window_s:g} s "
                "for what they held came to more than "
                f"{self._refused.budget >> 20} MiB: its calls are refused unread for "
                f"{wait_s:.1f} s more; fix what those refusals named",
            )

    def _count(self, call: calls.Call) -> None:
        """A call refused for its content: its request's bytes, against its caller's
        budget."""
        if call.request_bytes and call.refused_for_content:
            self._refused.add(call.caller, call.request_bytes)

    def _open_share(self, context: grpc.ServicerContext) -> None:
        """Hold one of the connection's share of the open services' places until the call
        ends, or refuse the call at once: one connection's silent calls cannot hold every
        place (calls to health and reflection need no token, so their caller is their
        connection, known once the handler runs)."""
        give_back = self._open_shares.try_take(context.peer())
        if give_back is None:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this connection holds {self._open_shares.limit} calls to health and "
                "reflection already; end one, or open another connection",
            )
        if not context.add_callback(give_back):
            give_back()

    def _hold(self, request: Any, call: calls.Call, context: grpc.ServicerContext) -> None:
        """Price the request's bytes from its arrival to the call's end
        (`Admission.hold`): calls queued for a worker hold their requests too."""
        if self._admission is None or not isinstance(request, Message):
            return  # a malformed request kept none of its bytes; its handler refuses it
        try:
            release = self._admission.hold(call.request_bytes, call.caller)
        except ResourceExhausted as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        if not context.add_callback(release):
            release()

    def _requests(
        self,
        iterator: Iterator[Any],
        context: grpc.ServicerContext,
        method: str,
        waiting: Place | None = None,
        call: calls.Call | None = None,
    ) -> Iterator[Any]:
        """The requests, each waited for under the stall timer (and, with `waiting`, an
        open service's call, as one that may be evicted meanwhile, its requests refused
        by `_open_parser` ending it). A call cancelled as stalled or evicted ends
        CANCELLED, whichever way gRPC ends its request stream (it may end it normally,
        which the handler would take for the client's end). Sized requests are handed on
        bare, the latest one's bytes kept on the call's record (a stream's refusal is its
        latest request's)."""
        while True:
            token = self._waits.start(context, method)
            if waiting is not None:
                waiting.waiting(context)
            try:
                item = next(iterator, _NOTHING)
            finally:
                if waiting is not None:
                    waiting.waiting(None)
                if not self._waits.end(token):
                    context.abort(grpc.StatusCode.CANCELLED, _STALLED.format(method=method))
                if not context.is_active():  # evicted, or ended by its client
                    context.abort(grpc.StatusCode.CANCELLED, _ENDED.format(method=method))
            if item is _NOTHING:
                return
            if isinstance(item, Sized):
                item, nbytes = item
                if call is not None:
                    call.request_bytes = nbytes
            if waiting is not None and isinstance(item, RefusedRequest):
                error = item.error
                context.abort(grpc.StatusCode[error.code], f"{method}: {error}")
            yield item

    def _responses(
        self,
        iterator: Iterator[Any],
        context: grpc.ServicerContext,
        method: str,
        on_error: Callable[[], None],
    ) -> Iterator[Any]:
        try:
            for item in iterator:
                token = self._waits.start(context, method)  # until gRPC has sent it and asks
                try:
                    yield item
                finally:
                    self._waits.end(token)
        except BaseException:
            on_error()
            raise

    def _request(
        self,
        iterator: Iterator[Any],
        context: grpc.ServicerContext,
        method: str,
        waiting: Place | None = None,
        call: calls.Call | None = None,
    ) -> Any:
        """The one request of a call to a method that takes one (then the client's end),
        its size on the wire kept on `call`."""
        requests = self._requests(iterator, context, method, waiting, call)
        try:
            request = next(requests, _NOTHING)
            more = request is not _NOTHING and next(requests, _NOTHING) is not _NOTHING
        except grpc.RpcError:
            # Stalled and cancelled, or ended by its client: counted as such, not UNKNOWN.
            code = ended_by_client(context)
            context.abort(code, "the call ended while its request was awaited")
        if request is _NOTHING or more:
            many = "none" if request is _NOTHING else "more than one"
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request, got {many}"
            )
        return request


def _refuse(open_service: bool) -> Callable[..., Any]:
    what = "calls to health and reflection" if open_service else "such calls"

    def refuse(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this server has as many {what} as it admits at once; "
            "retry later or on another replica",
        )

    return refuse

"""One record per call, made as the guard starts serving it: whom it is counted for (one
key, worked out once), its request's bytes as they were read, and whether it was refused
for what its request held. The guard makes and updates it; the servicer reads the caller
and the bytes from it, and `status` marks a refusal for content on it, which the guard
then counts against the caller's refused-bytes budget (`refused`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import grpc


@dataclass
class Call:
    caller: str  # its token's digest where the server has tokens, else its connection
    request_bytes: int = 0  # the latest request's size on the wire; 0: none read yet
    refused_for_content: bool = False  # malformed, naming what is not served, too large


_RECORDS: weakref.WeakKeyDictionary[grpc.ServicerContext, Call] = weakref.WeakKeyDictionary()
# A call no guard admitted (a servicer driven in-process by a test): no caller known.
_UNKNOWN = ""


def started(context: grpc.ServicerContext, caller: str) -> Call:
    """The record of a call the guard starts serving, kept for as long as its context."""
    call = _RECORDS[context] = Call(caller)
    return call


def of(context: grpc.ServicerContext) -> Call:
    """The call's record (a blank one for a call no guard started)."""
    call = _RECORDS.get(context)
    return call if call is not None else Call(_UNKNOWN)

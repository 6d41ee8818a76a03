"""Admission: the examples and bytes calls hold at once, and each caller's share."""

from __future__ import annotations

import pytest

from pergrad.server.admission.inflight import Admission
from pergrad.server.errors import RequestTooLarge, ResourceExhausted

BYTES = 1000


@pytest.fixture()
def admission() -> Admission:
    return Admission(max_examples=100, max_bytes=BYTES)


def test_one_call_may_take_the_whole_budget(admission) -> None:
    with admission.admit(10, BYTES, "one"), pytest.raises(ResourceExhausted, match="busy"):
        admission.hold(1, "other")


def test_a_caller_holding_bytes_holds_at_most_half_and_others_still_get_in(admission) -> None:
    release = admission.hold(BYTES // 2, "greedy")
    with pytest.raises(ResourceExhausted, match="half of --max-inflight-bytes"):
        admission.hold(1, "greedy")
    with admission.admit(1, BYTES // 2, "honest"):
        pass
    release()
    admission.hold(BYTES // 2, "greedy")


def test_a_calls_own_request_bytes_do_not_count_as_another_call(admission) -> None:
    admission.hold(300, "one")
    with admission.admit(1, 600, "one", request_bytes=300):
        pass
    with pytest.raises(ResourceExhausted, match="half"), admission.admit(1, 600, "one"):
        pass


def test_bytes_come_back_when_calls_end(admission) -> None:
    for _ in range(3):
        with admission.admit(100, BYTES, "one"):
            pass
        admission.hold(BYTES, "one")()
    with admission.admit(100, BYTES, "other"):
        pass


def test_a_call_over_a_bound_alone_says_it_could_never_run(admission) -> None:
    with pytest.raises(ResourceExhausted, match="send smaller batches"):
        admission.hold(BYTES + 1, "one")


def test_a_call_whose_request_and_result_exceed_the_budget_could_never_run(admission) -> None:
    release = admission.hold(600, "one")
    refused = pytest.raises(ResourceExhausted, match="send smaller batches")
    with refused, admission.admit(1, 500, "one", request_bytes=600):
        pass
    release()


def test_calls_holding_no_bytes_come_and_go(admission) -> None:
    releases = [admission.hold(0, "one") for _ in range(3)]
    for release in releases:
        release()
    with admission.admit(1, BYTES, "one"):
        pass


def test_a_call_that_could_never_run_says_so_while_the_server_is_busy(admission) -> None:
    """Too large for one bound while another is full: refused for what it holds (send
    smaller batches, charged as such), not told to retry a busy server."""
    refused = pytest.raises(RequestTooLarge, match="smaller")
    with admission.admit(100, 0, "one"), refused, admission.admit(1, BYTES + 1, "other"):
        pass


def test_a_caller_over_its_share_is_told_so_while_the_examples_are_full(admission) -> None:
    release = admission.hold(BYTES // 2, "greedy")
    refused = pytest.raises(ResourceExhausted, match="half")
    with admission.admit(100, 0, "other"), refused, admission.admit(1, 1, "greedy"):
        pass
    release()

"""Which small requests share passes (`sharing`): a pass's examples, and what a replica
reports of it."""

from __future__ import annotations

import pytest

from pergrad.server.engine import Engine
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.server.sharing import granule_for, served_plan


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODELS["mnist_mlp"](), loss=LOSS, jit_compile=False)


def test_a_pass_is_the_largest_power_of_two_within_the_flag_and_the_slice(engine) -> None:
    assert granule_for(engine, 100) == 64
    assert granule_for(engine, 1) == 1
    assert granule_for(engine, 1 << 30) == 1 << (engine.slice_size.bit_length() - 1)


def test_replicas_that_share_passes_differently_report_different_plans(engine) -> None:
    """Whether small requests share passes decides their bits, so it is in the plan and
    its fingerprint: a replica sharing them and one not are told apart."""
    (shared, shared_id), (alone, alone_id) = served_plan(engine, 64), served_plan(engine, 0)
    assert "requests of fewer than 64 examples share passes" in shared
    assert alone.endswith("no shared passes") and shared_id != alone_id

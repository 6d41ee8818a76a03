"""Work split over cores: parts cover the range once, in order, aligned."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.server.engine.cores import on_cores, parts


@pytest.mark.parametrize(
    ("count", "pieces", "align"), [(10, 2, 1), (11, 2, 2), (7, 4, 2), (1, 4, 1)]
)
def test_parts_cover_the_range_once_in_order_at_aligned_starts(count, pieces, align) -> None:
    got = parts(count, pieces, align)
    assert [i for part in got for i in range(count)[part]] == list(range(count))
    assert len(got) <= pieces and all(part.start % align == 0 for part in got)


@pytest.mark.parametrize("serial", [True, False])
def test_every_part_is_filled_whether_serial_or_not(serial: bool) -> None:
    out = np.zeros(1001)

    def fill(part: slice) -> None:
        out[part] = np.arange(part.start, part.stop)

    on_cores(len(out), fill, serial=serial)
    np.testing.assert_array_equal(out, np.arange(1001))

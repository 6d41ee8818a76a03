"""The counter-based random numbers: the wire contract's text, made a block at a time."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.server.engine.reductions import box_muller, random_streams
from pergrad.server.engine.reductions.project import MatrixCache
from tests import spec_random
from tests.conftest import ROOT


def _comment_lines(path) -> list[str]:
    """The proto's comment lines, their `// ` taken off."""
    lines = path.read_text().splitlines()
    return [line.strip()[3:] for line in lines if line.strip().startswith("// ")]


def test_the_text_the_spec_implements_is_the_protos_word_for_word() -> None:
    text = spec_random.TEXT.splitlines()
    proto = _comment_lines(ROOT / "protos" / "pergrad" / "v1" / "gradient_service.proto")
    starts = [i for i in range(len(proto)) if proto[i : i + len(text)] == text]
    assert len(starts) == 1, "tests/spec_random.py's TEXT is not the proto's section"


def _spec(kind: str, key: int, start: int, count: int) -> np.ndarray:
    """Entries [start, start + count) of the stream `key` by the contract's own text."""
    entry = getattr(spec_random, kind)
    return np.array([entry(key, n) for n in range(start, start + count)], np.float32)


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("seed", [0, 7, 2**63 + 11, 2**64 - 1])
def test_entries_are_the_wire_contracts_bit_for_bit(kind: str, seed: int) -> None:
    key = random_streams.stream_key(seed, 3, 1)
    assert key == spec_random.key(seed, 3, 1)
    made = random_streams.KINDS[kind](key, 0, 3000)
    spec = _spec(kind, key, 0, 3000)
    assert made.dtype == np.float32
    assert made.tobytes() == spec.tobytes()


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize(("start", "count"), [(0, 1), (1, 1), (63, 130), (65, 7), (1000, 999)])
def test_any_block_equals_the_same_slice_of_the_whole(kind: str, start: int, count: int) -> None:
    entries = random_streams.KINDS[kind]
    whole = entries(12345, 0, 2100)
    assert entries(12345, start, count).tobytes() == whole[start : start + count].tobytes()


@pytest.mark.parametrize("start", [0, 1])
def test_a_range_longer_than_a_block_equals_its_blocks_made_alone(start: int) -> None:
    count = 2 * box_muller.BLOCK_WORDS + 2 * box_muller.SMALLEST_WORDS + 3
    whole = random_streams.gaussian(777, start, count)
    step = 2 * box_muller.BLOCK_WORDS // 3  # each block's words start mid-block
    blocks = [
        random_streams.gaussian(777, start + s, min(step, count - s)) for s in range(0, count, step)
    ]
    assert whole.tobytes() == np.concatenate(blocks).tobytes()


def test_streams_over_many_blocks_on_every_core_are_the_wire_contracts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks of a counted stream, and of short streams made together, each made on a
    core of its own: every entry where the contract puts it, a partial last block too."""
    monkeypatch.setattr(box_muller, "BLOCK_WORDS", box_muller.SMALLEST_WORDS)
    counted = random_streams.gaussian(21, 1, 2 * 7 * box_muller.SMALLEST_WORDS + 3)
    assert counted.tobytes() == _spec("gaussian", 21, 1, len(counted)).tobytes()
    keys, counts = [5, 6, 7, 8, 9], [5001, 3, 10247, 0, 1]
    together = random_streams.gaussians(keys, counts)
    spec = [_spec("gaussian", k, 0, c) for k, c in zip(keys, counts, strict=True)]
    assert [a.tobytes() for a in together] == [a.tobytes() for a in spec]


def test_an_angle_near_a_zero_of_cos_is_rounded_as_the_contract_says() -> None:
    """Entry 6,506,615 of this stream is r cos t with t within 1e-10 of pi / 2: computed
    from u2 * 2 pi unrounded (XLA fuses a product into the sum after it), it is 3
    float32 ulps from the contract's."""
    key, n = spec_random.key(7, 0, 2), 6_506_615
    made = random_streams.gaussian(key, n, 1)
    assert made.tobytes() == np.float32(spec_random.gaussian(key, n)).tobytes()


def test_matrix_rows_are_rows_of_the_whole_matrix() -> None:
    whole = random_streams.matrix_rows(5, 1, 0, rows=range(10), columns=33, kind="gaussian")
    part = random_streams.matrix_rows(5, 1, 0, rows=range(3, 7), columns=33, kind="gaussian")
    assert part.tobytes() == whole[3:7].tobytes()


def test_gaussian_entries_are_standard_normal() -> None:
    entries = random_streams.gaussian(random_streams.stream_key(0, 0, 0), 0, 1 << 20)
    # 2^20 draws: mean within 0.005, std within 0.5%, fourth moment near 3.
    assert abs(entries.mean()) < 0.005 and abs(entries.std() - 1) < 0.005
    assert abs(np.mean(entries.astype(np.float64) ** 4) - 3) < 0.05


@pytest.mark.parametrize(
    "counts",
    [[7, 0, 1, random_streams.ALONE_ENTRIES + 3, 128, 5], [3], []],
    ids=["a model's variables", "one", "none"],
)
def test_many_streams_made_together_are_each_stream_made_alone(counts: list[int]) -> None:
    keys = [random_streams.stream_key(42, index, 2) for index in range(len(counts))]
    together = random_streams.gaussians(keys, counts)
    alone = [
        random_streams.gaussian(key, 0, count) for key, count in zip(keys, counts, strict=True)
    ]
    assert [a.tobytes() for a in together] == [a.tobytes() for a in alone]


def test_streams_made_by_small_blocks_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    keys, counts = [3, 4, 5], [11, random_streams.ALONE_ENTRIES + 1, 6]
    whole = random_streams.gaussians(keys, counts)
    one = random_streams.gaussian(7, 13, 3 * box_muller.SMALLEST_WORDS + 9)
    monkeypatch.setattr(box_muller, "BLOCK_WORDS", box_muller.SMALLEST_WORDS)
    assert [a.tobytes() for a in random_streams.gaussians(keys, counts)] == [
        a.tobytes() for a in whole
    ]
    assert random_streams.gaussian(7, 13, len(one)).tobytes() == one.tobytes()
    assert [len(a) for a in random_streams.secure_gaussians(counts)] == counts


def test_secure_bits_are_fresh_and_fill_every_word() -> None:
    first, second = random_streams.secure_bits(1 << 12), random_streams.secure_bits(1 << 12)
    assert first.dtype == np.uint64 and len(first) == 1 << 12
    assert not np.array_equal(first, second)
    # Each bit set in about half the words: 4096 words, 6 sigma is 192 away from 2048.
    ones = np.unpackbits(first.view(np.uint8)).reshape(-1, 64).sum(axis=0, dtype=np.int64)
    assert np.all(np.abs(ones - 2048) < 192)


def test_secure_gaussians_are_standard_normal_and_fresh() -> None:
    first, second, third = random_streams.secure_gaussians([1 << 20, 4, 3])
    assert abs(first.mean()) < 0.005 and abs(first.std() - 1) < 0.005
    assert (second.shape, third.shape) == ((4,), (3,))
    assert not np.array_equal(first[:4], second)
    assert not np.array_equal(second, random_streams.secure_gaussians([4])[0])


def test_fresh_noise_made_on_every_core_repeats_no_block(monkeypatch) -> None:
    """Blocks made on several cores at once each draw their own words: a scratch buffer
    shared between cores, or a key reused, would repeat or mix a block."""
    monkeypatch.setattr(box_muller, "BLOCK_WORDS", box_muller.SMALLEST_WORDS)
    (noise,) = random_streams.secure_gaussians([16 * 2 * box_muller.SMALLEST_WORDS])
    blocks = noise.reshape(16, -1)
    assert len({block.tobytes() for block in blocks}) == 16
    assert np.all(np.abs(blocks.mean(axis=1)) < 0.15)
    assert np.all(np.abs(blocks.std(axis=1) - 1) < 0.1)


def test_fresh_noise_reaches_the_tails_of_53_bit_uniforms() -> None:
    """The smallest pair of words gives u1 = 2^-53 and t = 0, the largest u1 = 1: entries
    (sqrt(-2 ln 2^-53), 0) and (0, 0), past the contract's 32-bit bound of 6.8."""
    extremes = np.array([[0, 0], [2**64 - 1, 0]], np.uint64)
    entries = box_muller.secure(extremes)
    assert entries[0] == np.float32(np.sqrt(-2 * np.log(2.0**-53))) and entries[0] > 8.5
    assert entries[1:].tolist() == [0.0, 0.0, 0.0]


def test_cache_stays_within_its_bytes_whatever_the_seeds() -> None:
    cache = MatrixCache(max_bytes=1 << 20)
    for seed in range(50):
        assert cache.get((seed, 0, 0, "rademacher", 64, 1000)) is not None  # 256 KB each
        assert cache.nbytes <= cache.max_bytes
    assert cache.get((0, 0, 0, "rademacher", 1024, 1000)) is None  # 4 MB: made per use


def test_cache_returns_a_repeated_key_without_making_it_again() -> None:
    cache = MatrixCache(max_bytes=1 << 20)
    first = cache.get((1, 2, 0, "gaussian", 16, 100))
    assert cache.get((1, 2, 0, "gaussian", 16, 100)) is first

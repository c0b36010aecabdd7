"""``direct_io.read_ranges``: every destination segment gets exactly its file bytes,
through the page cache (one ``preadv`` per many small segments, straight into them)
and with O_DIRECT (bounce buffers), and a file too short for a segment is an error."""

from __future__ import annotations

import random

import pytest
import torch

from shardpoint.errors import CorruptCheckpointError
from shardpoint.storage import direct_io
from shardpoint.storage.io_types import Segment


def _file(tmp_path, size: int):
    data = random.Random(size).randbytes(size)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _segments(spans: list[tuple[int, int]]) -> list[Segment]:
    return [Segment(a, torch.zeros(b - a, dtype=torch.uint8)) for a, b in spans]


@pytest.mark.parametrize("direct", [False, True])
def test_many_small_segments_with_gaps_get_their_bytes_in_few_calls(tmp_path, monkeypatch, direct):
    path, data = _file(tmp_path, 3_000_000)
    rng = random.Random(7)
    spans, at = [], 0
    # More segments in one coalesced span than one preadv takes (IOV_MAX), with gaps of
    # 0 to 300 bytes between them.
    while at < 2_900_000 and len(spans) < 3 * direct_io._IOV_MAX:
        at += rng.choice([0, 0, 1, 300])
        n = rng.randint(1, 900)
        spans.append((at, at + n))
        at += n
    segments = _segments(spans)
    seen: list[int] = []
    calls = []
    real = direct_io.os.preadv
    monkeypatch.setattr(direct_io.os, "preadv", lambda *a: calls.append(1) or real(*a))
    direct_io.read_ranges(
        {path: segments}, threads=2, direct=direct, on_segment=lambda s: seen.append(id(s))
    )
    for s in segments:
        assert s.array.tobytes() == data[s.offset : s.end]
    assert sorted(seen) == sorted(map(id, segments))  # each reported once, when complete
    # A handful of calls for thousands of segments (not one per segment, as a fallback
    # that reads them one by one would make)
    assert len(calls) <= 20, len(calls)


@pytest.mark.parametrize("direct", [False, True])
def test_segments_that_overlap_each_get_their_bytes(tmp_path, monkeypatch, direct):
    """Two regions of one stored range (and one shifted by a byte) among others: the
    span is read once, and each segment that overlaps another by a call of its own."""
    path, data = _file(tmp_path, 100_000)
    segments = _segments([(0, 50), (10, 60), (10, 60), (100, 900), (890, 1000)])
    calls = []
    real = direct_io.os.preadv
    monkeypatch.setattr(direct_io.os, "preadv", lambda *a: calls.append(1) or real(*a))
    direct_io.read_ranges({path: segments}, threads=1, direct=direct, on_segment=None)
    for s in segments:
        assert s.array.tobytes() == data[s.offset : s.end]
    assert len(calls) <= 4 + 3, len(calls)  # the page-cache probes, the span, 3 overlaps


SIZES = [1, 50, 4095, 4096, 4097, 70_000, 1 << 20, (1 << 20) + 1, 17 << 20, (20 << 20) + 3]


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, "cached", "uncached"])
@pytest.mark.parametrize("seed", range(12))
def test_any_overlapping_segments_each_get_their_bytes_and_one_report(
    tmp_path, monkeypatch, direct, seed
):
    """Segments that start together, nest, or reach past later ones (small and large,
    any alignment): every one gets its bytes and is reported once, when complete —
    ``on_segment`` is where a load verifies checksums, so a segment left out is read
    unverified (an earlier version skipped any but the last one starting at or before
    a span's start)."""
    path, data = _file(tmp_path, 24 << 20)
    if direct == "uncached":  # large segments then go through O_DIRECT bounce reads
        monkeypatch.setattr(direct_io, "_in_page_cache", lambda path, segments: False)
    rng = random.Random(seed)
    spans = []
    for _ in range(rng.randint(2, 6)):
        n = rng.choice(SIZES)
        a = rng.choice([0, 1, 4096, rng.randrange(0, len(data) - n)])
        spans.append((a, a + n))
        if rng.random() < 0.5:  # the same start, shorter or longer
            spans.append((a, a + rng.choice([m for m in SIZES if a + m <= len(data)])))
    segments = _segments(spans)
    reported: list[int] = []
    delivered: dict[int, int] = {}  # bytes each segment was told it got: exactly its size
    real_add = direct_io._Completion.add

    def counted(self, s: Segment, n: int) -> None:  # noqa: ANN001
        delivered[id(s)] = delivered.get(id(s), 0) + n
        real_add(self, s, n)

    monkeypatch.setattr(direct_io._Completion, "add", counted)

    def check(s: Segment) -> None:
        assert s.array.tobytes() == data[s.offset : s.end]  # complete when reported
        reported.append(id(s))

    direct_io.read_ranges({path: segments}, threads=2, direct=bool(direct), on_segment=check)
    for s in segments:
        assert s.array.tobytes() == data[s.offset : s.end], (s.offset, s.end)
    assert sorted(reported) == sorted(map(id, segments)), spans
    assert all(delivered.get(id(s), 0) == s.end - s.offset for s in segments if s.end > s.offset)


@pytest.mark.parametrize("direct", [False, True])
def test_a_segment_past_the_end_of_the_file_is_a_truncated_file(tmp_path, direct):
    path, _ = _file(tmp_path, 10_000)
    segments = _segments([(0, 100), (200, 300), (9_950, 10_050)])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        direct_io.read_ranges({path: segments}, threads=1, direct=direct, on_segment=None)


def test_a_bounce_read_never_fills_what_another_segments_zero_copy_read_fills(
    tmp_path, monkeypatch
):
    """A (page-congruent: read straight into its memory) and B inside it (not congruent:
    read through a bounce buffer): the bounce span crosses A's zero-copy interior, and
    A's bytes there were delivered twice, so A could be reported complete (and its
    checksum taken) before its own read had landed."""
    path, data = _file(tmp_path, 12 << 20)
    monkeypatch.setattr(direct_io, "_in_page_cache", lambda path, segments: False)

    def at_page_offset(n: int, k: int) -> torch.Tensor:  # memory at k bytes past a page
        buf = torch.zeros(n + 8192, dtype=torch.uint8)
        start = (-buf.data_ptr()) % 4096 + k
        return buf[start : start + n]

    a = Segment(0, at_page_offset(8 << 20, 0))
    b = Segment(40965, at_page_offset((6 << 20) - 40965, 0))
    assert a.data.data_ptr() % 4096 == 0 and (b.data.data_ptr() - b.offset) % 4096
    delivered: dict[int, int] = {}
    real_add = direct_io._Completion.add

    def counted(self, s: Segment, n: int) -> None:  # noqa: ANN001
        delivered[id(s)] = delivered.get(id(s), 0) + n
        real_add(self, s, n)

    monkeypatch.setattr(direct_io._Completion, "add", counted)
    direct_io.read_ranges({path: [a, b]}, threads=2, direct=True, on_segment=lambda s: None)
    assert a.array.tobytes() == data[: 8 << 20] and b.array.tobytes() == data[b.offset : b.end]
    assert delivered == {id(a): a.end - a.offset, id(b): b.end - b.offset}

"""runtime/policies/pieces.py on its own: which bytes of an expert go to the device first
(``piece_ranges``, ``early_ranges``) and when each demand read piece may go (``PieceWindow``)."""

from __future__ import annotations

import itertools

import pytest

from runtime.policies.pieces import PieceWindow, early_ranges, piece_ranges

A = 4096


def _covers(ranges: list[tuple[int, int]], head: int, need: int) -> None:
    """Every byte of [head, need) in exactly one range; inner cuts aligned."""
    assert sorted(ranges)[0][0] == head and max(b for _, b in ranges) == need
    spans = sorted(ranges)
    for (_, b), (a, _) in itertools.pairwise(spans):
        assert a == b and a % A == 0
    assert all(a < b for a, b in ranges)


@pytest.mark.parametrize("head", [0, 1000])
def test_gate_and_up_go_first_in_aligned_pieces(head: int) -> None:
    # the public layout: down, gate, up (sorted names), 6 MiB each
    mib = 1 << 20
    first = [(6 * mib, 12 * mib), (12 * mib, 18 * mib)]
    need = head + 18 * mib
    got = piece_ranges(head, need, first, piece=4 * mib)
    _covers(got, head, need)
    assert all(b - a <= 4 * mib for a, b in got)
    lo = (head + 6 * mib) // A * A
    n_first = sum(1 for a, _ in got if a >= lo)
    assert all(a >= lo for a, _ in got[:n_first])  # gate/up bytes before any down-only byte
    assert got[:n_first] == sorted(got[:n_first]) and got[0][0] == lo
    assert got[-1][1] == lo  # down last, up to where gate begins


def test_first_ranges_anywhere_and_small_blobs() -> None:
    # gate/up at the start and down at the end; gate and up apart (down between them)
    for first in ([(0, 9000), (9000, 20000)], [(0, 5000), (15000, 20000)], [(7000, 8000)]):
        got = piece_ranges(0, 30000, first, piece=2 * A)
        _covers(got, 0, 30000)
        lo = min(a for a, _ in first) // A * A
        hi = -(-max(b for _, b in first) // A) * A
        assert got[0][0] == lo and any(b == min(hi, 30000) for _, b in got)
    assert piece_ranges(100, 100 + 3 * A, [(A, 2 * A)], piece=4 * A) == [(100, 100 + 3 * A)]
    assert piece_ranges(0, 10 * A, [], piece=4 * A) == [(0, 4 * A), (4 * A, 8 * A), (8 * A, 10 * A)]
    with pytest.raises(ValueError):
        piece_ranges(0, 10 * A, piece=A + 1)
    with pytest.raises(ValueError):
        piece_ranges(5, 5)


class _Log:
    def __init__(self) -> None:
        self.granted: list[str] = []

    def cb(self, name: str):  # type: ignore[no-untyped-def]
        return lambda: self.granted.append(name)


@pytest.mark.parametrize("head", [0, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_early_stages_gate_and_up_then_the_rest(head: int, parts: int) -> None:
    mib = 1 << 20
    first = [(6 * mib, 12 * mib), (12 * mib, 18 * mib)]  # down, gate, up
    need = head + 18 * mib + 100
    one, two = early_ranges(head, need, first, parts=parts)
    _covers(one + two, head, need)
    lo = (head + 6 * mib) // A * A
    hi = min(need, -(-(head + 18 * mib) // A) * A)
    assert one[0][0] == lo and one[-1][1] == hi  # exactly the gate and up blocks first
    assert one == sorted(one) and two == sorted(two)
    # down in ``parts``, and the blob's tail past up's last block in one more
    assert len(one) == parts and len(two) == parts + (hi < need)
    sizes = [b - a for a, b in one]
    assert max(sizes) - min(sizes) <= parts * A  # near-equal parts


def test_early_stages_degenerate_plans() -> None:
    # gate and up are the whole blob: one stage
    one, two = early_ranges(0, 8 * A, [(0, 4 * A), (4 * A, 8 * A)])
    assert one == [(0, 4 * A), (4 * A, 8 * A)] and two == []
    # nothing to put first, or too small a blob: read it whole
    assert early_ranges(0, 8 * A, []) == ([], [])
    assert early_ranges(0, 2 * A, [(0, A)]) == ([], [])
    # parts larger than the blocks: never an empty range
    one, two = early_ranges(0, 3 * A, [(A, 2 * A)], parts=8)
    assert one == [(A, 2 * A)] and two == [(0, A), (2 * A, 3 * A)]
    with pytest.raises(ValueError, match="early plan"):
        early_ranges(5, 5, [(0, 1)])
    with pytest.raises(ValueError, match="early plan"):
        early_ranges(0, 10 * A, [(0, A)], parts=0)


def test_pieces_go_in_order_within_the_window() -> None:
    log = _Log()
    w = PieceWindow(10)
    t = [w.add(4, log.cb(n), opens=n.endswith("0")) for n in ("a0", "a1", "a2", "b0", "b1")]
    assert log.granted == ["a0", "a1"]  # 8 bytes; a2 would make 12
    assert w.inflight_bytes == 8 and w.queued == 3
    w.finish(t[0])
    assert log.granted == ["a0", "a1", "a2"]
    w.finish(t[1])
    assert log.granted[-1] == "b0"  # b's first piece joins a's last: the backlog says go
    w.finish(t[2])
    w.finish(t[3])
    assert log.granted[-1] == "b1" and w.granted == 1
    with pytest.raises(ValueError):
        w.finish(t[0])
    w.finish(t[4])
    assert w.inflight_bytes == 0 and w.granted == 0


def test_a_piece_bigger_than_the_window_goes_alone() -> None:
    log = _Log()
    w = PieceWindow(5)
    big = w.add(8, log.cb("big"))
    small = w.add(1, log.cb("small"))
    assert log.granted == ["big"]
    w.finish(big)
    assert log.granted == ["big", "small"]
    w.finish(small)


def test_the_last_read_of_a_burst_waits_for_the_ones_before_it() -> None:
    log = _Log()
    behind = [False]
    w = PieceWindow(100, backlog=lambda: behind[0])
    a = [w.add(4, log.cb(f"a{i}"), opens=i == 0) for i in range(2)]
    b = [w.add(4, log.cb(f"b{i}"), opens=i == 0) for i in range(2)]
    assert log.granted == ["a0", "a1"]  # b would land with a: it waits
    behind[0] = True  # another read queues behind b: b may share the device now
    w.pump()
    assert log.granted == ["a0", "a1", "b0", "b1"]
    for x in a + b:
        w.finish(x)
    c = w.add(4, log.cb("c0"))
    behind[0] = False
    d = w.add(4, log.cb("d0"))
    assert log.granted[-1] == "c0"
    w.finish(c)  # nothing else on the device: d goes
    assert log.granted[-1] == "d0"
    w.finish(d)


def test_dropped_pieces_never_go_and_give_their_room_back() -> None:
    log = _Log()
    w = PieceWindow(8)
    a = w.add(8, log.cb("a"))
    b = w.add(4, log.cb("b"))
    c = w.add(4, log.cb("c"), opens=False)
    w.drop(b)  # queued: never granted
    w.drop(a)  # granted: as finish
    assert log.granted == ["a", "c"] and b.state == "dropped"
    w.drop(c)
    assert w.inflight_bytes == 0 and w.granted == 0 and w.queued == 0
    with pytest.raises(ValueError):
        PieceWindow(0)

"""Expert-sized buffers on transparent huge pages: the kernel's setting read and explained, the
2 MiB-aligned advised mapping, the fallback when the advice is refused, the measured bytes
the kernel backs with huge pages (``/proc/self/smaps``), and the arena resident weights load
into."""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

import numpy as np
import pytest

from storage import aligned
from storage.aligned import (
    HUGE_PAGE,
    HugeArena,
    aligned_empty,
    huge_backed_bytes,
    hugepage_support,
)
from storage.arch import ArchConfig


@pytest.mark.parametrize(
    ("text", "mode", "advise"),
    [
        ("always [madvise] never\n", "madvise", True),
        ("[always] madvise never\n", "always", True),
        ("always madvise [never]\n", "never", False),
    ],
)
def test_the_kernel_setting_is_read_and_explained(
    tmp_path: Path, text: str, mode: str, advise: bool
) -> None:
    f = tmp_path / "enabled"
    f.write_text(text)
    s = hugepage_support(f)
    assert (s.mode, s.advise) == (mode, advise)
    assert (s.reason == "") == advise and ("never" in s.reason or advise)
    missing = hugepage_support(tmp_path / "nope")
    assert missing.mode == "unavailable" and not missing.advise and "not readable" in missing.reason


def test_large_buffers_are_huge_page_aligned_and_backed() -> None:
    support = hugepage_support()
    if not support.advise:
        pytest.skip(f"no transparent huge pages here: {support.reason}")
    bufs = [aligned_empty(19 << 20, huge=True) for _ in range(3)]
    for b in bufs:
        assert b.nbytes == 19 << 20 and b.ctypes.data % HUGE_PAGE == 0
        b[:] = 7  # first touch: the kernel backs the advised range now
    got = huge_backed_bytes(bufs)
    assert got is not None
    # each 19 MiB buffer holds 9 whole 2 MiB pages (khugepaged aside, faults fill them)
    assert got >= 3 * 9 * HUGE_PAGE * 0.5, got
    small = aligned_empty(64 << 10, huge=True)  # under 2 MiB: an ordinary buffer
    assert small.nbytes == 64 << 10 and small.ctypes.data % 4096 == 0
    assert huge_backed_bytes([]) == 0


def test_refused_advice_falls_back_to_an_ordinary_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(mmap.mmap):
        def madvise(self, *args: object) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(aligned.mmap, "mmap", Refusing)
    buf = aligned_empty(4 << 20, huge=True)
    assert buf.nbytes == 4 << 20 and buf.ctypes.data % 4096 == 0
    owner: object = buf
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    assert not isinstance(owner, mmap.mmap)  # numpy's own allocation, not the refused mapping
    buf[:] = 1
    assert int(buf.sum()) == 4 << 20


def test_streaming_stats_report_huge_pages() -> None:
    import colibri

    with colibri.open_model(None, ram_budget="16MiB", learn=False) as m:
        m.generate([5, 6, 7], max_new_tokens=2)
        hp = m.stats()["experts"]["hugepages"]
    assert hp["mode"] == hugepage_support().mode
    assert hp["slot_blob_bytes"] > 0 and hp["huge_backed_bytes"] is not None
    assert hp["reason"]  # the demo's experts are far under 2 MiB: it says so


def test_the_weight_arena_packs_aligned_pieces_on_huge_pages() -> None:
    support = hugepage_support()
    if not support.advise:
        pytest.skip(f"no transparent huge pages here: {support.reason}")
    arena = HugeArena(chunk=4 * HUGE_PAGE)
    # the 3 MiB piece (over a quarter chunk) gets its own mapping; the fourth 2 MiB one opens
    # a second chunk
    sizes = [100, 3000, 1 << 20, 5, 3 << 20, 2 << 20, 2 << 20, 2 << 20, 2 << 20]
    pieces = [arena.empty(n) for n in sizes]
    spans = []
    for n, p in zip(sizes, pieces, strict=True):
        assert p.dtype == np.uint8 and p.nbytes == n and p.ctypes.data % 64 == 0
        p[:] = n % 251
        spans.append((p.ctypes.data, p.ctypes.data + n))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    for n, p in zip(sizes, pieces, strict=True):  # no piece overwrote another
        assert int(p.min()) == int(p.max()) == n % 251
    assert arena.huge and arena.used_bytes == sum(sizes)
    # two chunks and the 3 MiB piece's own 4 MiB
    assert arena.mapped_bytes == 2 * 4 * HUGE_PAGE + 2 * HUGE_PAGE
    got = huge_backed_bytes(pieces)
    assert got is not None and got >= HUGE_PAGE, got  # at least the big piece's first page


def test_the_weight_arena_without_huge_pages_hands_out_ordinary_arrays() -> None:
    off = HugeArena(support=aligned.HugePageSupport("never", False, "off"))
    p = off.empty(3 << 20)
    assert not off.huge and off.mapped_bytes == 0 and p.nbytes == 3 << 20
    assert p.ctypes.data % 64 == 0 and off.empty(0).nbytes == 0
    with pytest.raises(ValueError, match="multiple"):
        HugeArena(chunk=HUGE_PAGE + 4096)
    with pytest.raises(ValueError, match=">= 0"):
        off.empty(-1)


def test_resident_matrices_load_into_the_containers_arena() -> None:
    from colibri._config import default_model_path
    from runtime.models import load_model
    from storage.container import Container

    c = Container.open(default_model_path())
    name = next(n for n in c.names() if n.endswith("down_proj.weight") and ".experts." not in n)
    q = c.load_qtensor(name)
    fresh = Container.open(default_model_path())
    plain = fresh.load_qtensor(name)  # the same bytes, whatever the pages
    assert np.array_equal(q.data, plain.data) and np.array_equal(q.scales, plain.scales)
    assert q.data.ctypes.data % 64 == 0
    owner: object = q.data
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    assert isinstance(owner, mmap.mmap) == hugepage_support().advise  # an arena chunk
    model = load_model(c)
    assert model is not None


def test_resident_experts_load_into_an_arena() -> None:
    """Every routed expert's blob is a piece of the ``ResidentExperts`` arena (huge pages where
    the kernel allows them), with the file's bytes."""
    from colibri._config import default_model_path
    from runtime.weights import ResidentExperts
    from storage.container import Container

    c = Container.open(default_model_path())
    layer = c.expert_layers()[0]
    res = ResidentExperts(c, layers=[layer])
    n = ArchConfig.from_dict(c.config).n_routed_experts
    blob_bytes = sum(c.expert(layer, e).nbytes for e in range(n))
    assert res.arena.used_bytes == (blob_bytes if res.arena.huge else 0)
    for e in (0, n - 1):
        ext = c.expert(layer, e)
        got = res.get(layer, [e])[e].gate.q.data  # a view into the expert's blob
        off, nb = ext.parts["gate_proj"][:2]
        assert np.array_equal(got, ext.read_blob()[off : off + nb])
        owner: object = got
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        if isinstance(owner, memoryview):
            owner = owner.obj
        assert isinstance(owner, mmap.mmap) == res.arena.huge


def test_read_tensor_into_a_given_buffer(tmp_path: Path) -> None:
    from storage.safetensors import TensorInfo, read_tensor

    f = tmp_path / "t.bin"
    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    f.write_bytes(b"xyz" + want.tobytes())
    info = TensorInfo("w", "F32", (3, 4), f, 3, 3 + want.nbytes)
    buf = HugeArena().empty(want.nbytes)
    got = read_tensor(info, buf)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert got.ctypes.data == buf.ctypes.data  # read in place
    with pytest.raises(ValueError, match="48 bytes"):
        read_tensor(info, np.empty(47, np.uint8))


def test_the_weight_arena_carves_disjoint_pieces_from_several_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    arena = HugeArena(chunk=2 * HUGE_PAGE)
    sizes = [(k * 7919) % 300_000 + 1 for k in range(200)]
    with ThreadPoolExecutor(8) as pool:
        pieces = list(pool.map(arena.empty, sizes))
    spans = sorted((p.ctypes.data, p.ctypes.data + p.nbytes) for p in pieces)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert arena.used_bytes == (sum(sizes) if arena.huge else 0)

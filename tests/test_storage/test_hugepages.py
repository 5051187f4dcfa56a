"""Expert-sized buffers on transparent huge pages: the kernel's setting read and explained, the
2 MiB-aligned advised mapping, the fallback when the advice is refused, and the measured bytes
the kernel backs with huge pages (``/proc/self/smaps``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from storage import aligned
from storage.aligned import HUGE_PAGE, aligned_empty, huge_backed_bytes, hugepage_support


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

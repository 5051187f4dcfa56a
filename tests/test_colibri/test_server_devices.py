"""Several SSDs through the HTTP server, for real: a ``coli serve`` subprocess on loopback
streaming the tiny test model's experts (``--ram 4600KiB``) from a ``--mirror`` copy. Its
``/metrics`` carry one series per copy (bytes, reads, weight, failovers, demoted) that move with
generation; a mirror cut short under the running server (real short reads) fails over to the
primary without changing the output, shows up as failovers and a demoted copy, and
``POST /admin/replicas/{index}/enable`` brings the repaired copy back."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _demo import demo_model
from prometheus_client.parser import text_string_to_metric_families
from test_server import Server

from storage.safetensors import read_header

MODEL = demo_model()
KEY = "sk-devices-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 99, 300, 12, 44, 8, 250, 31]
SHARDS = ("out-00000.safetensors", "out-mtp-00000.safetensors")

Series = dict[tuple[str, str], float]  # (metric sample name, copy index) -> value


def scrape(s: Server) -> dict[str, Any]:
    """``/metrics`` parsed by prometheus-client's own parser: per-device samples keyed by
    (sample name, index), the labels seen per index, and every other sample by name."""
    text = httpx.get(s.url + "/metrics", headers=AUTH, timeout=30).text
    dev: Series = {}
    labels: dict[str, dict[str, str]] = {}
    other: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("colibri:expert_device_"):
                dev[(smp.name, smp.labels["index"])] = smp.value
                labels[smp.labels["index"]] = dict(smp.labels)
            elif not smp.labels:
                other[smp.name] = smp.value
    return {"dev": dev, "labels": labels, "other": other}


def complete(s: Server, max_tokens: int = 16) -> str:
    r = httpx.post(
        s.url + "/v1/completions",
        headers=AUTH,
        json={"model": MODEL.name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    return text


def enable(s: Server, index: str, **kw: Any) -> httpx.Response:
    return httpx.post(s.url + f"/admin/replicas/{index}/enable", timeout=30, **kw)


def devices(s: Server) -> list[dict[str, Any]]:
    prof = httpx.get(s.url + "/profile", headers=AUTH, timeout=30).json()
    out: list[dict[str, Any]] = prof["engine"]["experts"]["devices"]
    return out


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A streaming server reading every expert from a full mirror (weights 0,1, no adaptation,
    so where reads go is fixed)."""
    d = tmp_path_factory.mktemp("serve-devices")
    mirror = Path(shutil.copytree(MODEL, d / "mirror"))
    s = Server(
        d,
        "--ram", "4600KiB", "--mirror", str(mirror), "--disk-weights", "0,1",
        "--no-disk-adapt", "--reader", "threads", "--state-dir", str(d / "state"),
        "--api-key", KEY, "--kv-slots", "0",
    )  # fmt: skip
    try:
        yield s.wait_ready(), mirror
    finally:
        s.stop()


def test_device_series_move_fail_over_and_come_back(mirrored: tuple[Server, Path]) -> None:
    s, mirror = mirrored
    m0 = scrape(s)
    assert m0["other"]["colibri:experts_streaming"] == 1.0
    assert m0["labels"]["0"]["role"] == "primary" and m0["labels"]["1"]["role"] == "mirror"
    assert Path(m0["labels"]["1"]["root"]) == mirror
    assert Path(m0["labels"]["0"]["root"]).resolve() == MODEL.resolve()
    dev0 = m0["dev"]
    assert dev0[("colibri:expert_device_weight", "1")] == 1.0
    assert dev0[("colibri:expert_device_weight", "0")] == 0.0
    assert dev0[("colibri:expert_device_demoted", "1")] == 0.0
    assert dev0[("colibri:expert_device_failovers_total", "1")] == 0.0

    # A generation moves the mirror's series (the primary, weight 0, serves nothing).
    ref = complete(s)
    m1 = scrape(s)["dev"]
    for name in ("read_bytes_total", "reads_total", "read_seconds_total", "busy_seconds_total"):
        key = f"colibri:expert_device_{name}"
        assert m1[(key, "1")] > dev0[(key, "1")], name
    assert m1[("colibri:expert_device_read_bytes_total", "0")] == 0.0
    assert ("colibri:expert_device_throughput_bytes_per_second", "1") in m1
    # The compute's wait for experts, not the reads' summed durations (which overlap each other
    # and the compute: their own series).
    other = scrape(s)["other"]
    wait = other["colibri:expert_read_wait_seconds_total"]
    assert 0.0 < wait < other["colibri:expert_read_seconds_total"], other
    # The series are the engine's own counters.
    entries = devices(s)
    assert m1[("colibri:expert_device_read_bytes_total", "1")] == entries[1]["bytes"]
    assert m1[("colibri:expert_device_reads_total", "1")] == entries[1]["reads"]

    # Cut the mirror's shards under the running server: real short reads, failover.
    saved = {n: (mirror / n).read_bytes() for n in SHARDS}
    for n in SHARDS:
        with open(mirror / n, "r+b") as fh:
            fh.truncate(read_header(mirror / n).data_start)
    assert complete(s) == ref
    m2 = scrape(s)["dev"]
    assert m2[("colibri:expert_device_failovers_total", "1")] >= 1
    assert m2[("colibri:expert_device_errors_total", "1")] >= 1
    assert m2[("colibri:expert_device_demoted", "1")] == 1.0
    assert m2[("colibri:expert_device_weight", "1")] == 0.0
    assert m2[("colibri:expert_device_served_failovers_total", "0")] >= 1
    assert m2[("colibri:expert_device_read_bytes_total", "0")] > 0
    assert complete(s) == ref  # demoted: the primary serves, nothing more fails
    m3 = scrape(s)["dev"]
    fails = m2[("colibri:expert_device_failovers_total", "1")]
    assert m3[("colibri:expert_device_failovers_total", "1")] == fails
    assert (
        m3[("colibri:expert_device_read_bytes_total", "0")]
        > m2[("colibri:expert_device_read_bytes_total", "0")]
    )

    # Repaired (same files), then re-enabled through the admin endpoint (which needs the key).
    for n, data in saved.items():
        (mirror / n).write_bytes(data)
    assert enable(s, "1").status_code == 401
    r = enable(s, "1", headers=AUTH)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["index"] == 1 and got["role"] == "mirror" and Path(got["root"]) == mirror
    assert got["re_enabled"] is True and got["demoted"] is False and got["weight"] == 1.0
    assert got["failovers"] == fails
    m4 = scrape(s)["dev"]
    assert m4[("colibri:expert_device_demoted", "1")] == 0.0
    assert m4[("colibri:expert_device_weight", "1")] == 1.0
    assert complete(s) == ref
    m5 = scrape(s)["dev"]
    assert (
        m5[("colibri:expert_device_read_bytes_total", "1")]
        > m4[("colibri:expert_device_read_bytes_total", "1")]
    )
    assert m5[("colibri:expert_device_failovers_total", "1")] == fails  # no new failure
    again = enable(s, "1", headers=AUTH).json()
    assert again["re_enabled"] is False and again["weight"] == 1.0
    metrics = httpx.get(s.url + "/metrics", headers=AUTH).text
    assert (
        'colibri:http_requests_total{route="/admin/replicas/{index}/enable",status="200"} 2.0'
        in metrics
    )


@pytest.mark.parametrize("index", ["2", "17", "-1", "abc", "1.0"])
def test_enable_a_copy_that_does_not_exist_is_a_404(
    mirrored: tuple[Server, Path], index: str
) -> None:
    s, _ = mirrored
    r = enable(s, index, headers=AUTH)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "replica_not_found" and err["param"] == "index"
    assert f"no copy '{index}'" in err["message"] and "0..1" in err["message"]


def test_enable_only_by_post(mirrored: tuple[Server, Path]) -> None:
    s, _ = mirrored
    r = httpx.get(s.url + "/admin/replicas/1/enable", headers=AUTH)
    assert r.status_code == 405


def test_resident_server_has_no_device_series_and_nothing_to_enable(tmp_path: Path) -> None:
    s = Server(tmp_path, "--state-dir", str(tmp_path / "state"), "--kv-slots", "0")
    try:
        s.wait_ready()
        text = httpx.get(s.url + "/metrics").text
        assert "colibri:experts_streaming 0.0" in text
        assert "colibri:expert_device_" not in text
        r = enable(s, "0")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "not_streaming" and "resident" in err["message"]
    finally:
        s.stop()

"""The web dashboard (``coli web``) and the routing atlas (``coli atlas``).

Browser tests drive Debian's headless chromium through Playwright against a real ``coli web``
subprocess on loopback with the bundled demo model (skipped, with the reason, when either is
missing): chat streaming and stop, Runtime, Brain updates and tooltip, Atlas rotation, a phone
viewport, keyboard use and a server restart. Every page fails its test on a JavaScript error
(``pageerror`` or a console error) and on any request to a host other than 127.0.0.1/localhost.
Screenshots go to ``tests/.artifacts/web/``.

The server side (static files, headers, ``/atlas``, the machine summary) and the atlas layout
are also tested without a browser.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
from _demo import demo_model
from _serve import Server
from click.testing import CliRunner

from colibri.atlas import TOPICS, build_atlas, layout, write_atlas
from colibri.tokenizer import ChatTokenizer
from storage.container import Container

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / ".artifacts" / "web"
CHROMIUM = os.environ.get("COLI_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
LOCAL_HOSTS = {"127.0.0.1", "localhost"}


@pytest.fixture
def anyio_backend() -> str:
    """The in-process app tests run on asyncio only (the server's own loop)."""
    return "asyncio"


class WebServer(Server):
    """A ``coli web`` subprocess on a loopback port (the demo model, its own state dir)."""

    def __init__(self, log_dir: Path, state_dir: Path, *args: str, port: int | None = None):
        self.state_dir = state_dir
        super().__init__(log_dir, "--state-dir", str(state_dir), *args, command="web", port=port)

    def chat(self, max_tokens: int = 8) -> dict[str, Any]:
        body = {
            "model": demo_model().name,
            "messages": [{"role": "user", "content": "Tell me about experts."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())


# ------------------------------------------------------------------------------ no browser


def _atlas_counts() -> tuple[np.ndarray, np.ndarray]:
    """Synthetic counts: 3 topics, 2 layers x 6 experts; topic t routes to experts 2t, 2t+1
    of every layer, and expert 5 of layer 1 is never routed."""
    delta = np.zeros((3, 2, 6), dtype=np.int64)
    for t in range(3):
        delta[t, :, 2 * t] = 40 + t
        delta[t, :, 2 * t + 1] = 30
        delta[t, :, (2 * t + 2) % 6] += 3  # a little cross-talk
    delta[:, 1, 5] = 0
    return delta, np.array([100, 120, 80])


def test_atlas_layout_groups_experts_by_topic() -> None:
    delta, tokens = _atlas_counts()
    out = layout(delta, tokens)
    pos, dom, aff = out["position"], out["dominant"], out["affinity"]
    assert pos.shape == (12, 3) and aff.shape == (12, 3)
    expected = [0, 0, 1, 1, 2, 2]
    assert list(dom[:6]) == expected
    assert list(dom[6:11]) == expected[:5] and dom[11] == -1
    assert np.allclose(pos[11], 0) and np.allclose(aff[11], 0)  # never routed: the origin
    routed = dom >= 0
    assert np.allclose(aff[routed].sum(axis=1), 1)
    assert np.sqrt((pos**2).sum(axis=1)).max() == pytest.approx(1.0)
    # same topic -> close; different topics -> far
    same = np.linalg.norm(pos[0] - pos[6])
    other = np.linalg.norm(pos[0] - pos[2])
    assert same < other / 3
    assert 0 < sum(out["explained_variance"]) <= 1 + 1e-9
    again = layout(delta, tokens)  # deterministic (signs fixed)
    assert np.array_equal(again["position"], pos)


def test_build_and_write_atlas(tmp_path: Path) -> None:
    delta, tokens = _atlas_counts()
    data = build_atlas(["a", "b", "c"], tokens, delta, [1, 2], model="m", source="model")
    assert data["format"] == "colibri-atlas" and data["n_experts"] == 6
    assert len(data["position"]) == 12 and data["summary"]["experts_routed"] == 11
    path = tmp_path / "sub" / "atlas.json"
    write_atlas(path, data)
    assert json.loads(path.read_text())["topics"] == ["a", "b", "c"]
    assert not list(path.parent.glob(".*tmp"))
    assert set(TOPICS) >= {"code", "poetry", "law", "chinese", "sql", "chat"}
    assert all(len(p) >= 3 for p in TOPICS.values())


def test_coli_web_has_the_serve_options() -> None:
    from colibri.cli import main

    web = CliRunner().invoke(main, ["web", "--help"])
    serve = CliRunner().invoke(main, ["serve", "--help"])
    assert web.exit_code == 0, web.output
    flags = set(re.findall(r"--[a-z][a-z-]+", serve.output))
    assert flags and flags <= set(re.findall(r"--[a-z][a-z-]+", web.output))
    assert "dashboard" in web.output
    atlas = CliRunner().invoke(main, ["atlas", "--help"])
    assert atlas.exit_code == 0 and "--server" in atlas.output


@pytest.mark.anyio
async def test_app_serves_dashboard_files_atlas_and_machine(tmp_path: Path) -> None:
    import colibri
    from colibri.server import ServerConfig, create_app

    key = "sk-web-test"
    opts = colibri.EngineOptions(state_dir=tmp_path)
    async with colibri.Engine.open(options=opts) as engine:
        app = await create_app(engine, ServerConfig(api_key=key), web=True)
        plain = await create_app(engine, ServerConfig(), web=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            r = await c.get("/")  # public files: no key needed
            assert r.status_code == 200 and '<canvas id="brain"' in r.text
            csp = r.headers["content-security-policy"]
            assert "default-src 'self'" in csp and "connect-src 'self'" in csp
            assert r.headers["x-frame-options"] == "DENY"
            js = await c.get("/app.js")
            assert js.status_code == 200 and js.headers["content-type"].startswith(
                "text/javascript"
            )
            assert (await c.get("/style.css")).headers["content-type"].startswith("text/css")
            assert (await c.head("/index.html")).status_code == 200
            # nothing in the page refers to another host
            for text in (r.text, js.text, (await c.get("/style.css")).text):
                assert not re.search(
                    r"(https?:)?//(?!127\.0\.0\.1|localhost)[a-z0-9.-]+\.[a-z]", text
                )
            # the API still needs the key
            assert (await c.get("/profile")).status_code == 401
            auth = {"authorization": f"Bearer {key}"}
            prof = (await c.get("/profile", headers=auth)).json()
            m = prof["machine"]
            assert m["cpu_count"] == os.cpu_count() and m["ram_total_bytes"] > 0
            assert m["expert_bytes"] > 0 and m["disks"][0]["role"] == "primary"
            ex = (await c.get("/experts", headers=auth)).json()
            assert ex["expert_bytes"] == m["expert_bytes"]
            miss = await c.get("/atlas", headers=auth)
            assert miss.status_code == 404 and miss.json()["error"]["code"] == "atlas_missing"
            delta, tokens = _atlas_counts()
            write_atlas(
                tmp_path / "atlas.json",
                build_atlas(["a", "b", "c"], tokens, delta, [1, 2], model="m", source="model"),
            )
            got = await c.get("/atlas", headers=auth)
            assert got.status_code == 200 and got.json()["format"] == "colibri-atlas"
            # DNS rebinding protection covers the files too; unknown paths are JSON 404s
            assert (await c.get("/", headers={"host": "evil.example"})).status_code == 421
            nope = await c.get("/nope.js")
            assert nope.status_code == 401  # not a dashboard file: the API's rules apply
            assert (await c.get("/nope.js", headers=auth)).status_code == 404
        transport = httpx.ASGITransport(app=plain)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            assert (await c.get("/")).status_code == 404  # `coli serve`: no dashboard
            assert (await c.get("/app.js")).status_code == 404


# ------------------------------------------------------------------------------ browser


def _playwright() -> Any:
    """The Playwright sync API, or skip with the reason."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[test]')")
    return sync_playwright


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_playwright = _playwright()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebServer]:
    _playwright()  # no server without a browser to drive it
    base = tmp_path_factory.mktemp("web")
    # a small RAM budget: experts stream, so the Brain shows several tiers
    srv = WebServer(
        base, base / "state", "--ram", "64MiB", "--reader", "threads", "--kv-slots", "2"
    )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


class Page:
    """A page on a fresh browser context with error and network guards."""

    def __init__(self, browser: Any, viewport: dict[str, int], name: str) -> None:
        self.name = name
        self.errors: list[str] = []
        self.external: list[str] = []
        self.allowed: list[Callable[[str, str], bool]] = []
        self.context = browser.new_context(viewport=viewport)
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def _route(self, route: Any) -> None:
        host = urlparse(route.request.url).hostname or ""
        if host in LOCAL_HOSTS:
            route.continue_()
        else:
            self.external.append(route.request.url)
            route.abort()

    def _console(self, msg: Any) -> None:
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        if any(ok(msg.text, url) for ok in self.allowed):
            return
        self.errors.append(f"console: {msg.text} ({url})")

    def shot(self, label: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.name}-{label}.png"
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        self.context.close()
        assert not self.external, f"requests to other hosts: {self.external}"
        assert not self.errors, "JavaScript errors:\n" + "\n".join(self.errors)


@pytest.fixture
def open_page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Callable[..., Page]]:
    pages: list[Page] = []

    def make(viewport: dict[str, int] = DESKTOP, name: str | None = None) -> Page:
        p = Page(browser, viewport, name or request.node.name.removeprefix("test_"))
        pages.append(p)
        return p

    yield make
    for p in pages:
        p.close()


def _wait_done(page: Any, timeout: float = 30_000) -> Any:
    page.wait_for_selector(".msg.assistant[data-done]", timeout=timeout)
    return page.locator(".msg.assistant").last


def test_chat_streams_tokens_keyboard_and_stop(server: WebServer, open_page: Any) -> None:
    p = open_page()
    page = p.page
    page.goto(server.url + "/")
    page.wait_for_selector("#conn.ok")
    assert page.inner_text("#model-name") == demo_model().name
    # keyboard: Tab reaches the message box, then the send button
    page.locator("body").focus()
    seen = []
    for _ in range(30):
        page.keyboard.press("Tab")
        seen.append(page.evaluate("() => document.activeElement.id"))
        if seen[-1] == "send":
            break
    assert "prompt" in seen and seen[-1] == "send", seen
    assert seen.index("prompt") == len(seen) - 2
    # count text updates inside the answer: a streamed answer arrives in many pieces
    page.evaluate(
        """() => { window.__updates = 0;
        new MutationObserver((ms) => { window.__updates += ms.length; })
          .observe(document.getElementById('messages'),
                   {characterData: true, subtree: true, childList: true}); }"""
    )
    page.fill("#max-tokens", "40")
    page.check("#ignore-eos")
    page.select_option("#slot", "0")
    page.focus("#prompt")
    page.keyboard.type("Hello colibri")
    page.keyboard.press("Enter")  # Enter sends
    page.wait_for_function(
        """() => { const m = document.querySelector('.msg.assistant:last-child');
        return m && !m.dataset.done && m.querySelector('.body').textContent.length > 0; }""",
        timeout=30_000,
    )
    p.shot("desktop-streaming")
    msg = _wait_done(page)
    assert msg.get_attribute("data-done") == "ok"
    assert page.evaluate("() => window.__updates") >= 10
    assert page.input_value("#prompt") == ""
    stats = msg.locator(".stats").inner_text()
    for part in ("TTFT", "tok/s", "queue wait", "in ", "out 40", "slot 0", "length"):
        assert part in stats, stats
    assert msg.locator(".body").inner_text().strip()
    p.shot("desktop-chat")

    # a long generation, stopped from the page: the server cancels it
    page.fill("#max-tokens", "")
    page.fill("#prompt", "Now write a very long story.")
    page.click("#send")
    assert page.is_enabled("#stop")
    page.wait_for_function(
        """() => { const m = document.querySelectorAll('.msg.assistant')[1];
        return m && m.querySelector('.body').textContent.length > 40; }""",
        timeout=30_000,
    )
    page.click("#stop")
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant[data-done]').length === 2", timeout=10_000
    )
    last = page.locator(".msg.assistant").last
    assert last.get_attribute("data-done") == "stopped"
    assert "stopped" in last.locator(".stats").inner_text()
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    p.shot("desktop-stopped")
    deadline = time.monotonic() + 10
    reasons: list[str] = []
    while time.monotonic() < deadline:
        turns = httpx.get(server.url + "/profile?limit=1", timeout=5).json()["turns"]
        reasons = [t["finish_reason"] for t in turns]
        if reasons == ["cancelled"]:
            break
        time.sleep(0.2)
    assert reasons == ["cancelled"]


def test_runtime_and_brain(server: WebServer, open_page: Any) -> None:
    server.chat(8)  # at least one turn to show
    p = open_page()
    page = p.page
    page.goto(server.url + "/#runtime")
    page.wait_for_function("() => document.querySelector('#machine').textContent.includes('cores')")
    page.wait_for_selector("#turns .turn")
    page.wait_for_function(
        "() => document.querySelector('#tier-legend').textContent.includes('RAM')"
    )
    machine = page.inner_text("#machine")
    assert "streaming" in machine and "RAM" in machine
    # the tiers' bytes: each expert at its own layer's size (the MTP layer's are wider here;
    # every expert used to be counted at the widest one's size)
    c = Container.open(demo_model())
    sizes = c.expert_nbytes_by_layer()
    assert len(set(sizes.values())) > 1, sizes
    total = sum(sizes.values()) * c.arch.n_routed_experts
    assert page.inner_text("#tier-total").endswith(f"· {total / 2**20:.1f} MiB"), total
    low, high = min(sizes.values()), max(sizes.values())
    assert f"{low / 1024:.1f} KiB – {high / 1024:.1f} KiB (by layer)" in machine, machine
    assert "primary" in page.inner_text("#disks")
    assert "Expert reads" in page.inner_text("#expert-io")
    page.wait_for_function("() => document.querySelector('#timebar').children.length === 6")
    legend = page.inner_text("#time-legend")
    for part in ("waiting for expert reads", "expert compute", "attention, dense layers"):
        assert part in legend, legend
    p.shot("desktop-runtime")

    page.click("#tab-btn-brain")
    assert page.url.endswith("#brain")
    page.wait_for_function("() => Number(document.querySelector('#brain').dataset.updates) >= 1")
    info = page.inner_text("#brain-title")
    assert info == "4 MoE layers × 16 experts", info
    page.wait_for_timeout(1300)  # let any earlier flash fade
    before = page.evaluate("() => document.querySelector('#brain').toDataURL()")
    updates = int(page.get_attribute("#brain", "data-updates") or 0)
    server.chat(6)
    page.wait_for_function(
        f"""() => {{ const c = document.querySelector('#brain');
        return Number(c.dataset.updates) > {updates} && Number(c.dataset.routed) > 0; }}""",
        timeout=15_000,
    )
    after = page.evaluate("() => document.querySelector('#brain').toDataURL()")
    assert after != before  # routed experts flash (and heat changes)
    p.shot("desktop-brain-flash")
    box = page.locator("#brain").bounding_box()
    page.mouse.move(box["x"] + box["width"] * (5.5 / 16), box["y"] + box["height"] * (2.5 / 4))
    tip = page.locator("#brain-tip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "layer 3 · expert 5" in text and "tier" in text and "selections" in text, text
    p.shot("desktop-brain-hover")
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] + 40)
    tip.wait_for(state="hidden")

    # GLM-5 scale: 76 layers x 256 experts = 19,456 cells, drawn from one ImageData
    calls = page.evaluate(
        """() => { const L = 76, E = 256, d = window.colibriDashboard;
        const codes = [], tiers = [], counts = [];
        const names = ['disk', 'lru', 'pinned', 'ram'];
        for (let l = 0; l < L; l++) {
          const c = [], t = [], n = [];
          for (let e = 0; e < E; e++) {
            const tier = (l * 7 + e * 13) % 10 < 6 ? 0 : (e % 3) + 1;
            const heat = (l * 31 + e * 17) % 20;
            c.push((tier << 6) | heat); t.push(names[tier]); n.push(2 ** heat);
          }
          codes.push(c); tiers.push(t); counts.push(n);
        }
        const layers = Array.from({length: L}, (_, i) => i + 3);
        const ex = {mode: 'streaming', layers, n_experts: E, tiers, counts, codes,
                    expert_bytes: 19e6, tier_codes: {disk: 0, lru: 1, pinned: 2, ram: 3}};
        d.onExperts(ex);
        counts[10][20] += 5; counts[40][200] += 1;
        d.onExperts(ex);
        // what a frame asks of the canvas (counted, not timed: a busy machine is slow at
        // anything): one image for all the cells, a rect per gap line, none per cell
        const proto = CanvasRenderingContext2D.prototype, calls = {}, kept = {};
        for (const name of ['putImageData', 'fillRect', 'fill', 'rect', 'drawImage']) {
          kept[name] = proto[name]; calls[name] = 0;
          proto[name] = function (...args) { calls[name]++; return kept[name].apply(this, args); };
        }
        try { for (let i = 0; i < 20; i++) d.brain.draw(); }
        finally { for (const name in kept) proto[name] = kept[name]; }
        for (const name in calls) calls[name] /= 20;
        return calls; }"""
    )
    assert page.inner_text("#brain-title") == "76 MoE layers × 256 experts"
    assert page.get_attribute("#brain", "data-routed") == "2"
    assert calls["putImageData"] == 1 and calls["drawImage"] == 1, calls
    assert calls["fillRect"] <= 255 + 75 and calls["fill"] == calls["rect"] == 0, calls
    p.shot("desktop-brain-glm-scale")


def test_brain_legend_and_tooltip_on_a_short_grid(server: WebServer, open_page: Any) -> None:
    """The Brain draws its legend (each tier's colour as the cells have it, with counts, and what
    brightness and white mean) and its tooltip stays whole on a one-row grid (a small model)."""
    p = open_page()
    page = p.page
    page.goto(server.url + "/#brain")
    page.wait_for_function("() => Number(document.querySelector('#brain').dataset.updates) >= 1")
    legend = page.inner_text("#brain-legend")
    for word in ("RAM pinned", "RAM LRU", "disk", "brighter = routed more", "white = routed"):
        assert word in legend, legend
    page.evaluate(
        """() => { const d = window.colibriDashboard, E = 8;
        const tiers = [['pinned', 'lru', 'lru', 'disk', 'disk', 'disk', 'disk', 'disk']];
        const code = {disk: 0, lru: 1, pinned: 2, ram: 3};
        d.onExperts({mode: 'streaming', layers: [1], n_experts: E, tiers,
                     counts: [[9, 4, 2, 0, 0, 1, 0, 0]], tier_codes: code,
                     codes: [tiers[0].map((t, e) => (code[t] << 6) | (e < 3 ? 3 : 0))],
                     expert_bytes: 1024}); }"""
    )
    page.wait_for_function("() => document.querySelector('#brain-title').textContent"
                           " === '1 MoE layer × 8 experts'")  # fmt: skip
    legend = page.inner_text("#brain-legend")
    assert "RAM pinned: 1" in legend and "RAM LRU: 2" in legend and "disk: 5" in legend, legend
    # each swatch has the colour the cells of that tier are drawn with
    swatch = page.evaluate(
        """() => [...document.querySelectorAll('#brain-legend .legend-tier')].map(
             s => [s.dataset.tier, getComputedStyle(s.querySelector('i')).backgroundColor])"""
    )
    assert (
        dict(swatch)["disk"] == "rgb(148, 113, 82)" and dict(swatch)["lru"] == "rgb(96, 165, 250)"
    )
    box = page.locator("#brain").bounding_box()
    page.mouse.move(box["x"] + box["width"] * (0.5 / 8), box["y"] + box["height"] / 2)
    tip = page.locator("#brain-tip")
    tip.wait_for(state="visible")
    assert "layer 1 · expert 0" in tip.inner_text() and "RAM pinned" in tip.inner_text()
    tb = tip.bounding_box()
    vw, vh = page.viewport_size["width"], page.viewport_size["height"]
    assert tb["height"] > box["height"]  # taller than the grid: the wrap used to clip it
    assert (
        0 <= tb["x"]
        and tb["x"] + tb["width"] <= vw
        and 0 <= tb["y"] <= tb["y"] + tb["height"] <= vh
    )
    # laid out against the viewport, so the grid's box (overflow hidden) does not cut it
    assert (
        page.evaluate("() => getComputedStyle(document.querySelector('#brain-tip')).position")
        == "fixed"
    )
    p.shot("desktop-brain-short-grid")


MARKDOWN = (
    "# Plan\n\nUse **bold** and *care*, `x = 1` inline.\n\n- one\n- two [doc](https://example.org/a)\n"
    "1. first\n2. second\n\n```python\nprint('<b>hi</b>')\n```\n"
    "<img src=x onerror=alert(1)> [bad](javascript:alert(1))"
)


def test_chat_renders_markdown_and_sends_the_system_prompt(
    server: WebServer, open_page: Any
) -> None:
    """A finished answer shows as Markdown (code blocks, lists, emphasis, safe links; HTML in it
    stays text); the system prompt field goes first in the request; the Atlas hint names this
    server's own address."""
    p = open_page()
    page = p.page
    sent: list[dict[str, Any]] = []

    def canned(route: Any) -> None:  # the model's answer, fixed: the rendering is under test
        sent.append(json.loads(route.request.post_data or "{}"))
        chunks = [MARKDOWN[i : i + 7] for i in range(0, len(MARKDOWN), 7)]
        events = [
            {"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]}
            for c in chunks
        ] + [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", canned)
    page.goto(server.url + "/#chat")
    page.fill("#system-prompt", "You answer in Markdown.")
    page.fill("#prompt", "make a plan")
    page.click("#send")
    body = page.locator(".msg.assistant .body.md")
    body.wait_for()
    assert sent[0]["messages"][0] == {"role": "system", "content": "You answer in Markdown."}
    assert sent[0]["messages"][1] == {"role": "user", "content": "make a plan"}
    shape = page.evaluate(
        """() => { const b = document.querySelector('.msg.assistant .body.md');
        const q = (sel) => b.querySelector(sel)?.textContent;
        return {h: q('h3'), strong: q('strong'), em: q('em'), code: q('p code'),
                ul: b.querySelectorAll('ul li').length, ol: b.querySelectorAll('ol li').length,
                pre: q('pre code'), lang: b.querySelector('pre code')?.dataset.lang,
                links: [...b.querySelectorAll('a')].map(a => a.href),
                imgs: b.querySelectorAll('img').length, text: b.textContent}; }"""
    )
    assert shape["h"] == "Plan" and shape["strong"] == "bold" and shape["em"] == "care"
    assert shape["code"] == "x = 1" and shape["ul"] == 2 and shape["ol"] == 2
    assert shape["pre"] == "print('<b>hi</b>')" and shape["lang"] == "python"
    assert shape["links"] == ["https://example.org/a"] and shape["imgs"] == 0
    assert "<img src=x onerror=alert(1)>" in shape["text"] and "[bad](javascript:" in shape["text"]
    p.shot("desktop-chat-markdown")
    page.click("#tab-btn-atlas")
    hint = page.inner_text("#atlas-missing pre")
    assert f"coli atlas --server {server.url}" in hint, hint


def test_atlas_missing_then_built_and_rotated(server: WebServer, open_page: Any) -> None:
    p = open_page()
    page = p.page
    (server.state_dir / "atlas.json").unlink(missing_ok=True)
    page.goto(server.url + "/#atlas")
    page.wait_for_selector("#atlas-missing", state="visible")
    assert "coli atlas" in page.inner_text("#atlas-missing")
    # this server's own commands: its state dir (the fixed hint left it out, and the atlas
    # it led to went where the server never looks)
    page.wait_for_function(
        "d => document.querySelector('#atlas-commands').textContent.includes(d)",
        arg=str(server.state_dir),
    )
    p.shot("desktop-atlas-missing")

    run = subprocess.run(
        [
            sys.executable,
            "tools/atlas.py",
            "-v",
            "--server",
            server.url,
            "--state-dir",
            str(server.state_dir),
        ],
        cwd=ROOT,
        env=server.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["atlas"] == str(server.state_dir / "atlas.json")
    assert summary["experts"] == 64 and summary["experts_routed"] > 0
    assert "code:" in run.stderr and "chinese:" in run.stderr

    page.click("#atlas-retry")
    page.wait_for_selector("#atlas-view", state="visible")
    page.wait_for_function("() => document.querySelector('#atlas').dataset.yaw !== undefined")
    legend = page.inner_text("#atlas-legend")
    assert "code" in legend and "sql" in legend
    yaw0 = float(page.get_attribute("#atlas", "data-yaw") or 0)
    p.shot("desktop-atlas")
    box = page.locator("#atlas").bounding_box()
    cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(cx, cy)
    page.mouse.down()
    for i in range(1, 9):
        page.mouse.move(cx + 15 * i, cy + 4 * i)
    page.mouse.up()
    page.wait_for_function(
        f"() => Math.abs(document.querySelector('#atlas').dataset.yaw - {yaw0}) > 1"
    )
    yaw1 = float(page.get_attribute("#atlas", "data-yaw") or 0)
    assert yaw1 == pytest.approx(yaw0 + 1.2, abs=0.05)
    p.shot("desktop-atlas-rotated")
    # keyboard rotation
    page.focus("#atlas")
    page.keyboard.press("ArrowRight")
    page.wait_for_function(f"() => Number(document.querySelector('#atlas').dataset.yaw) > {yaw1}")
    # hover a routed expert: the tooltip names it and its topic
    pt = page.evaluate(
        """() => { const a = window.colibriDashboard.atlas, st = window.colibriDashboard.state;
        const i = st.atlas.dominant.findIndex((d) => d >= 0);
        const r = document.querySelector('#atlas').getBoundingClientRect();
        const k = document.querySelector('#atlas').width / r.width;
        return {x: r.left + a.sx[i] / k, y: r.top + a.sy[i] / k}; }"""
    )
    page.mouse.move(pt["x"], pt["y"])
    tip = page.locator("#atlas-tip")
    tip.wait_for(state="visible")
    assert "topic" in tip.inner_text() and "layer" in tip.inner_text()
    # the Brain's tooltip now shows topic affinity too
    page.click("#tab-btn-brain")
    page.wait_for_function("() => Number(document.querySelector('#brain').dataset.updates) >= 1")
    box = page.locator("#brain").bounding_box()
    page.mouse.move(box["x"] + box["width"] * (0.5 / 16), box["y"] + box["height"] * (0.5 / 4))
    page.locator("#brain-tip").wait_for(state="visible")
    assert "topic" in page.inner_text("#brain-tip")
    # GLM-5 scale: 19,456 points still redraw fast enough to drag smoothly
    page.click("#tab-btn-atlas")
    fills = page.evaluate(
        """() => { const n = 76 * 256, T = 8, d = window.colibriDashboard;
        const a = {format: 'colibri-atlas', model: 'glm-5-like', created: 0,
                   topics: ['code', 'poetry', 'law', 'chinese', 'sql', 'chat', 'math', 'med'],
                   layers: Array.from({length: 76}, (_, i) => i + 3), n_experts: 256,
                   position: [], dominant: [], affinity: [], selections: [],
                   explained_variance: [0.3, 0.2, 0.1]};
        let s = 7;
        const rnd = () => (s = (s * 16807) % 2147483647) / 2147483647;
        for (let i = 0; i < n; i++) {
          const t = i % T, r = 0.3 + 0.6 * rnd();
          const z = t / T - 0.5 + 0.3 * rnd();
          a.position.push([Math.cos(t) * r + 0.2 * rnd(), Math.sin(t) * r, z]);
          a.dominant.push(t); a.affinity.push(new Array(T).fill(1 / T));
          a.selections.push(Math.floor(1000 * rnd()));
        }
        d.atlas.setData(a);
        // fills per frame (counted, not timed): one per run of points of one depth bucket
        // and topic (12 x 9 styles, dimmed or not), however many points there are
        const proto = CanvasRenderingContext2D.prototype, kept = proto.fill;
        let fills = 0;
        proto.fill = function (...args) { fills++; return kept.apply(this, args); };
        try { for (let i = 0; i < 10; i++) { d.atlas.rotate(0.05, 0); d.atlas.draw(); } }
        finally { proto.fill = kept; }
        return fills / 10; }"""
    )
    assert 1 <= fills <= 12 * 9 * 2, f"{fills} fills in a 19,456-point atlas frame"
    p.shot("desktop-atlas-glm-scale")


def test_phone_layout(server: WebServer, open_page: Any) -> None:
    p = open_page(PHONE)
    page = p.page
    page.goto(server.url + "/")
    page.wait_for_selector("#conn.ok")
    page.fill("#max-tokens", "12")
    page.fill("#prompt", "Hi")
    page.press("#prompt", "Enter")
    assert _wait_done(page).get_attribute("data-done") == "ok"
    for tab in ("chat", "runtime", "brain", "atlas"):
        page.click(f"#tab-btn-{tab}")
        page.wait_for_timeout(600)
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"{tab}: the page is {width} px wide"
        p.shot(f"phone-{tab}")
    assert page.locator("#tab-btn-atlas").bounding_box()["y"] < 120


def test_page_survives_a_server_restart(open_page: Any, tmp_path: Path) -> None:
    """A tall window: hiding the banner resizes the page, which redraws Runtime before the new
    server's first poll lands (that redraw used to throw in the disks table, its rates having
    no poll to start from)."""
    srv = WebServer(tmp_path, tmp_path / "state", "--kv-slots", "1").wait_ready()
    try:
        p = open_page({"width": 1280, "height": 2400})
        page = p.page
        page.goto(srv.url + "/#runtime")
        page.wait_for_selector("#conn.ok")
        page.wait_for_function(
            "() => document.querySelector('#machine').textContent.includes('cores')"
        )
        assert not page.evaluate("document.body.classList.contains('stale')")
        # while it is down, failed requests are expected console noise
        p.allowed.append(lambda text, url: "ERR_CONNECTION_REFUSED" in text)
        srv.stop()
        page.wait_for_selector("#banner", state="visible", timeout=10_000)
        assert "not answering" in page.inner_text("#banner")
        assert "offline" in page.inner_text("#conn")
        # the figures still on screen are the last ones, shown as such
        assert page.evaluate("document.body.classList.contains('stale')")
        p.shot("desktop-server-down")
        srv.start().wait_ready()
        page.wait_for_selector("#banner", state="hidden", timeout=25_000)
        page.wait_for_selector("#conn.ok")
        assert not page.evaluate("document.body.classList.contains('stale')")
        page.wait_for_timeout(3_000)  # the first polls of the new server land and redraw
        page.click("#tab-btn-chat")
        page.fill("#max-tokens", "5")
        page.fill("#prompt", "Back again?")
        page.press("#prompt", "Enter")
        assert _wait_done(page).get_attribute("data-done") == "ok"
        p.shot("desktop-server-back")
    finally:
        srv.stop()


def test_expert_workers_on_the_dashboard_and_in_metrics(open_page: Any, tmp_path: Path) -> None:
    """``coli web --ray local``: the Runtime tab lists each expert worker with its calls, and
    ``/metrics`` carries one series per worker."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    srv = WebServer(tmp_path, tmp_path / "state", "--ray", "local", "--expert-workers", "2")
    try:
        srv.wait_ready(180)
        srv.chat(8)
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        for w in ("expert-worker-0", "expert-worker-1"):
            calls = re.search(
                rf'colibri:cluster_worker_calls_total\{{worker="{w}"\}} (\S+)', metrics
            )
            assert calls and float(calls.group(1)) > 0, metrics[-2000:]
            assert f'colibri:cluster_worker_up{{worker="{w}"}} 1.0' in metrics
        p = open_page()
        page = p.page
        page.goto(srv.url + "/#runtime")
        page.wait_for_function("() => !document.querySelector('#cluster-card').hidden")
        page.wait_for_function("() => document.querySelectorAll('#cluster tbody tr').length === 2")
        rows = page.inner_text("#cluster tbody")
        assert "expert-worker-0" in rows and "expert-worker-1" in rows and "up · resident" in rows
        assert "2 on local" in page.inner_text("#cluster-note")
        assert "on 2 expert workers" in page.inner_text("#machine")
        p.shot("desktop-cluster")
        # where the experts are: on the workers (the coordinator's fallback store was
        # described: every expert "disk", `coli ps` "streaming, hit rate 0 %")
        ex = httpx.get(srv.url + "/experts", timeout=10).json()
        assert ex["mode"] == "cluster" and {t for row in ex["tiers"] for t in row} == {"worker"}
        assert {o for row in ex["owners"] for o in row} == {0, 1}
        page.goto(srv.url + "/#brain")
        page.wait_for_function(
            "() => document.querySelector('#brain-legend').textContent.includes('workers')"
        )
        n = len(ex["layers"]) * ex["n_experts"]
        assert f"expert workers (--ray): {n}" in page.inner_text("#brain-legend")
        assert "on expert workers" in page.inner_text("#brain-info")
        from _cli import coli

        ps = coli("ps", "--url", srv.url, home=tmp_path)
        assert ps.returncode == 0, ps.stderr
        assert "on 2 expert workers (2 alive, resident)" in ps.stdout, ps.stdout
    finally:
        srv.stop()


def test_an_atlas_with_generated_tokens_counts_each_routed_token_once(tmp_path: Path) -> None:
    """`coli atlas --tokens N` generates without drafting: rejected verify rows were counted
    too (and which rows ran depended on timing), so two runs disagreed; now every run counts
    exactly the prompt and generated tokens' routes, the same each time."""
    from colibri._config import EngineOptions, default_model_path
    from colibri.atlas import atlas_from_model

    opts = EngineOptions(model=default_model_path(), state_dir=tmp_path)
    topics = {"a": ("The quick brown fox",), "b": ("def f(x): return x",)}
    runs = [atlas_from_model(opts, tokens=6, topics=topics) for _ in range(2)]
    assert runs[0]["selections"] == runs[1]["selections"]
    a = runs[0]
    n_e, tokens = a["n_experts"], sum(a["topic_tokens"])
    per_layer = [sum(a["selections"][i * n_e : (i + 1) * n_e]) for i in range(len(a["layers"]))]
    cfg = json.loads((default_model_path() / "config.json").read_text())
    main_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    # every main MoE layer: each routed token once, top-k experts; the MTP head never ran
    assert per_layer == [tokens * cfg["num_experts_per_tok"]] * main_moe + [0], per_layer


def test_an_atlas_through_a_server_counts_only_the_tokens_it_computed(tmp_path: Path) -> None:
    """`coli atlas --server`: a prompt whose prefix the server takes from a KV slot routes only
    its new tokens; the topic's token count leaves the reused ones out (``cached_tokens``),
    so every MoE layer holds exactly K selections per counted token."""
    from colibri.atlas import atlas_from_server

    srv = WebServer(tmp_path, tmp_path / "state", "--kv-slots", "2").wait_ready()
    try:
        text = "The quick brown fox jumps over the lazy dog, again and again and again."
        topics = {"a": (text, text), "b": ("def f(x): return x * 2",)}
        a = atlas_from_server(srv.url, topics=topics)
    finally:
        srv.stop()
    cfg = json.loads((demo_model() / "config.json").read_text())
    n_e, k = a["n_experts"], cfg["num_experts_per_tok"]
    main_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_layer = [sum(a["selections"][i * n_e : (i + 1) * n_e]) for i in range(len(a["layers"]))]
    total = sum(a["topic_tokens"])
    assert per_layer[:main_moe] == [total * k] * main_moe, (per_layer, a["topic_tokens"])
    c = Container.open(demo_model())
    one = len(ChatTokenizer(Path(str(c.tokenizer_path())), c.tokenizer_config()).encode(text))
    assert a["topic_tokens"][0] < 2 * one  # the repeat reused its prefix


def test_a_keyed_server_shows_every_tab_once_the_key_is_entered(
    open_page: Any, tmp_path: Path
) -> None:
    """Opened on the Atlas tab of a server that needs an API key: the key form asks for it, and
    once entered the atlas, the model and the runtime all load (the atlas used to stay in the
    error its first, unauthorised request left until the tab was left and opened again)."""
    state = tmp_path / "state"
    c = Container.open(demo_model())
    layers = c.expert_layers()
    rng = np.random.default_rng(3)
    delta = rng.integers(0, 50, (3, len(layers), c.arch.n_routed_experts)).astype(np.int64)
    data = build_atlas(["code", "poetry", "law"], np.array([100, 120, 80]), delta, layers,
                       model=demo_model().name, source="model")  # fmt: skip
    write_atlas(state / "atlas.json", data)
    srv = WebServer(tmp_path, state, "--api-key", "sesame", "--kv-slots", "0").wait_ready()
    try:
        p = open_page()
        p.allowed.append(lambda text, url: "401" in text)  # the requests before the key
        page = p.page
        page.goto(srv.url + "/#atlas")
        page.wait_for_selector("#key-form", state="visible")
        assert page.is_hidden("#atlas-view")
        assert "API key needed" in page.inner_text("#conn")  # not a plain "connected"
        # a wrong key: said so (the same form came back without a word, the key stored)
        page.fill("#api-key", "open-sesame")
        page.press("#api-key", "Enter")
        page.wait_for_selector("#key-error", state="visible", timeout=15_000)
        assert page.evaluate("localStorage.getItem('colibri.apiKey')") is None
        page.fill("#api-key", "sesame")
        page.press("#api-key", "Enter")
        page.wait_for_selector("#key-form", state="hidden")
        page.wait_for_selector("#atlas-view", state="visible", timeout=15_000)
        assert "code" in page.inner_text("#atlas-legend")
        page.click("#tab-btn-runtime")
        page.wait_for_function(
            "() => document.querySelector('#machine').textContent.includes('cores')"
        )
        p.shot("desktop-keyed-atlas")
    finally:
        srv.stop()


def test_atlas_counts_the_rows_it_routed_and_the_server_path_reproduces_them(
    tmp_path: Path,
) -> None:
    """topic_tokens are the rows the atlas routed: generating past the context counted
    tokens never made (1107 counted, 1023 routed). Through a server, the request turns
    drafting off (rejected verify rows and the MTP layer's routing were counted, differently
    each run): two runs give the same counts, the same as measuring in process."""
    from colibri._config import EngineOptions
    from colibri.atlas import atlas_from_model, atlas_from_server

    model = demo_model()
    topics = {"story": ("Once upon a time there was a small bird",)}
    opts = EngineOptions(model=model, state_dir=tmp_path / "state", learn=False)
    arch = Container.open(model).arch
    context = int(Container.open(model).config["max_position_embeddings"])
    local = atlas_from_model(opts, tokens=2000, topics=topics)  # past the context
    main_layers = [la for la in local["layers"] if la < arch.num_hidden_layers]
    assert arch.num_experts_per_tok is not None
    routed = sum(local["selections"]) // (len(main_layers) * arch.num_experts_per_tok)
    assert local["topic_tokens"] == [routed] == [context - 1]

    s = Server(tmp_path, "--draft", "mtp:2", "--kv-slots", "0", "--prefix-reuse", "off")
    try:
        s.wait_ready()
        runs = [atlas_from_server(s.url, tokens=5, topics=topics) for _ in range(2)]
    finally:
        s.stop()
    here = atlas_from_model(opts, tokens=5, topics=topics)
    assert runs[0]["selections"] == runs[1]["selections"] == here["selections"]
    assert runs[0]["topic_tokens"] == here["topic_tokens"]
    assert local["selections"] and here["selections"] == runs[0]["selections"]


def test_a_hung_server_is_shown_as_not_answering(open_page: Any, tmp_path: Path) -> None:
    """A server that stops answering without closing its connections (stopped, a stuck loop,
    a half-open connection) left every poll waiting forever: the page said "connected" over
    frozen figures. Unanswered requests now time out: banner, red dot, greyed figures; and
    it reconnects once the server answers again."""
    srv = WebServer(tmp_path, tmp_path / "state", "--kv-slots", "0").wait_ready()
    try:
        p = open_page()
        page = p.page
        page.goto(srv.url + "/#runtime")
        page.wait_for_selector("#conn.ok")
        p.allowed.append(lambda text, url: True)  # requests cut by the timeout
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            page.wait_for_selector("#banner", state="visible", timeout=30_000)
            assert "offline" in page.inner_text("#conn")
            assert page.evaluate("document.body.classList.contains('stale')")
            p.shot("desktop-server-hung")
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        page.wait_for_selector("#banner", state="hidden", timeout=40_000)
        page.wait_for_selector("#conn.ok")
    finally:
        srv.stop()


def test_new_chat_while_an_answer_streams_starts_empty(server: WebServer, open_page: Any) -> None:
    """ "New chat" while an answer streamed: the cut answer was pushed into the new
    conversation once its request ended, and the new conversation's first request sent it
    (the model saw, and counted, an answer no longer on screen)."""
    p = open_page()
    page = p.page
    sent: list[Any] = []
    page.on(
        "request",
        lambda r: (
            sent.append(json.loads(r.post_data or "{}"))
            if r.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.goto(server.url + "/#chat")
    page.fill("#max-tokens", "300")
    page.check("#ignore-eos")
    page.fill("#prompt", "Tell me a long story")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => (document.querySelector('.msg.assistant .body') || {}).textContent?.length > 2",
        timeout=60_000,
    )
    page.click("#new-chat")
    page.wait_for_function("() => !document.querySelector('#send').disabled", timeout=30_000)
    page.uncheck("#ignore-eos")
    page.fill("#max-tokens", "3")
    page.fill("#prompt", "A new conversation")
    page.press("#prompt", "Enter")
    _wait_done(page)
    assert len(sent) == 2, sent
    assert sent[1]["messages"] == [{"role": "user", "content": "A new conversation"}], sent[1]

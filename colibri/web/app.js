/* colibri dashboard: Chat, Runtime, Brain, Atlas.
 *
 * A client of the public endpoints only (/v1/models, /v1/chat/completions, /health, /profile,
 * /experts, /atlas), so it works against any `coli serve` as well as `coli web`. Plain JS, no
 * build step, nothing fetched from outside. Polling: /experts every 1.5 s (Brain and Runtime
 * tabs), /profile every 2 s; on errors each backs off to 10 s and a banner shows until the
 * server answers again (it survives restarts).
 */
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const EXPERTS_MS = 1500;
  const PROFILE_MS = 2000;
  const MAX_BACKOFF_MS = 10000;
  const SERIES_LEN = 150;
  const TIER_ORDER = ["ram", "pinned", "lru", "disk", "worker"];
  const TIER_LABEL = {
    ram: "RAM (all resident)", pinned: "RAM pinned", lru: "RAM LRU", disk: "disk",
    worker: "expert workers (--ray)",
  };
  // tiers shown in a legend only when some expert is there
  const TIER_IF_PRESENT = new Set(["ram", "worker"]);
  // tier code (as in /experts tier_codes) -> base colour
  const TIER_RGB = {
    0: [148, 113, 82], 1: [96, 165, 250], 2: [167, 139, 250], 3: [56, 189, 148], 4: [244, 182, 76],
  };
  const TOPIC_RGB = [
    [255, 159, 67], [238, 90, 160], [99, 205, 255], [255, 221, 89],
    [120, 224, 143], [186, 140, 255], [255, 107, 107], [72, 219, 200],
    [200, 200, 120], [150, 170, 255], [255, 170, 200], [160, 230, 90],
  ];

  const state = {
    tab: "chat",
    key: localStorage.getItem("colibri.apiKey") || "",
    model: null,
    up: null, // null: unknown yet, true / false
    downSince: 0,
    profile: null,
    experts: null,
    prevCounts: null,
    engineSnaps: [], // {t, engine} from each /profile, for rates and the time breakdown
    diskPrev: new Map(), // key -> {t, bytes}
    series: { tps: [], hit: [] },
    atlas: null,
    atlasState: "unknown", // unknown | loading | ok | missing | error
  };

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // ------------------------------------------------------------------ helpers
  // binary units with one decimal, as the CLI writes them (storage/units.py)
  const fmtBytes = (n) => {
    if (n == null || !isFinite(n)) return "n/a";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) {
      n /= 1024;
      i++;
    }
    return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${u[i]}`;
  };
  const fmtRate = (n) => (n == null || !isFinite(n) ? "n/a" : `${fmtBytes(n)}/s`);
  const fmtMs = (ms) => {
    if (ms == null || !isFinite(ms)) return "n/a";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
  };
  const fmtNum = (x, d = 1) => (x == null || !isFinite(x) ? "n/a" : x.toFixed(d));
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  };
  const clamp = (x, a, b) => Math.max(a, Math.min(b, x));

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    if (state.key) h.Authorization = `Bearer ${state.key}`;
    return h;
  }

  async function errorText(res) {
    try {
      const j = await res.json();
      if (j && j.error) return j.error.message || JSON.stringify(j.error);
      return JSON.stringify(j);
    } catch (_) {
      return `HTTP ${res.status}`;
    }
  }

  /** How long a request may wait for the server's answer (its headers) before the server
   * counts as not answering: a hung server (stopped, a stuck loop, a half-open connection)
   * left every poll waiting forever, the page saying "connected" over frozen figures. */
  const ANSWER_TIMEOUT_MS = 10000;

  /** fetch with the API key; network failures and requests unanswered for
   * ``opts.timeoutMs`` (default ANSWER_TIMEOUT_MS; 0: none) mark the server down, 401 asks
   * for a key. */
  async function api(path, opts = {}) {
    const limit = opts.timeoutMs === undefined ? ANSWER_TIMEOUT_MS : opts.timeoutMs;
    const sentKey = state.key;
    const init = Object.assign({ cache: "no-store" }, opts, { headers: authHeaders(opts.headers) });
    delete init.timeoutMs;
    let timer = null;
    let timedOut = false;
    if (limit > 0) {
      const ctl = new AbortController();
      if (opts.signal) {
        if (opts.signal.aborted) ctl.abort();
        else opts.signal.addEventListener("abort", () => ctl.abort(), { once: true });
      }
      init.signal = ctl.signal;
      timer = setTimeout(() => {
        timedOut = true;
        ctl.abort();
      }, limit);
    }
    let res;
    try {
      res = await fetch(path, init);
    } catch (e) {
      if (timedOut) {
        setUp(false);
        throw new Error(`the server did not answer in ${Math.round(limit / 1000)} s`);
      }
      if (e && e.name === "AbortError") throw e;
      setUp(false);
      throw e;
    } finally {
      if (timer !== null) clearTimeout(timer);
    }
    // a proxy in front answers 502 / 504 for a server that is gone, and this server 503 while
    // it shuts down: not "up"
    if (res.status === 502 || res.status === 503 || res.status === 504) {
      setUp(false);
      throw new HttpError(res.status, `HTTP ${res.status}`);
    }
    setUp(true);
    if (res.status === 401) {
      // a late answer for a key already replaced says nothing about the one in use
      if (state.key && state.key !== sentKey) throw new HttpError(401, await errorText(res));
      if (sentKey && state.key === sentKey) {
        // the key in use was sent and refused: say so, and forget it (it stayed stored); a
        // late refusal of a key already replaced says nothing about the new one
        state.keyRefused = true;
        state.key = "";
        localStorage.removeItem("colibri.apiKey");
      }
      showKeyForm();
      throw new HttpError(401, await errorText(res));
    }
    if (!$("key-form").hidden && state.key) {
      $("key-form").hidden = true; // the key was taken
      $("conn-text").textContent = "connected";
    }
    return res;
  }

  async function getJSON(path) {
    const res = await api(path);
    if (!res.ok) throw new HttpError(res.status, await errorText(res));
    return res.json();
  }

  // ------------------------------------------------------------------ connection + banner
  function setUp(up) {
    if (state.up === up) return;
    const was = state.up;
    state.up = up;
    const conn = $("conn");
    conn.classList.toggle("ok", up);
    conn.classList.toggle("down", !up);
    $("conn-text").textContent = up ? "connected" : "offline";
    // what is on screen is the last that came before the server went away: shown as such
    document.body.classList.toggle("stale", !up);
    if (!up) {
      state.downSince = Date.now();
      updateBanner();
    } else {
      $("banner").hidden = true;
      if (was === false) onReconnect();
    }
  }

  function updateBanner() {
    if (state.up !== false) return;
    const secs = Math.round((Date.now() - state.downSince) / 1000);
    const next = Math.round(Math.max(profilePoller.delay, expertsPoller.delay) / 1000);
    const b = $("banner");
    b.textContent = `The server is not answering (for ${secs} s). Retrying every ${next} s; this page reconnects by itself.`;
    b.hidden = false;
  }
  setInterval(updateBanner, 1000);

  function onReconnect() {
    // a restarted server has fresh counters: start the deltas again
    state.engineSnaps = [];
    state.prevCounts = null;
    state.diskPrev.clear();
    loadModel().catch(() => {});
    if (state.atlasState !== "ok" || state.tab === "atlas") loadAtlas().catch(() => {});
    profilePoller.now();
    expertsPoller.now();
  }

  /** Ask for the API key, saying so when the one sent was refused (a wrong key got the same
   * form again without a word, and stayed stored). */
  function showKeyForm() {
    const f = $("key-form");
    $("key-error").hidden = !state.keyRefused;
    $("conn-text").textContent = state.keyRefused ? "API key refused" : "API key needed";
    if (!f.hidden) return;
    f.hidden = false;
    $("api-key").focus();
  }
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("api-key").value.trim();
    state.keyRefused = false;
    localStorage.setItem("colibri.apiKey", state.key);
    $("key-form").hidden = true;
    loadModel().catch(() => {});
    // the atlas's first request was refused without the key: ask again now
    if (state.atlasState !== "ok") loadAtlas().catch(() => {});
    profilePoller.now();
    expertsPoller.now();
  });

  // ------------------------------------------------------------------ polling with back-off
  function poller(fn, base, active) {
    const p = { delay: base, timer: null, busy: false, again: false };
    async function tick() {
      p.timer = null;
      if (p.busy) {
        p.again = true;
        return;
      }
      if (active && !active()) {
        p.timer = setTimeout(tick, base);
        return;
      }
      p.busy = true;
      try {
        await fn();
        p.delay = base;
      } catch (e) {
        p.delay = Math.min(MAX_BACKOFF_MS, Math.max(base * 2, p.delay * 2));
        if (!(e instanceof HttpError) && !(e instanceof TypeError)) console.warn(e);
      } finally {
        p.busy = false;
      }
      if (p.again) {
        p.again = false;
        p.timer = setTimeout(tick, 0);
        return;
      }
      p.timer = setTimeout(tick, document.hidden ? Math.max(p.delay, 5000) : p.delay);
    }
    p.start = () => {
      if (!p.timer && !p.busy) tick();
    };
    p.now = () => {
      clearTimeout(p.timer);
      p.timer = null;
      tick();
    };
    return p;
  }

  const profilePoller = poller(async () => onProfile(await getJSON("/profile?limit=16")), PROFILE_MS);
  const expertsPoller = poller(
    async () => onExperts(await getJSON("/experts")),
    EXPERTS_MS,
    () => state.tab === "brain" || state.tab === "runtime" || state.experts === null,
  );

  async function loadModel() {
    const j = await getJSON("/v1/models");
    state.model = j.data && j.data.length ? j.data[0].id : null;
    $("model-name").textContent = state.model || "";
    document.title = state.model ? `colibri · ${state.model}` : "colibri";
  }

  // ------------------------------------------------------------------ tabs
  const TABS = ["chat", "runtime", "brain", "atlas"];
  function selectTab(name, focus) {
    if (!TABS.includes(name)) name = "chat";
    state.tab = name;
    for (const t of TABS) {
      const btn = $(`tab-btn-${t}`);
      const on = t === name;
      btn.setAttribute("aria-selected", String(on));
      btn.tabIndex = on ? 0 : -1;
      $(`tab-${t}`).hidden = !on;
      if (on && focus) btn.focus();
    }
    if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
    if (name === "brain") {
      brain.resize();
      expertsPoller.now();
    } else if (name === "runtime") {
      renderRuntime();
      expertsPoller.now();
    } else if (name === "atlas") {
      if (state.atlasState !== "ok" && state.atlasState !== "loading") loadAtlas().catch(() => {});
      atlas.resize();
    }
  }
  for (const t of TABS) $(`tab-btn-${t}`).addEventListener("click", () => selectTab(t));
  document.querySelector(".tabs").addEventListener("keydown", (ev) => {
    const i = TABS.indexOf(state.tab);
    if (ev.key === "ArrowRight") selectTab(TABS[(i + 1) % TABS.length], true);
    else if (ev.key === "ArrowLeft") selectTab(TABS[(i + TABS.length - 1) % TABS.length], true);
    else return;
    ev.preventDefault();
  });
  window.addEventListener("hashchange", () => selectTab(location.hash.slice(1)));

  // ================================================================== Chat
  // ================================================================== Markdown (safe subset)
  // Answers render as Markdown once they are complete: fenced code blocks, headings, bullet and
  // numbered lists, paragraphs, `code`, **bold**, *italic*, and [links](https://...). Only DOM
  // nodes with text are built (no innerHTML), so HTML in an answer shows as text; only http(s)
  // links become links.
  function mdInline(text, parent) {
    const re = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*|_[^_\s][^_\n]*_)|(\[[^\]\n]+\]\([^)\s]+\))/g;
    let last = 0;
    let m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      const tok = m[0];
      if (m[1]) parent.appendChild(el("code", null, tok.slice(1, -1)));
      else if (m[2]) parent.appendChild(el("strong", null, tok.slice(2, -2)));
      else if (m[3]) parent.appendChild(el("em", null, tok.slice(1, -1)));
      else {
        const close = tok.indexOf("](");
        const label = tok.slice(1, close);
        const href = tok.slice(close + 2, -1);
        const scheme = href.slice(0, href.indexOf(":") + 1).toLowerCase();
        if (scheme === "https:" || scheme === "http:") {
          const a = el("a", null, label);
          a.href = href;
          a.target = "_blank";
          a.rel = "noopener noreferrer";
          parent.appendChild(a);
        } else {
          parent.appendChild(document.createTextNode(tok));
        }
      }
      last = m.index + tok.length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function renderMarkdown(text) {
    const frag = document.createDocumentFragment();
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    let list = null;
    const flush = () => {
      if (para.length) {
        const p = el("p");
        para.forEach((line, k) => {
          if (k) p.appendChild(el("br"));
          mdInline(line, p);
        });
        frag.appendChild(p);
        para = [];
      }
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flush();
        list = null;
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        const pre = el("pre");
        const c = el("code", null, code.join("\n"));
        if (fence[1]) c.dataset.lang = fence[1];
        pre.appendChild(c);
        frag.appendChild(pre);
        continue;
      }
      const h = line.match(/^(#{1,3})\s+(.*)$/);
      const ul = line.match(/^\s*[-*]\s+(.*)$/);
      const ol = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (h) {
        flush();
        list = null;
        const node = el(`h${h[1].length + 2}`);
        mdInline(h[2], node);
        frag.appendChild(node);
      } else if (ul || ol) {
        flush();
        const tag = ul ? "ul" : "ol";
        if (!list || list.tagName.toLowerCase() !== tag) {
          list = el(tag);
          frag.appendChild(list);
        }
        const li = el("li");
        mdInline((ul || ol)[1], li);
        list.appendChild(li);
      } else if (!line.trim()) {
        flush();
        list = null;
      } else {
        list = null;
        para.push(line);
      }
    }
    flush();
    return frag;
  }

  // ================================================================== Chat
  const chat = { messages: [], busy: false, ctrl: null };

  function addMessage(role) {
    $("chat-empty").hidden = true;
    const m = el("div", `msg ${role}`);
    m.appendChild(el("div", "who", role === "user" ? "you" : state.model || "assistant"));
    const think = el("div", "think");
    think.hidden = true;
    m.appendChild(think);
    const body = el("div", "body");
    m.appendChild(body);
    const stats = el("div", "stats");
    m.appendChild(stats);
    $("messages").appendChild(m);
    return { root: m, body, think, stats };
  }

  function scrollChat() {
    const box = $("messages");
    if (box.scrollHeight - box.scrollTop - box.clientHeight < 160) box.scrollTop = box.scrollHeight;
  }

  function setStats(node, items) {
    node.textContent = "";
    for (const [k, v] of items) {
      if (v == null) continue;
      const s = el("span");
      s.appendChild(document.createTextNode(`${k} `));
      s.appendChild(el("b", null, v));
      node.appendChild(s);
    }
  }

  function setBusy(busy) {
    chat.busy = busy;
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function sendMessage() {
    const input = $("prompt");
    const text = input.value.trim();
    if (!text || chat.busy) return;
    if (!state.model) {
      try {
        await loadModel();
      } catch (_) {
        /* reported below by the request itself */
      }
    }
    input.value = "";
    // "New chat" while this answer streams starts another conversation: this one must not
    // write its (cut) answer into the new one's messages (taken here, after the model
    // name's wait, so a New chat during that wait gets no orphan user turn either)
    const conversation = chat.messages;
    chat.messages.push({ role: "user", content: text });
    const u = addMessage("user");
    u.body.textContent = text;
    const a = addMessage("assistant");
    const cursor = el("span", "cursor");
    a.body.appendChild(cursor);
    scrollChat();

    const system = $("system-prompt").value.trim();
    const body = {
      model: state.model || "default",
      messages: system ? [{ role: "system", content: system }, ...chat.messages] : chat.messages.slice(),
      stream: true,
      stream_options: { include_usage: true },
    };
    const temp = parseFloat($("temperature").value);
    if (isFinite(temp)) {
      body.temperature = clamp(temp, 0, 2);
      if (body.temperature !== temp) $("temperature").value = String(body.temperature); // shown as sent
    }
    const maxTok = parseInt($("max-tokens").value, 10);
    if (isFinite(maxTok) && maxTok > 0) body.max_tokens = maxTok;
    else if ($("max-tokens").value.trim() !== "") $("max-tokens").value = ""; // none: to the context
    const slot = $("slot").value;
    if (slot !== "") body.cache_slot = parseInt(slot, 10);
    if ($("ignore-eos").checked) body.ignore_eos = true;

    const ctrl = new AbortController();
    chat.ctrl = ctrl;
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    let chunks = 0;
    let content = "";
    let reasoning = "";
    let queueWait = null;
    let usage = null;
    let extra = null;
    let finish = null;
    let stopped = false;
    let error = null;
    const textNode = document.createTextNode("");
    a.body.insertBefore(textNode, cursor);
    const thinkNode = document.createTextNode("");
    a.think.appendChild(thinkNode);

    const live = setInterval(() => {
      if (tFirst == null) {
        setStats(a.stats, [["waiting", fmtMs(performance.now() - t0)]]);
        return;
      }
      const dt = (performance.now() - tFirst) / 1000;
      setStats(a.stats, [
        ["TTFT", fmtMs(tFirst - t0)],
        ["tokens", String(chunks)],
        ["tok/s", dt > 0.05 ? fmtNum((chunks - 1) / dt) : null],
      ]);
    }, 250);

    try {
      const res = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
        signal: ctrl.signal,
        timeoutMs: 0, // a generation may wait in the queue and prefill for long: Stop ends it
      });
      const qw = res.headers.get("x-colibri-queue-wait-ms");
      if (qw != null) queueWait = parseFloat(qw);
      if (!res.ok) throw new HttpError(res.status, await errorText(res));
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      let done = false;
      while (!done) {
        const r = await reader.read();
        if (r.done) break;
        buf += decoder.decode(r.value, { stream: true }).replace(/\r\n?/g, "\n");
        let idx;
        while ((idx = buf.indexOf("\n\n")) >= 0) {
          const raw = buf.slice(0, idx);
          buf = buf.slice(idx + 2);
          const data = raw
            .split("\n")
            .filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, ""))
            .join("\n");
          if (!data) continue;
          if (data === "[DONE]") {
            done = true;
            break;
          }
          let obj;
          try {
            obj = JSON.parse(data);
          } catch (_) {
            continue;
          }
          if (obj.error) throw new HttpError(0, obj.error.message || "stream error");
          if (obj.usage) usage = obj.usage;
          if (obj.colibri) extra = obj.colibri;
          const ch = obj.choices && obj.choices[0];
          if (!ch) continue;
          const d = ch.delta || {};
          if (d.content || d.reasoning_content) {
            const now = performance.now();
            if (tFirst == null) tFirst = now;
            tLast = now;
            chunks++;
            if (d.reasoning_content) {
              reasoning += d.reasoning_content;
              thinkNode.nodeValue = reasoning;
              a.think.hidden = false;
            }
            if (d.content) {
              content += d.content;
              textNode.nodeValue = content;
            }
            scrollChat();
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
      }
    } catch (e) {
      if (e && e.name === "AbortError") stopped = true;
      else error = e;
    } finally {
      clearInterval(live);
      cursor.remove();
      setBusy(false);
      chat.ctrl = null;
    }

    if (content && !error) {
      // the whole answer is here: show it as Markdown (the raw text stays in chat.messages)
      a.body.textContent = "";
      a.body.classList.add("md");
      a.body.appendChild(renderMarkdown(content));
    }
    if (conversation !== chat.messages) {
      // a new chat began meanwhile: nothing of this one goes into it
    } else if (content || reasoning) {
      const msg = { role: "assistant", content };
      if (reasoning) msg.reasoning_content = reasoning;
      chat.messages.push(msg);
    } else {
      chat.messages.pop(); // no answer: the user turn is not part of the conversation
    }
    if (error) {
      a.root.classList.add("error");
      const lost = error instanceof TypeError;
      a.body.textContent = (content ? `${content}\n\n` : "") +
        (lost ? "The connection to the server was lost." : `Error: ${error.message}`);
    }
    const decodeS = tFirst != null && tLast != null ? (tLast - tFirst) / 1000 : 0;
    const clientTps = chunks > 1 && decodeS > 0 ? (chunks - 1) / decodeS : null;
    const tps = extra && extra.decode_tokens_per_s != null ? extra.decode_tokens_per_s : clientTps;
    const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
    setStats(a.stats, [
      ["TTFT", tFirst != null ? fmtMs(tFirst - t0) : null],
      ["tok/s", tps != null ? fmtNum(tps) : null],
      ["queue wait", queueWait != null ? fmtMs(queueWait) : null],
      ["in", usage ? String(usage.prompt_tokens) + (cached ? ` (${cached} cached)` : "") : null],
      ["out", usage ? String(usage.completion_tokens) : chunks ? `~${chunks}` : null],
      ["slot", body.cache_slot != null ? String(body.cache_slot) : null],
      ["", stopped ? "stopped" : finish ? finish : null],
    ]);
    a.root.dataset.done = stopped ? "stopped" : error ? "error" : "ok";
    scrollChat();
    profilePoller.now();
    if (state.tab === "brain" || state.tab === "runtime") expertsPoller.now();
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sendMessage();
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      sendMessage();
    }
  });
  $("stop").addEventListener("click", () => {
    if (chat.ctrl) chat.ctrl.abort();
  });
  $("new-chat").addEventListener("click", () => {
    if (chat.ctrl) chat.ctrl.abort();
    chat.messages = [];
    for (const m of [...$("messages").querySelectorAll(".msg")]) m.remove();
    $("chat-empty").hidden = false;
    $("prompt").focus();
  });

  function updateSlots(slots) {
    const sel = $("slot");
    const n = slots ? slots.length : 0;
    if (sel.options.length !== n + 1) {
      const keep = sel.value;
      while (sel.options.length > 1) sel.remove(1);
      for (let i = 0; i < n; i++) sel.add(new Option(String(i), String(i)));
      sel.value = keep !== "" && Number(keep) < n ? keep : "";
    }
    for (let i = 0; i < n; i++) {
      const s = slots[i];
      const label = `${s.slot}${s.tokens ? ` · ${s.tokens} tok` : ""}${s.busy ? " · busy" : ""}`;
      if (sel.options[i + 1].text !== label) sel.options[i + 1].text = label;
    }
  }

  // ================================================================== Runtime
  function onProfile(p) {
    const t = performance.now() / 1000;
    const prev = state.engineSnaps.length ? state.engineSnaps[state.engineSnaps.length - 1] : null;
    if (prev && p.engine.forward_calls < prev.engine.forward_calls) state.engineSnaps = []; // restarted
    state.engineSnaps.push({ t, engine: p.engine, machine: p.machine });
    while (state.engineSnaps.length > 2 && t - state.engineSnaps[0].t > 65) state.engineSnaps.shift();
    state.profile = p;
    if (!state.model && p.model) {
      state.model = p.model;
      $("model-name").textContent = p.model;
    }
    updateSlots(p.slots);
    // trend series (deltas against the previous poll)
    const last = state.engineSnaps.length > 1 ? state.engineSnaps[state.engineSnaps.length - 2] : null;
    if (last) {
      const dt = t - last.t;
      const e = p.engine;
      const l = last.engine;
      pushSeries("tps", dt > 0 ? Math.max(0, (e.generated_tokens - l.generated_tokens) / dt) : 0);
      let hit = null;
      if (e.experts && e.experts.mode === "streaming" && l.experts) {
        const hits = (e.experts.hits_pinned + e.experts.hits_lru) - (l.experts.hits_pinned + l.experts.hits_lru);
        const miss = e.experts.misses - l.experts.misses;
        hit = hits + miss > 0 ? hits / (hits + miss) : null;
      } else if (e.experts && e.experts.mode === "resident") {
        hit = 1;
      }
      pushSeries("hit", hit);
    }
    if (state.tab === "runtime") renderRuntime();
  }

  function pushSeries(name, v) {
    const s = state.series[name];
    s.push(v);
    if (s.length > SERIES_LEN) s.shift();
  }

  function kvList(node, items) {
    node.textContent = "";
    for (const [k, v] of items) {
      node.appendChild(el("dt", null, k));
      node.appendChild(el("dd", null, v == null ? "n/a" : String(v)));
    }
  }

  function renderRuntime() {
    const p = state.profile;
    if (p) {
      const m = p.machine || {};
      const ex = p.engine.experts || {};
      kvList($("machine"), [
        ["model", p.model],
        ["CPU", m.cpu_model || "unknown"],
        ["cores", m.cpu_count],
        ["RAM", m.ram_total_bytes ? `${fmtBytes(m.ram_total_bytes)} (${fmtBytes(m.ram_available_bytes)} available)` : null],
        ["experts", p.engine.cluster && (p.engine.cluster.workers || []).length
          ? `on ${p.engine.cluster.workers.length} expert workers (--ray)`
          : ex.mode === "streaming" ? `streaming (${ex.reader || "reader"})` : "all resident in RAM"],
        ["context", `${p.context_length} tokens`],
        ["expert size", expertSize(m)],
      ]);
      renderDisks(p);
      renderCluster(p.engine.cluster);
      renderTurns(p.turns || []);
      renderTime();
      const q = p.queue;
      $("queue").textContent = `${q.running} running · ${q.waiting} waiting (limit ${q.limit}, ${q.parallel} at once)`;
      const tb = $("slots").tBodies[0];
      tb.textContent = "";
      for (const s of p.slots || []) {
        const tr = el("tr");
        for (const v of [s.slot, s.tokens, s.persisted_tokens, s.turns, s.busy ? "busy" : s.loaded ? "loaded" : "idle"]) {
          tr.appendChild(el("td", null, String(v)));
        }
        tb.appendChild(tr);
      }
      if (!(p.slots || []).length) {
        const tr = el("tr");
        const td = el("td", "muted", "no KV slots (--kv-slots 0)");
        td.colSpan = 5;
        tr.appendChild(td);
        tb.appendChild(tr);
      }
    }
    renderTiers();
    const tps = state.series.tps;
    const hit = state.series.hit;
    $("tps-now").textContent = tps.length ? `${fmtNum(tps[tps.length - 1])} now` : "";
    const lastHit = hit.length ? hit[hit.length - 1] : null;
    $("hit-now").textContent = lastHit != null ? `${(lastHit * 100).toFixed(1)}% now` : "";
    drawChart($("chart-tps"), tps, { color: "#3fb8af", fmt: (v) => fmtNum(v) });
    drawChart($("chart-hit"), hit, { color: "#7aa2f7", max: 1, fmt: (v) => `${Math.round(v * 100)}%` });
  }

  // --ray: one row per expert worker (runtime/cluster/), hidden without a cluster.
  function renderCluster(c) {
    const card = $("cluster-card");
    card.hidden = !c;
    if (!c) return;
    $("cluster-note").textContent = `${c.workers.length} on ${c.address} · ${c.fallback_experts} experts computed here for a down or late worker`;
    const tb = $("cluster").tBodies[0];
    tb.textContent = "";
    for (const w of c.workers) {
      const tr = el("tr");
      const failures = w.failures + w.timeouts ? `${w.failures} failed · ${w.timeouts} late · ${w.rejoins} back` : "0";
      const cells = [
        w.name,
        w.alive ? `up · ${w.mode || "?"}` : "down",
        String(w.experts_owned),
        String(w.calls),
        `${fmtNum(w.call_ms_mean)} ms`,
        `${fmtNum(w.overhead_ms_mean)} ms`,
        String(w.hits),
        w.reads ? `${w.reads} (${fmtBytes(w.bytes_read)})` : "0",
        failures,
      ];
      for (const v of cells) tr.appendChild(el("td", null, v));
      if (!w.alive) tr.title = w.last_error;
      tb.appendChild(tr);
    }
  }

  /** One expert's size, or the range when MoE layers store theirs differently. */
  function expertSize(m) {
    const r = m.expert_bytes_range;
    if (r && r[0] && r[0] !== r[1]) return `${fmtBytes(r[0])} – ${fmtBytes(r[1])} (by layer)`;
    return m.expert_bytes ? fmtBytes(m.expert_bytes) : null;
  }

  function renderDisks(p) {
    const snaps = state.engineSnaps;
    // none right after a reconnect (the counters start again): no rates until a poll lands
    const now = snaps.length ? snaps[snaps.length - 1] : null;
    const tb = $("disks").tBodies[0];
    tb.textContent = "";
    const disks = (p.machine && p.machine.disks) || [];
    for (const d of disks) {
      const key = d.path;
      let rate = null;
      const prev = state.diskPrev.get(key);
      if (now && d.read_bytes != null && prev && now.t > prev.t && d.read_bytes >= prev.bytes) {
        rate = (d.read_bytes - prev.bytes) / (now.t - prev.t);
      }
      if (now && (!prev || prev.t !== now.t)) state.diskPrev.set(key, { t: now.t, bytes: d.read_bytes, rate });
      const shown = rate != null ? rate : now && prev && prev.t === now.t ? prev.rate : null;
      const tr = el("tr");
      const c1 = el("td");
      c1.appendChild(el("div", null, d.role));
      c1.appendChild(el("div", "muted small mono", d.path));
      tr.appendChild(c1);
      const dev = [d.block_device || d.name || "?", d.fstype].filter(Boolean).join(" · ");
      tr.appendChild(el("td", null, dev));
      tr.appendChild(el("td", null, d.read_bytes == null ? "not a block device" : fmtRate(shown)));
      tb.appendChild(tr);
    }
    const ex = p.engine.experts || {};
    const io = $("expert-io");
    if (ex.mode !== "streaming") {
      io.textContent = "Every routed expert is in RAM: no expert reads.";
    } else {
      let rate = null;
      const first = snaps.length > 1 ? snaps[snaps.length - 2] : null;
      if (now && first && first.engine.experts && now.t > first.t) {
        rate = (ex.bytes_read - first.engine.experts.bytes_read) / (now.t - first.t);
      }
      io.textContent = `Expert reads: ${fmtRate(rate)} now · ${fmtBytes(ex.bytes_read)} in ${ex.experts_read} experts since start · hit rate ${ex.hit_rate == null ? "n/a (no lookup yet)" : `${(100 * ex.hit_rate).toFixed(1)}%`} · ${ex.reader}`;
    }
  }

  function renderTurns(turns) {
    const box = $("turns");
    box.textContent = "";
    const shown = turns.slice(0, 8);
    if (!shown.length) {
      box.appendChild(el("div", "muted", "No turns yet."));
      return;
    }
    const max = Math.max(...shown.map((t) => t.total_ms || 0), 1);
    for (const t of shown) {
      const row = el("div", "turn");
      const when = new Date(t.started * 1000).toLocaleTimeString();
      row.appendChild(el("div", "muted", `${when} · ${t.finish_reason}${t.slot != null ? ` · slot ${t.slot}` : ""}`));
      const bar = el("div", "bar");
      const q = t.queue_wait_ms || 0;
      const pre = t.prefill_ms || 0;
      const dec = Math.max(0, (t.total_ms || 0) - q - pre);
      for (const [cls, v, name] of [["c-queue", q, "queue"], ["c-prefill", pre, "prefill"], ["c-decode", dec, "decode"]]) {
        const s = el("span", cls);
        s.style.width = `${(100 * v) / max}%`;
        s.title = `${name} ${fmtMs(v)}`;
        bar.appendChild(s);
      }
      row.appendChild(bar);
      const tps = t.decode_tokens_per_s != null ? ` · ${fmtNum(t.decode_tokens_per_s)} tok/s` : "";
      row.appendChild(el("div", null, `${fmtMs(t.total_ms)} · ${t.prompt_tokens}→${t.completion_tokens} tok${tps}`));
      box.appendChild(row);
    }
  }

  function renderTime() {
    // where the engine's time went over the last minute (counter deltas between polls)
    const snaps = state.engineSnaps;
    const bar = $("timebar");
    const legend = $("time-legend");
    bar.textContent = "";
    legend.textContent = "";
    if (snaps.length < 2) {
      $("time-note").textContent = "(collecting)";
      return;
    }
    const a = snaps[0];
    const b = snaps[snaps.length - 1];
    const wall = b.t - a.t;
    const e = b.engine;
    const f = a.engine;
    const d = (g) => Math.max(0, g(e) - g(f));
    const compute = d((x) => x.compute_seconds || 0);
    const t = (k) => d((x) => (x.time && x.time[k]) || 0);
    const readDemand = t("read_wait_demand_s");
    const readAhead = t("read_wait_lookahead_s");
    const experts = t("expert_compute_s");
    const dense = t("dense_compute_s");
    const handoff = t("other_s");
    const prefill = d((x) => x.prefill_seconds || 0);
    const idle = Math.max(0, wall - compute);
    $("time-note").textContent = `last ${Math.round(wall)} s · prefill ${fmtMs(prefill * 1000)} of it`;
    const parts = [
      ["c-read", readDemand, "waiting for expert reads"],
      ["c-ahead", readAhead, "waiting for a lookahead read"],
      ["c-experts", experts, "expert compute"],
      ["c-compute", dense, "attention, dense layers, LM head"],
      ["c-draft", handoff, "thread hand-off"],
      ["c-other", idle, "idle / outside the engine"],
    ];
    const total = parts.reduce((s, x) => s + x[1], 0) || 1;
    for (const [cls, v, name] of parts) {
      const s = el("span", cls);
      s.style.width = `${(100 * v) / total}%`;
      s.title = `${name}: ${fmtMs(v * 1000)}`;
      bar.appendChild(s);
      const item = el("span");
      item.appendChild(el("i", cls));
      item.appendChild(document.createTextNode(`${name} ${fmtMs(v * 1000)} (${Math.round((100 * v) / total)}%)`));
      legend.appendChild(item);
    }
  }

  function renderTiers() {
    const ex = state.experts;
    const bar = $("tierbar");
    const legend = $("tier-legend");
    bar.textContent = "";
    legend.textContent = "";
    if (!ex) return;
    const counts = { ram: 0, pinned: 0, lru: 0, disk: 0, worker: 0 };
    // bytes per tier: each expert at its own layer's size (an MTP layer's may be larger)
    const bytes = { ram: 0, pinned: 0, lru: 0, disk: 0, worker: 0 };
    const sizes = ex.layer_expert_bytes || [];
    let allBytes = 0;
    ex.tiers.forEach((row, i) => {
      const b = sizes[i] != null ? sizes[i] : ex.expert_bytes || 0;
      for (const t of row) {
        counts[t] = (counts[t] || 0) + 1;
        bytes[t] = (bytes[t] || 0) + b;
        allBytes += b;
      }
    });
    const total = ex.tiers.reduce((s, r) => s + r.length, 0) || 1;
    const eb = allBytes > 0;
    $("tier-total").textContent = `${total} experts${eb ? ` · ${fmtBytes(allBytes)}` : ""}`;
    for (const t of TIER_ORDER) {
      if (!counts[t]) continue;
      const s = el("span", `t-${t}`);
      s.style.width = `${(100 * counts[t]) / total}%`;
      s.title = `${TIER_LABEL[t]}: ${counts[t]}`;
      bar.appendChild(s);
    }
    for (const t of TIER_ORDER) {
      if (!counts[t] && t === "worker") continue; // (only under --ray)
      const item = el("span");
      item.appendChild(el("i", `t-${t}`));
      const n = counts[t] || 0;
      item.appendChild(document.createTextNode(`${TIER_LABEL[t]}: ${n}${eb ? ` · ${fmtBytes(bytes[t] || 0)}` : ""}`));
      legend.appendChild(item);
    }
    const v = el("span", "muted", "VRAM: none (CPU engine)");
    legend.appendChild(v);
  }

  /** A line chart of the last SERIES_LEN points (nulls are gaps). */
  function drawChart(canvas, data, opt) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    if (!w || !h) return;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const vals = data.filter((v) => v != null);
    const max = opt.max || Math.max(1, ...vals) * 1.15;
    const padT = 14;
    const padB = 4;
    const y = (v) => padT + (h - padT - padB) * (1 - v / max);
    const x = (i) => (w * (i + SERIES_LEN - data.length)) / (SERIES_LEN - 1);
    ctx.strokeStyle = "#2a3442";
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      ctx.beginPath();
      ctx.moveTo(0, Math.round(y(max * f)) + 0.5);
      ctx.lineTo(w, Math.round(y(max * f)) + 0.5);
      ctx.stroke();
    }
    ctx.fillStyle = "#8b98a8";
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillText(opt.fmt(max), 4, 11);
    if (!vals.length) {
      ctx.fillText("waiting for data", w / 2 - 40, h / 2);
      return;
    }
    ctx.strokeStyle = opt.color;
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    let pen = false;
    data.forEach((v, i) => {
      if (v == null) {
        pen = false;
        return;
      }
      if (pen) ctx.lineTo(x(i), y(v));
      else ctx.moveTo(x(i), y(v));
      pen = true;
    });
    ctx.stroke();
    ctx.globalAlpha = 0.12;
    ctx.fillStyle = opt.color;
    ctx.beginPath();
    let start = null;
    data.forEach((v, i) => {
      if (v == null) return;
      if (start == null) {
        start = i;
        ctx.moveTo(x(i), h - padB);
      }
      ctx.lineTo(x(i), y(v));
    });
    if (start != null) {
      ctx.lineTo(x(data.length - 1), h - padB);
      ctx.closePath();
      ctx.fill();
    }
    ctx.globalAlpha = 1;
  }

  // ================================================================== Experts -> Brain
  function onExperts(ex) {
    const L = ex.layers.length;
    const E = ex.n_experts;
    const counts = new Float64Array(L * E);
    let haveCounts = false;
    if (ex.counts) {
      haveCounts = true;
      for (let l = 0; l < L; l++) {
        const row = ex.counts[l] || [];
        for (let e = 0; e < E; e++) counts[l * E + e] = row[e] || 0;
      }
    }
    const prev = state.prevCounts;
    const routed = new Uint8Array(L * E);
    let nRouted = 0;
    if (prev && prev.length === counts.length && haveCounts) {
      for (let i = 0; i < counts.length; i++) {
        if (counts[i] > prev[i]) {
          routed[i] = 1;
          nRouted++;
        }
      }
    }
    state.prevCounts = haveCounts ? counts : null;
    state.experts = ex;
    brain.setData(ex, haveCounts ? counts : null, routed, nRouted);
    if (state.tab === "runtime") renderTiers();
  }

  const brain = (() => {
    const canvas = $("brain");
    const wrap = $("brain-wrap");
    const tip = $("brain-tip");
    const off = document.createElement("canvas");
    const b = {
      L: 0, E: 0, layers: [], code: null, counts: null, flash: null, img: null,
      cellW: 1, cellH: 1, hover: -1, anim: false, lastT: 0, updates: 0, routedTotal: 0,
    };

    b.setData = (ex, counts, routed, nRouted) => {
      const L = ex.layers.length;
      const E = ex.n_experts;
      if (L !== b.L || E !== b.E || !b.img) {
        b.L = L;
        b.E = E;
        b.flash = new Float32Array(L * E);
        off.width = E;
        off.height = L;
        b.img = off.getContext("2d").createImageData(E, L);
        b.code = new Uint8Array(L * E);
        b.resize();
      }
      b.layers = ex.layers;
      for (let l = 0; l < L; l++) {
        const row = ex.codes[l];
        for (let e = 0; e < E; e++) b.code[l * E + e] = row[e];
      }
      b.counts = counts;
      for (let i = 0; i < routed.length; i++) if (routed[i]) b.flash[i] = 1;
      b.updates++;
      b.routedTotal = nRouted;
      canvas.dataset.updates = String(b.updates);
      canvas.dataset.routed = String(nRouted);
      const mode = ex.mode === "cluster" ? "on expert workers" : ex.mode === "streaming" ? "streaming" : "all resident";
      b.legend(ex);
      $("brain-title").textContent = `${L} MoE layer${L === 1 ? "" : "s"} × ${E} experts`;
      $("brain-info").textContent = `${(L * E).toLocaleString()} cells · ${mode} · routed since last update: ${nRouted}${counts ? "" : " (no routing counts: learning is off)"}`;
      b.kick();
      if (b.hover >= 0) b.showTip(b.hover);
    };

    // The legend: each tier's colour (as the cells draw it) and how many experts are there,
    // then what brightness and the white flash mean.
    b.legend = (ex) => {
      const legend = $("brain-legend");
      const n = {};
      for (const row of ex.tiers) for (const t of row) n[t] = (n[t] || 0) + 1;
      const codes = ex.tier_codes || { disk: 0, lru: 1, pinned: 2, ram: 3, worker: 4 };
      legend.textContent = "";
      for (const t of TIER_ORDER) {
        if (!n[t] && TIER_IF_PRESENT.has(t)) continue; // "all resident", workers: only when so
        const item = el("span", "legend-tier");
        item.dataset.tier = t;
        const sw = el("i");
        const rgb = TIER_RGB[codes[t]] || TIER_RGB[0];
        sw.style.background = `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
        item.appendChild(sw);
        item.appendChild(document.createTextNode(`${TIER_LABEL[t]}: ${n[t] || 0}`));
        legend.appendChild(item);
      }
      legend.appendChild(el("span", "muted", "brighter = routed more"));
      legend.appendChild(el("span", "muted", "white = routed since the last update"));
    };

    b.resize = () => {
      if (!b.L || state.tab !== "brain") return;
      const dpr = window.devicePixelRatio || 1;
      const w = wrap.clientWidth;
      if (!w) return;
      b.cellW = w / b.E;
      b.cellH = clamp(b.cellW * 0.9, 5, 30);
      const h = Math.round(b.cellH * b.L);
      canvas.style.height = `${h}px`;
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
      b.draw();
    };

    b.draw = () => {
      if (!b.img) return;
      const n = b.L * b.E;
      const px = new Uint32Array(b.img.data.buffer);
      let maxHeat = 1;
      for (let i = 0; i < n; i++) maxHeat = Math.max(maxHeat, b.code[i] & 63);
      for (let i = 0; i < n; i++) {
        const c = b.code[i];
        const base = TIER_RGB[c >> 6] || TIER_RGB[0];
        const heat = (c & 63) / maxHeat;
        const k = 0.14 + 0.86 * heat;
        const f = b.flash[i];
        let r = base[0] * k;
        let g = base[1] * k;
        let bl = base[2] * k;
        if (f > 0) {
          r += (255 - r) * f;
          g += (255 - g) * f;
          bl += (255 - bl) * f;
        }
        px[i] = 0xff000000 | (bl << 16) | (g << 8) | r; // little-endian RGBA
      }
      off.getContext("2d").putImageData(b.img, 0, 0);
      const ctx = canvas.getContext("2d");
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
      const sx = canvas.width / b.E;
      const sy = canvas.height / b.L;
      if (sx >= 5 && sy >= 5) {
        // cell gaps: one rect per column and per row
        ctx.fillStyle = "#080b10";
        for (let e = 1; e < b.E; e++) ctx.fillRect(Math.round(e * sx) - 1, 0, 1, canvas.height);
        for (let l = 1; l < b.L; l++) ctx.fillRect(0, Math.round(l * sy) - 1, canvas.width, 1);
      }
      if (b.hover >= 0) {
        const l = Math.floor(b.hover / b.E);
        const e = b.hover % b.E;
        ctx.strokeStyle = "#ffffff";
        ctx.lineWidth = Math.max(1, (window.devicePixelRatio || 1) * 1.5);
        ctx.strokeRect(e * sx + 0.5, l * sy + 0.5, Math.max(2, sx - 1), Math.max(2, sy - 1));
      }
    };

    b.kick = () => {
      if (b.anim) return;
      b.anim = true;
      b.lastT = performance.now();
      requestAnimationFrame(b.frame);
    };

    b.frame = (now) => {
      const dt = Math.min(0.1, (now - b.lastT) / 1000);
      b.lastT = now;
      let live = false;
      if (b.flash) {
        const decay = dt / 1.2; // a flash fades in 1.2 s
        for (let i = 0; i < b.flash.length; i++) {
          if (b.flash[i] > 0) {
            b.flash[i] = Math.max(0, b.flash[i] - decay);
            live = true;
          }
        }
      }
      if (state.tab === "brain" && !document.hidden) b.draw();
      if (live) requestAnimationFrame(b.frame);
      else b.anim = false;
    };

    b.showTip = (i) => {
      const l = Math.floor(i / b.E);
      const e = i % b.E;
      const ex = state.experts;
      const tier = ex.tiers[l][e];
      const layer = b.layers[l];
      tip.textContent = "";
      const line = (k, v) => {
        const d = el("div");
        if (k) d.appendChild(document.createTextNode(`${k} `));
        d.appendChild(el("b", null, v));
        tip.appendChild(d);
      };
      line("", `layer ${layer} · expert ${e}`);
      line("tier", TIER_LABEL[tier] || tier);
      line("selections", b.counts ? b.counts[i].toLocaleString() : "not kept");
      line("heat", `log₂ ${b.code[i] & 63}`);
      if (b.flash[i] > 0) line("", "routed since the last update");
      const aff = atlasAffinity(layer, e);
      if (aff) line("topic", aff);
      tip.hidden = false;
      tip.dataset.layer = String(layer);
      tip.dataset.expert = String(e);
    };

    canvas.addEventListener("pointermove", (ev) => {
      if (!b.L) return;
      const r = canvas.getBoundingClientRect();
      const x = ev.clientX - r.left;
      const y = ev.clientY - r.top;
      const e = Math.floor((x / r.width) * b.E);
      const l = Math.floor((y / r.height) * b.L);
      if (e < 0 || l < 0 || e >= b.E || l >= b.L) return;
      const i = l * b.E + e;
      if (i !== b.hover) {
        b.hover = i;
        b.showTip(i);
        b.draw();
      }
      // Fixed to the viewport, so a grid of one or two rows does not clip it.
      const tw = tip.offsetWidth;
      const th = tip.offsetHeight;
      const vw = document.documentElement.clientWidth;
      const vh = document.documentElement.clientHeight;
      let tx = ev.clientX + 14;
      let ty = ev.clientY + 14;
      if (tx + tw > vw - 4) tx = ev.clientX - tw - 14;
      if (ty + th > vh - 4) ty = ev.clientY - th - 14;
      tip.style.left = `${clamp(tx, 4, Math.max(4, vw - tw - 4))}px`;
      tip.style.top = `${clamp(ty, 4, Math.max(4, vh - th - 4))}px`;
    });
    canvas.addEventListener("pointerleave", () => {
      b.hover = -1;
      tip.hidden = true;
      b.draw();
    });
    return b;
  })();

  // ================================================================== Atlas
  async function loadAtlas() {
    state.atlasState = "loading";
    let res;
    try {
      // (a missing atlas answers 200 with the commands that build it: no console error)
      res = await api("/atlas?missing=ok");
    } catch (e) {
      state.atlasState = "error";
      throw e;
    }
    if (!res.ok) {
      state.atlasState = "error";
      throw new HttpError(res.status, await errorText(res));
    }
    const a = await res.json();
    if (a.missing) {
      state.atlasState = "missing";
      state.atlas = null;
      // this server's own commands (its model and state dir): the fixed hint left out
      // --state-dir, and the atlas it led to went where this server never looks
      if (Array.isArray(a.commands)) $("atlas-commands").textContent = a.commands.join("\n");
      $("atlas-missing").hidden = false;
      $("atlas-view").hidden = true;
      return;
    }
    if (a.format !== "colibri-atlas") {
      state.atlasState = "error";
      throw new Error("not a colibri atlas");
    }
    state.atlas = a;
    state.atlasState = "ok";
    $("atlas-missing").hidden = true;
    $("atlas-view").hidden = false;
    atlas.setData(a);
    atlas.resize();
  }
  $("atlas-retry").addEventListener("click", () => loadAtlas().catch(() => {}));

  function atlasAffinity(layer, expert) {
    const a = state.atlas;
    if (!a) return null;
    const li = a.layers.indexOf(layer);
    if (li < 0 || expert >= a.n_experts) return null;
    const i = li * a.n_experts + expert;
    const dom = a.dominant[i];
    if (dom < 0) return "never routed in the atlas run";
    const aff = a.affinity[i];
    const top = aff
      .map((v, t) => [v, t])
      .sort((x, y) => y[0] - x[0])
      .slice(0, 3)
      .filter((x) => x[0] > 0)
      .map(([v, t]) => `${a.topics[t]} ${Math.round(v * 100)}%`);
    return top.join(" · ");
  }

  const atlas = (() => {
    const canvas = $("atlas");
    const wrap = $("atlas-wrap");
    const tip = $("atlas-tip");
    const v = {
      n: 0, pos: null, dom: null, size: null, sx: null, sy: null, vis: null, order: null,
      yaw: 0.7, pitch: 0.35, zoom: 1, filter: -1, hover: -1, drag: null, pending: false, T: 0,
    };
    const BUCKETS = 12;

    v.setData = (a) => {
      const n = a.position.length;
      v.n = n;
      v.T = a.topics.length;
      v.pos = new Float32Array(n * 3);
      v.dom = new Int16Array(n);
      v.size = new Float32Array(n);
      v.sx = new Float32Array(n);
      v.sy = new Float32Array(n);
      v.vis = new Uint8Array(n);
      v.order = new Uint32Array(n);
      v.key = new Uint16Array(n);
      let maxSel = 1;
      const scale = clamp(60 / Math.sqrt(Math.max(1, n)), 1, 4); // few experts: bigger dots
      v.round = n <= 4000; // circles when cheap enough, squares for GLM-sized atlases
      for (let i = 0; i < n; i++) maxSel = Math.max(maxSel, a.selections[i] || 0);
      for (let i = 0; i < n; i++) {
        const p = a.position[i];
        v.pos[3 * i] = p[0];
        v.pos[3 * i + 1] = p[1];
        v.pos[3 * i + 2] = p[2];
        v.dom[i] = a.dominant[i];
        v.size[i] = scale * (0.8 + 2.6 * (Math.log2((a.selections[i] || 0) + 1) / Math.log2(maxSel + 1)));
      }
      // palette per (depth bucket, topic): colour strings built once
      v.styles = [];
      for (let bk = 0; bk < BUCKETS; bk++) {
        const k = 0.35 + (0.65 * bk) / (BUCKETS - 1);
        for (let t = -1; t < v.T; t++) {
          const c = t < 0 ? [90, 98, 110] : TOPIC_RGB[t % TOPIC_RGB.length];
          v.styles.push(`rgb(${Math.round(c[0] * k)},${Math.round(c[1] * k)},${Math.round(c[2] * k)})`);
        }
      }
      const when = a.created ? new Date(a.created * 1000).toLocaleString() : "";
      const ev = (a.explained_variance || []).map((x) => `${Math.round(x * 100)}%`).join(" / ");
      const routed = a.dominant.filter((d) => d >= 0).length;
      $("atlas-info").textContent = `${a.model} · ${n.toLocaleString()} experts (${routed.toLocaleString()} routed) · ${a.topics.length} topics · PCA ${ev} · ${when}`;
      const legend = $("atlas-legend");
      legend.textContent = "";
      const counts = new Array(v.T).fill(0);
      for (const d of a.dominant) if (d >= 0) counts[d]++;
      a.topics.forEach((name, t) => {
        const btn = el("button");
        btn.type = "button";
        btn.setAttribute("aria-pressed", "false");
        const c = TOPIC_RGB[t % TOPIC_RGB.length];
        const sw = el("i");
        sw.style.background = `rgb(${c[0]},${c[1]},${c[2]})`;
        btn.appendChild(sw);
        btn.appendChild(document.createTextNode(`${name} ${counts[t]}`));
        btn.addEventListener("click", () => {
          v.filter = v.filter === t ? -1 : t;
          for (const b of legend.querySelectorAll("button")) b.setAttribute("aria-pressed", "false");
          if (v.filter >= 0) btn.setAttribute("aria-pressed", "true");
          v.request();
        });
        legend.appendChild(btn);
      });
      v.request();
    };

    v.resize = () => {
      if (state.tab !== "atlas" || !v.n) return;
      const dpr = window.devicePixelRatio || 1;
      const w = canvas.clientWidth;
      const h = canvas.clientHeight;
      if (!w || !h) return;
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
      v.draw();
    };

    v.request = () => {
      if (v.pending) return;
      v.pending = true;
      requestAnimationFrame(() => {
        v.pending = false;
        v.draw();
      });
    };

    v.draw = () => {
      if (!v.n || state.tab !== "atlas") return;
      const ctx = canvas.getContext("2d");
      const W = canvas.width;
      const H = canvas.height;
      const dpr = window.devicePixelRatio || 1;
      ctx.fillStyle = "#080b10";
      ctx.fillRect(0, 0, W, H);
      const cy = Math.cos(v.yaw);
      const sy = Math.sin(v.yaw);
      const cp = Math.cos(v.pitch);
      const sp = Math.sin(v.pitch);
      const R = 0.42 * Math.min(W, H) * v.zoom;
      const cx0 = W / 2;
      const cy0 = H / 2;
      const D = 3.2;
      const project = (x, y, z, out) => {
        const x1 = cy * x + sy * z;
        const z1 = -sy * x + cy * z;
        const y1 = cp * y - sp * z1;
        const z2 = sp * y + cp * z1;
        const f = D / (D - z2);
        out[0] = cx0 + x1 * R * f;
        out[1] = cy0 - y1 * R * f;
        out[2] = z2;
        out[3] = f;
      };
      const tmp = [0, 0, 0, 0];
      // axes
      ctx.lineWidth = dpr;
      ctx.font = `${11 * dpr}px system-ui, sans-serif`;
      const axes = [[1, 0, 0, "PC1"], [0, 1, 0, "PC2"], [0, 0, 1, "PC3"]];
      for (const [ax, ay, az, name] of axes) {
        project(-ax, -ay, -az, tmp);
        const x0 = tmp[0];
        const y0 = tmp[1];
        project(ax, ay, az, tmp);
        ctx.strokeStyle = "rgba(139,152,168,0.25)";
        ctx.beginPath();
        ctx.moveTo(x0, y0);
        ctx.lineTo(tmp[0], tmp[1]);
        ctx.stroke();
        ctx.fillStyle = "rgba(139,152,168,0.6)";
        ctx.fillText(name, tmp[0] + 4 * dpr, tmp[1]);
      }
      // project every point and bucket it by depth (far first) and topic: few style changes
      const n = v.n;
      const nKeys = BUCKETS * (v.T + 1);
      const hist = new Uint32Array(nKeys + 1);
      for (let i = 0; i < n; i++) {
        project(v.pos[3 * i], v.pos[3 * i + 1], v.pos[3 * i + 2], tmp);
        v.sx[i] = tmp[0];
        v.sy[i] = tmp[1];
        const depth = clamp(Math.floor(((tmp[2] + 1) / 2) * BUCKETS), 0, BUCKETS - 1);
        const key = depth * (v.T + 1) + (v.dom[i] + 1);
        v.key[i] = key;
        v.vis[i] = Math.round(tmp[3] * 100);
        hist[key + 1]++;
      }
      for (let k = 0; k < nKeys; k++) hist[k + 1] += hist[k];
      for (let i = 0; i < n; i++) v.order[hist[v.key[i]]++] = i;
      // one path per (depth, topic, dimmed) run: few fills and style changes per frame
      let style = -1;
      let dimStyle = false;
      let open = false;
      const flush = () => {
        if (!open) return;
        ctx.globalAlpha = dimStyle ? 0.15 : 1;
        ctx.fill();
        open = false;
      };
      for (let j = 0; j < n; j++) {
        const i = v.order[j];
        const key = v.key[i];
        const dimmed = v.filter >= 0 && v.dom[i] !== v.filter;
        if (key !== style || dimmed !== dimStyle) {
          flush();
          ctx.fillStyle = v.styles[key];
          style = key;
          dimStyle = dimmed;
        }
        if (!open) {
          ctx.beginPath();
          open = true;
        }
        const s = v.size[i] * (v.vis[i] / 100) * dpr * (dimmed ? 0.6 : 1);
        if (v.round) {
          ctx.moveTo(v.sx[i] + s / 2, v.sy[i]);
          ctx.arc(v.sx[i], v.sy[i], s / 2, 0, 2 * Math.PI);
        } else {
          ctx.rect(v.sx[i] - s / 2, v.sy[i] - s / 2, s, s);
        }
      }
      flush();
      ctx.globalAlpha = 1;
      if (v.hover >= 0) {
        const s = (v.size[v.hover] + 5) * dpr;
        ctx.strokeStyle = "#fff";
        ctx.lineWidth = 1.5 * dpr;
        ctx.strokeRect(v.sx[v.hover] - s / 2, v.sy[v.hover] - s / 2, s, s);
      }
      canvas.dataset.yaw = v.yaw.toFixed(3);
      canvas.dataset.pitch = v.pitch.toFixed(3);
    };

    v.rotate = (dx, dy) => {
      v.yaw += dx;
      v.pitch = clamp(v.pitch + dy, -1.5, 1.5);
      v.request();
    };

    canvas.addEventListener("pointerdown", (ev) => {
      v.drag = { x: ev.clientX, y: ev.clientY };
      canvas.setPointerCapture(ev.pointerId);
      canvas.classList.add("dragging");
      tip.hidden = true;
    });
    canvas.addEventListener("pointermove", (ev) => {
      if (v.drag) {
        v.rotate((ev.clientX - v.drag.x) * 0.01, (ev.clientY - v.drag.y) * 0.01);
        v.drag = { x: ev.clientX, y: ev.clientY };
        return;
      }
      v.pick(ev);
    });
    const endDrag = (ev) => {
      if (!v.drag) return;
      v.drag = null;
      canvas.classList.remove("dragging");
      if (canvas.hasPointerCapture(ev.pointerId)) canvas.releasePointerCapture(ev.pointerId);
    };
    canvas.addEventListener("pointerup", endDrag);
    canvas.addEventListener("pointercancel", endDrag);
    canvas.addEventListener("pointerleave", () => {
      if (v.drag) return;
      v.hover = -1;
      tip.hidden = true;
      v.request();
    });
    canvas.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      v.zoom = clamp(v.zoom * Math.exp(-ev.deltaY * 0.001), 0.4, 6);
      v.request();
    }, { passive: false });
    canvas.addEventListener("keydown", (ev) => {
      const step = 0.08;
      if (ev.key === "ArrowLeft") v.rotate(-step, 0);
      else if (ev.key === "ArrowRight") v.rotate(step, 0);
      else if (ev.key === "ArrowUp") v.rotate(0, -step);
      else if (ev.key === "ArrowDown") v.rotate(0, step);
      else if (ev.key === "+" || ev.key === "=") v.zoom = clamp(v.zoom * 1.15, 0.4, 6);
      else if (ev.key === "-") v.zoom = clamp(v.zoom / 1.15, 0.4, 6);
      else return;
      ev.preventDefault();
      v.request();
    });

    v.pick = (ev) => {
      if (!v.n) return;
      const r = canvas.getBoundingClientRect();
      const dpr = canvas.width / r.width;
      const x = (ev.clientX - r.left) * dpr;
      const y = (ev.clientY - r.top) * dpr;
      let best = -1;
      let bestD = (8 * dpr) ** 2;
      let bestZ = -1;
      for (let i = 0; i < v.n; i++) {
        const dx = v.sx[i] - x;
        const dy = v.sy[i] - y;
        const d = dx * dx + dy * dy;
        if (d < bestD || (d === bestD && v.vis[i] > bestZ)) {
          best = i;
          bestD = d;
          bestZ = v.vis[i];
        }
      }
      if (best !== v.hover) {
        v.hover = best;
        v.request();
      }
      if (best < 0) {
        tip.hidden = true;
        return;
      }
      const a = state.atlas;
      const layer = a.layers[Math.floor(best / a.n_experts)];
      const expert = best % a.n_experts;
      tip.textContent = "";
      const head = el("div");
      head.appendChild(el("b", null, `layer ${layer} · expert ${expert}`));
      tip.appendChild(head);
      const dom = a.dominant[best];
      tip.appendChild(el("div", null, dom >= 0 ? `topic ${a.topics[dom]}` : "never routed"));
      const aff = atlasAffinity(layer, expert);
      if (aff && dom >= 0) tip.appendChild(el("div", "muted", aff));
      tip.appendChild(el("div", "muted", `${(a.selections[best] || 0).toLocaleString()} selections`));
      tip.hidden = false;
      const wr = wrap.getBoundingClientRect();
      let tx = ev.clientX - wr.left + 14;
      let ty = ev.clientY - wr.top + 14;
      if (tx + tip.offsetWidth > wr.width - 4) tx = ev.clientX - wr.left - tip.offsetWidth - 14;
      if (ty + tip.offsetHeight > wr.height - 4) ty = ev.clientY - wr.top - tip.offsetHeight - 14;
      tip.style.left = `${Math.max(4, tx)}px`;
      tip.style.top = `${Math.max(4, ty)}px`;
    };
    return v;
  })();

  // ================================================================== start
  const ro = new ResizeObserver(() => {
    if (state.tab === "brain") brain.resize();
    else if (state.tab === "atlas") atlas.resize();
    else if (state.tab === "runtime") renderRuntime();
  });
  ro.observe(document.querySelector("main"));
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) {
      profilePoller.now();
      expertsPoller.now();
    }
  });

  // a handle for debugging and the browser tests
  for (const node of document.querySelectorAll(".this-server")) node.textContent = location.origin;
  window.colibriDashboard = { state, brain, atlas, onExperts, onProfile, selectTab, renderMarkdown };

  selectTab(location.hash.slice(1) || "chat");
  loadModel().catch(() => {});
  loadAtlas().catch(() => {});
  profilePoller.start();
  expertsPoller.start();
})();

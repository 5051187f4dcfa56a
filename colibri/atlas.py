"""The routing atlas: where each routed expert sits by the topics that route to it.

``coli atlas`` (or ``python tools/atlas.py``) sends a few short prompts per topic (code, poetry,
law, Chinese, SQL, chat, maths, medicine; bundled below) through the model and counts, per topic,
how often each (layer, expert) was selected. Each expert gets a topic-affinity vector
``p(topic | expert)`` (selections per prompt token of the topic, normalised over topics, so a
topic with longer prompts weighs no more); a PCA of those vectors (Hellinger: square roots,
numpy SVD) to three components gives its position, and its largest component its dominant topic.
Experts never selected sit at the origin with topic ``-1``.

Two ways to measure:

* :func:`atlas_from_model` opens the model here (``colibri.open_model``) and reads the engine's
  routing counts (``expert_map()``) before and after each prompt. It learns into a temporary
  state dir (seeded with a copy of ``.coli_usage`` so the pinned set is the same): the real
  history is not touched.
* :func:`atlas_from_server` uses a running ``coli serve`` / ``coli web``: one ``/v1/completions``
  per prompt and the ``/experts`` counts around it (no second copy of the model in RAM; other
  clients' requests during the run add noise).

:func:`write_atlas` writes the JSON (atomically) that ``GET /atlas`` serves from the state dir.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from colibri._config import EngineOptions
from storage.errors import ColibriError

__all__ = [
    "TOPICS",
    "atlas_from_model",
    "atlas_from_server",
    "build_atlas",
    "layout",
    "write_atlas",
]

Log = Callable[[str], None]

#: topic -> short prompts (raw text, no chat template: the topic's own tokens are measured)
TOPICS: dict[str, tuple[str, ...]] = {
    "code": (
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
        "for (int i = 0; i < len; ++i) { sum += buf[i] * weights[i]; }",
        "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\nprint(x.shape)",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        "        self.items.append(x)",
    ),
    "poetry": (
        "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
        "The woods are lovely, dark and deep, but I have promises to keep.",
        "I wandered lonely as a cloud that floats on high o'er vales and hills.",
        "Because I could not stop for Death, he kindly stopped for me.",
    ),
    "law": (
        "The lessee shall indemnify and hold harmless the lessor against all claims arising "
        "from the use of the premises.",
        "This agreement shall be governed by and construed in accordance with the laws of the "
        "State of New York.",
        "The court held that the defendant owed a duty of care to the plaintiff under the "
        "doctrine of negligence.",
        "Notwithstanding any provision to the contrary, the liability of either party shall not "
        "exceed the fees paid.",
    ),
    "chinese": (
        "今天天气很好，我们去公园散步吧。",
        "人工智能正在改变我们的生活和工作方式。",
        "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？",
        "请问去火车站怎么走？谢谢你的帮助。",
    ),
    "sql": (
        "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 5 ORDER BY 2 DESC;",
        "CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT NOT NULL UNIQUE);",
        "UPDATE accounts SET balance = balance - 100 WHERE id = 42;",
        "SELECT u.email FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total > 100;",
    ),
    "chat": (
        "Hi! How are you doing today?",
        "Thanks a lot, that was really helpful. Have a great weekend!",
        "Can you recommend a good movie to watch tonight?",
        "Sorry, I did not get that. Could you say it again?",
    ),
    "math": (
        "Let f(x) = x^2 + 3x - 4. Find the roots of f and the minimum value.",
        "The integral of sin(x) from 0 to pi equals 2.",
        "Prove that the square root of 2 is irrational.",
        "If a matrix A is invertible then det(A) is not zero and A x = b has one solution.",
    ),
    "medicine": (
        "The patient presented with fever, cough and shortness of breath for three days.",
        "Ibuprofen is a nonsteroidal anti-inflammatory drug used to reduce pain and fever.",
        "Hypertension increases the risk of stroke, heart attack and kidney disease.",
        "Insulin lowers blood glucose by promoting its uptake into muscle and fat cells.",
    ),
}

ATLAS_FORMAT = "colibri-atlas"
ATLAS_VERSION = 1


def _log(log: Log | None, line: str) -> None:
    if log is not None:
        log(line)


def _as_counts(rows: list[list[int]] | None, n_experts: int) -> npt.NDArray[np.int64]:
    """``expert_map()["counts"]`` as an int64 [layers, experts] array (short rows padded)."""
    if rows is None:
        raise ColibriError(
            "no routing counts: the engine keeps none with learn off; run without --no-learn"
        )
    out = np.zeros((len(rows), n_experts), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row[:n_experts]
    return out


# ------------------------------------------------------------------------------ measure


def atlas_from_model(
    options: EngineOptions,
    *,
    tokens: int = 0,
    topics: dict[str, tuple[str, ...]] | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """Measure routing per topic with the model opened here; returns :func:`build_atlas`'s
    dict. ``tokens`` > 0 also generates that many tokens (greedy) after each prompt."""
    from colibri._engine import USAGE_FILE, open_model
    from colibri.server.app import default_model_name
    from colibri.tokenizer import ChatTokenizer

    sets = topics or TOPICS
    with tempfile.TemporaryDirectory(prefix="colibri-atlas-") as tmp:
        src = options.resolved_state_dir() / USAGE_FILE
        if src.is_file():  # same history -> same pinned set; the copy is thrown away after
            shutil.copy2(src, Path(tmp) / USAGE_FILE)
        fields = {**options.model_dump(), "state_dir": Path(tmp), "learn": True, "repin": False}
        with open_model(**fields) as m:
            c = m.container
            tok_path = c.tokenizer_path()
            if tok_path is None:
                raise ColibriError(f"{c.path}: no tokenizer.json, cannot encode the prompts")
            tok = ChatTokenizer(tok_path, c.tokenizer_config())
            first = m.engine.expert_map()
            n_experts = int(first["n_experts"])
            layers = [int(x) for x in first["layers"]]
            prev = _as_counts(first["counts"], n_experts)
            delta = np.zeros((len(sets), *prev.shape), dtype=np.int64)
            seen = np.zeros(len(sets), dtype=np.int64)
            for t, (name, prompts) in enumerate(sets.items()):
                t0 = time.perf_counter()
                for text in prompts:
                    ids = tok.encode(text, raw=True)  # as the server's completions encode it
                    if not ids:
                        continue
                    if tokens > 0:
                        # no drafting: rejected verify rows would be counted too, and which
                        # rows run would depend on timing (a run would not reproduce)
                        out = m.generate(ids, max_new_tokens=tokens, stop_token_ids=[], draft="off")
                        # the rows routed: the prompt and every generated token but the last
                        # (the context may end the generation before ``tokens``)
                        seen[t] += len(ids) + max(0, len(out) - 1)
                    else:
                        m.forward(ids)
                        seen[t] += len(ids)
                    now = _as_counts(m.engine.expert_map()["counts"], n_experts)
                    delta[t] += now - prev
                    prev = now
                _log(log, f"{name}: {int(seen[t])} tokens in {time.perf_counter() - t0:.1f} s")
            return build_atlas(
                list(sets), seen, delta, layers, model=default_model_name(c.path), source="model"
            )


def atlas_from_server(
    url: str,
    *,
    api_key: str | None = None,
    tokens: int = 0,
    topics: dict[str, tuple[str, ...]] | None = None,
    log: Log | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Measure routing per topic through a running server (``/v1/completions`` per prompt,
    ``/experts`` counts around it); returns :func:`build_atlas`'s dict. A topic's tokens are
    those the server computed: prompt tokens it reused from a KV slot (``usage``'s
    ``cached_tokens``) routed nothing."""
    import httpx

    sets = topics or TOPICS
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout) as client:

        def get(path: str) -> Any:
            r = client.get(path)
            if r.status_code != 200:
                raise ColibriError(f"{url}{path}: HTTP {r.status_code}: {r.text[:200]}")
            return r.json()

        try:
            model = get("/v1/models")["data"][0]["id"]
            first = get("/experts")
        except httpx.HTTPError as exc:
            raise ColibriError(f"cannot reach the server at {url}: {exc}") from exc
        n_experts = int(first["n_experts"])
        layers = [int(x) for x in first["layers"]]
        prev = _as_counts(first.get("counts"), n_experts)
        delta = np.zeros((len(sets), *prev.shape), dtype=np.int64)
        seen = np.zeros(len(sets), dtype=np.int64)
        for t, (name, prompts) in enumerate(sets.items()):
            t0 = time.perf_counter()
            for text in prompts:
                body = {
                    "model": model,
                    "prompt": text,
                    "max_tokens": max(1, tokens),
                    "temperature": 0,
                    "ignore_eos": True,
                    # no drafting: rejected verify rows (and the MTP layer's) would be counted
                    # too, and which rows run would follow the server's timing
                    "draft": "off",
                }
                r = client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    raise ColibriError(
                        f"{url}/v1/completions: HTTP {r.status_code}: {r.text[:200]}"
                    )
                usage = r.json().get("usage") or {}
                # prompt tokens the server took from a KV slot were not routed again
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                computed = int(usage.get("prompt_tokens", 0)) - int(cached)
                made = int(usage.get("completion_tokens", 0)) if tokens > 0 else 0
                seen[t] += computed + max(0, made - 1)
                now = _as_counts(get("/experts").get("counts"), n_experts)
                delta[t] += now - prev
                prev = now
            _log(log, f"{name}: {int(seen[t])} tokens in {time.perf_counter() - t0:.1f} s")
    return build_atlas(list(sets), seen, delta, layers, model=str(model), source="server")


# ------------------------------------------------------------------------------ layout


def layout(delta: npt.NDArray[np.integer], topic_tokens: npt.NDArray[np.integer]) -> dict[str, Any]:
    """Positions from per-topic routing counts ``delta`` [topics, layers, experts].

    Returns ``position`` [N, 3] (N = layers x experts, layer-major; unit max radius),
    ``affinity`` [N, topics] (``p(topic | expert)``, zeros when never selected), ``dominant``
    [N] (topic index, -1 when never selected), ``selections`` [N] and ``explained_variance``
    (share of each component)."""
    d = np.asarray(delta, dtype=np.float64)
    n_topics = d.shape[0]
    per_token = np.maximum(np.asarray(topic_tokens, dtype=np.float64), 1.0)
    rate = (d / per_token[:, None, None]).reshape(n_topics, -1).T  # [N, T]
    total = rate.sum(axis=1)
    routed = total > 0
    p = np.zeros_like(rate)
    p[routed] = rate[routed] / total[routed, None]
    pos = np.zeros((rate.shape[0], 3))
    explained: list[float] = []
    if int(routed.sum()) >= 2:
        h = np.sqrt(p[routed])
        hc = h - h.mean(axis=0)
        _, s, vt = np.linalg.svd(hc, full_matrices=False)
        k = min(3, vt.shape[0])
        comps = vt[:k].copy()
        for i in range(k):  # a deterministic sign: the largest loading is positive
            if comps[i, int(np.argmax(np.abs(comps[i])))] < 0:
                comps[i] = -comps[i]
        y = hc @ comps.T
        radius = float(np.sqrt((y**2).sum(axis=1)).max()) or 1.0
        pos[routed, :k] = y / radius
        var = float((s**2).sum()) or 1.0
        explained = [float(x) for x in (s[:k] ** 2) / var]
    dominant = np.where(routed, p.argmax(axis=1), -1)
    return {
        "position": pos,
        "affinity": p,
        "dominant": dominant,
        "selections": d.sum(axis=0).reshape(-1).astype(np.int64),
        "explained_variance": explained,
    }


def build_atlas(
    topics: list[str],
    topic_tokens: npt.NDArray[np.integer],
    delta: npt.NDArray[np.integer],
    layers: list[int],
    *,
    model: str,
    source: str,
) -> dict[str, Any]:
    """The JSON document ``GET /atlas`` serves (columnar: one entry per expert, layer-major)."""
    lay = layout(delta, topic_tokens)
    n_experts = int(np.asarray(delta).shape[2])
    routed = int((lay["dominant"] >= 0).sum())
    return {
        "format": ATLAS_FORMAT,
        "version": ATLAS_VERSION,
        "created": time.time(),
        "model": model,
        "source": source,
        "topics": topics,
        "topic_tokens": [int(x) for x in topic_tokens],
        "layers": layers,
        "n_experts": n_experts,
        "position": [[round(float(v), 4) for v in row] for row in lay["position"]],
        "dominant": [int(x) for x in lay["dominant"]],
        "affinity": [[round(float(v), 3) for v in row] for row in lay["affinity"]],
        "selections": [int(x) for x in lay["selections"]],
        "explained_variance": [round(x, 4) for x in lay["explained_variance"]],
        "summary": {
            "model": model,
            "topics": len(topics),
            "experts": len(layers) * n_experts,
            "experts_routed": routed,
            "tokens": int(np.sum(topic_tokens)),
        },
    }


def write_atlas(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ColibriError(f"cannot write the atlas to {path}: {exc.strerror or exc}") from exc

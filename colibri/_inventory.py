"""What is on this machine and what is running: the data behind ``coli list`` and ``coli ps``.

``list_models`` looks at model directories (a path that holds ``config.json``, or a directory of
such paths) without loading anything: model type, layers and experts from ``config.json``, the
bytes of its shards, whether a colibri manifest is there (a converted container) and the state
directory the engine keeps for it (``~/.cache/colibri/<name>-<hash>``: ``.coli_usage``, KV slot
files, chat sessions). ``orphan_state_dirs`` lists the state directories no listed model owns.
``server_status`` asks a running ``coli serve`` (``/health``, then ``/profile`` with the API key)
what it has loaded: model, queue, KV slots and expert tiers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from colibri._config import EngineOptions
from storage import jsontext
from storage.errors import ColibriError

__all__ = [
    "ModelEntry",
    "StateDir",
    "list_models",
    "orphan_state_dirs",
    "server_status",
    "state_root",
]


def state_root() -> Path:
    """Where the default state directories live."""
    return Path.home() / ".cache" / "colibri"


@dataclass(frozen=True, slots=True)
class StateDir:
    path: Path
    usage: bool  # a .coli_usage file (learned routing counts)
    kv_files: int  # .coli_kv.N slot files and .coli_kv.chat.* sessions
    kv_bytes: int
    chat_sessions: int = 0  # .coli_chat.<name>.json (coli chat's conversations)

    @staticmethod
    def read(path: Path) -> StateDir:
        kv = [p for p in path.glob(".coli_kv*") if p.is_file() and ".bad-" not in p.name]
        chats = [p for p in path.glob(".coli_chat.*.json") if p.is_file()]
        return StateDir(
            path,
            (path / ".coli_usage").is_file(),
            len(kv),
            sum(p.stat().st_size for p in kv),
            len(chats),
        )

    def describe(self) -> str:
        parts = ["usage" if self.usage else "no usage yet"]
        if self.chat_sessions:
            parts.append(f"{self.chat_sessions} chat session(s)")
        if self.kv_files:
            parts.append(f"{self.kv_files} KV file(s)")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    path: Path
    model_type: str
    layers: int
    experts: int
    shard_bytes: int
    converted: bool  # a colibri manifest is present
    state: StateDir | None  # None: the engine has not run it yet (no state dir)
    problem: str | None = None  # why its config.json is unusable (listed all the same)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "model_type": self.model_type,
            "layers": self.layers,
            "routed_experts_per_layer": self.experts,
            "shard_bytes": self.shard_bytes,
            "converted": self.converted,
            "state_dir": None if self.state is None else str(self.state.path),
            "usage": bool(self.state and self.state.usage),
            "kv_files": 0 if self.state is None else self.state.kv_files,
            "kv_bytes": 0 if self.state is None else self.state.kv_bytes,
            "chat_sessions": 0 if self.state is None else self.state.chat_sessions,
            "problem": self.problem,
        }


def _entry(path: Path) -> ModelEntry | None:
    """The listing of model directory ``path``; one whose config.json is unusable is listed
    with the problem (not left out: it is on disk, taking space), None when it has none."""
    if not (path / "config.json").is_file():
        return None
    problem = None
    model_type, layers, experts = "?", 0, 0
    try:
        cfg = jsontext.loads((path / "config.json").read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        found = (cfg.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
        if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
            raise ValueError("names no model_type (no colibri command can open it)")
        model_type = str(cfg["model_type"])
        layers = int(cfg.get("num_hidden_layers") or 0)
        experts = int(next((v for v in found if v), 0))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        problem = f"config.json: {exc}"
    state = EngineOptions(model=path).resolved_state_dir()
    return ModelEntry(
        path=path,
        model_type=model_type,
        layers=layers,
        experts=experts,
        shard_bytes=sum(p.stat().st_size for p in path.glob("*.safetensors")),
        converted=(path / "colibri-manifest.json").is_file(),
        state=StateDir.read(state) if state.is_dir() else None,
        problem=problem,
    )


def list_models(paths: Iterable[Path]) -> list[ModelEntry]:
    """Model directories among ``paths`` (each a model dir or a directory of them), sorted."""
    seen: dict[Path, ModelEntry] = {}
    for raw in paths:
        p = raw.expanduser().resolve()
        if not p.exists():
            raise ColibriError(f"{raw} does not exist")
        if not p.is_dir():
            raise ColibriError(f"{raw}: not a directory")
        candidates = [p] if (p / "config.json").is_file() else sorted(p.iterdir())
        for c in candidates:
            if c.is_dir() and c not in seen and (entry := _entry(c)) is not None:
                seen[c] = entry
    return sorted(seen.values(), key=lambda e: str(e.path))


def orphan_state_dirs(models: Iterable[ModelEntry]) -> list[StateDir]:
    """State directories under :func:`state_root` that none of ``models`` owns."""
    root = state_root()
    if not root.is_dir():
        return []
    owned = {m.state.path for m in models if m.state is not None}
    return [StateDir.read(d) for d in sorted(root.iterdir()) if d.is_dir() and d not in owned]


def server_status(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """``/health`` and ``/profile`` of the ``coli serve`` at ``url`` (one dict); a URL without
    a scheme (``127.0.0.1:8000``) is taken as http (it read as "no server answers")."""
    if "://" not in url:
        url = "http://" + url
    base = url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(base + "/health", timeout=timeout)
        if health.status_code != 200:
            raise ColibriError(f"{base}/health answered {health.status_code}: not a coli server?")
        prof = httpx.get(base + "/profile", params={"limit": 1}, headers=headers, timeout=timeout)
    except httpx.InvalidURL as exc:  # not an HTTPError: a malformed --url
        raise ColibriError(
            f"{url!r} is not a URL ({exc}); give e.g. http://127.0.0.1:8000"
        ) from exc
    except httpx.HTTPError as exc:
        raise ColibriError(f"no colibri server answers at {base} ({exc})") from exc
    if prof.status_code in (401, 403):
        if api_key:
            raise ColibriError(f"{base} refused the API key given with --api-key")
        raise ColibriError(f"{base} needs an API key for /profile (--api-key)")
    if prof.status_code != 200:
        raise ColibriError(f"{base}/profile answered {prof.status_code}")
    try:
        out = prof.json()
        health_doc = health.json()
    except ValueError:
        out = health_doc = None
    if not isinstance(out, dict) or not isinstance(health_doc, dict):
        raise ColibriError(f"{base} answers, but not as a coli server (its /profile or /health "
                           "is not a JSON object)")  # fmt: skip
    out["url"] = base
    out["health"] = health_doc
    return out

"""``coli pull``: a model by its Hugging Face repository id, converted as its shards land.

For a Hugging Face checkpoint the small files (config, tokenizer, index) are downloaded first and
every ``*.safetensors`` shard is represented by its header alone: two HTTP range requests, the
rest of the file a sparse hole. The converter builds its whole plan from those headers, then
asks for each source shard only while an output shard reads it (:class:`_Fetcher`, the
converter's ``SourceFetcher``) and gives it back right after, so the source never sits on disk
whole: at most the shards one output shard reads at a time. A repository that already is a
colibri container (``colibri-manifest.json``) is downloaded as is and verified against its
manifest (sizes and SHA-256 of every shard).

Resumable: the download is pinned to the commit the first listing saw; an interrupted pull
rerun with the same arguments keeps the converted shards (the converter's own resumption, keyed
on the repository, commit, file names, sizes and headers) and fetches only what is still
needed. Files go through ``huggingface_hub`` (``HF_TOKEN``, ``HF_ENDPOINT`` and its cache
rules are its own); ``endpoint`` points at another hub (a mirror, or the tests' loopback one).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from storage.atomic import atomic_write_bytes
from storage.convert import ConvertOptions, ConvertResult, convert
from storage.errors import ColibriError
from storage.manifest import MANIFEST_NAME, Manifest, SourceFile, SourceIdentity

__all__ = ["PullResult", "pull"]

# progress(done_bytes, total_bytes or None for a step, message)
Progress = Callable[[int, int | None, str], None]
_STAGING = ".pull-source"  # beside the container: <out>/../.<name>.pull-source
_DONE = ".complete.json"  # which source shards are whole on disk now


@dataclass(frozen=True, slots=True)
class PullResult:
    out: Path
    repo_id: str
    commit: str
    kind: str  # "converted" (a Hugging Face checkpoint) or "container" (downloaded, verified)
    source_bytes: int  # the repository's safetensors bytes
    peak_source_bytes: int  # the most of them on disk at one time
    convert: ConvertResult | None


def _hub(endpoint: str | None, token: str | None) -> Any:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # ours report progress instead
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token)


def _network_errors() -> tuple[type[BaseException], ...]:
    """The transport errors a hub call may raise: httpx's, OSError, and those of the HTTP
    client huggingface_hub itself uses (recent versions ship ``httpx2``, whose errors are not
    httpx's)."""
    import importlib

    errors: list[type[BaseException]] = [httpx.HTTPError, OSError]
    try:
        errors.append(importlib.import_module("httpx2").HTTPError)
    except (ImportError, AttributeError):
        pass
    return tuple(errors)


def _listing(api: Any, repo_id: str, revision: str | None) -> tuple[str, dict[str, int]]:
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    failures: tuple[type[BaseException], ...] = (*_network_errors(), HfHubHTTPError)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except RepositoryNotFoundError as exc:
        raise ColibriError(
            f"{repo_id}: no such repository (or it needs a token: HF_TOKEN)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ColibriError(f"{repo_id}: no revision {revision!r}") from exc
    except HFValidationError as exc:
        raise ColibriError(f"{repo_id!r} is not a repository id (owner/name): {exc}") from exc
    except failures as exc:
        raise ColibriError(f"{repo_id}: cannot list the repository: {exc}") from exc
    files = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    if not files:
        raise ColibriError(f"{repo_id}: the repository lists no files")
    return str(info.sha), files


class _Fetcher:
    """The converter's ``SourceFetcher`` over a staging dir of header-only shard stubs."""

    def __init__(
        self,
        dl: Callable[[str, Path], Path],
        staging: Path,
        sizes: dict[str, int],
        progress: Callable[[str], None],
    ) -> None:
        self._dl, self._dir, self._sizes, self._say = dl, staging, sizes, progress
        self._whole: set[str] = set(self._read_done())
        self.peak = self._bytes()

    def _read_done(self) -> list[str]:
        try:
            names = json.loads((self._dir / _DONE).read_text())
        except (OSError, ValueError):
            return []
        return [n for n in names if isinstance(n, str) and n in self._sizes]

    def _write_done(self) -> None:
        atomic_write_bytes(self._dir / _DONE, json.dumps(sorted(self._whole)).encode())

    def has_whole(self, name: str) -> bool:
        """Whether shard ``name`` is on disk whole (from an interrupted pull)."""
        return name in self._whole

    def _bytes(self) -> int:
        return sum(self._sizes[n] for n in self._whole)

    def need(self, paths: Sequence[Path]) -> None:
        for p in paths:
            name = p.relative_to(self._dir).as_posix()
            if name in self._whole:
                continue
            self._say(f"downloading {name} ({self._sizes[name]:,} bytes)")
            got = self._dl(name, self._dir / ".download")
            os.replace(got, p)  # the whole file over its stub
            self._whole.add(name)
            self._write_done()
            self.peak = max(self.peak, self._bytes())

    def release(self, paths: Sequence[Path]) -> None:
        for p in paths:
            name = p.relative_to(self._dir).as_posix()
            if name not in self._whole:
                continue
            self._whole.discard(name)
            self._write_done()
            # back to its header: the bytes are freed
            _write_stub(p, _local_header(p), self._sizes[name])


def _local_header(path: Path) -> bytes:
    """The safetensors header of a local shard: its 8-byte length, then the JSON."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return head + fh.read(n)


def _write_stub(dst: Path, header: bytes, size: int) -> None:
    """``dst``: ``header``, then a hole up to ``size`` bytes (atomically replaced)."""
    tmp = dst.with_name(dst.name + ".stub")
    with open(tmp, "wb") as fh:
        fh.write(header)
        fh.truncate(size)
    os.replace(tmp, dst)


def _header_stub(url: str, headers: dict[str, str], dst: Path, size: int) -> bytes:
    """Write ``dst`` as a stub of the remote shard at ``url`` (its header, read with two range
    requests); returns the header bytes."""
    try:
        with httpx.Client(follow_redirects=True, timeout=60, headers=headers) as client:
            r = client.get(url, headers={"Range": "bytes=0-7"})
            if r.status_code not in (200, 206) or len(r.content) < 8:
                raise ColibriError(f"{url}: cannot read the shard header (HTTP {r.status_code})")
            n = int.from_bytes(r.content[:8], "little")
            if not 0 < n < min(size, 256 << 20):
                raise ColibriError(f"{url}: not a safetensors file (header length {n})")
            r2 = client.get(url, headers={"Range": f"bytes=8-{8 + n - 1}"})
    except httpx.HTTPError as exc:
        raise ColibriError(f"{url}: cannot read the shard header: {exc}") from exc
    body = r2.content[:n] if r2.status_code == 206 else r2.content[8 : 8 + n]
    if len(body) != n:
        raise ColibriError(f"{url}: the shard header ends early")
    header = r.content[:8] + body
    _write_stub(dst, header, size)
    return header


def pull(
    repo_id: str,
    out: str | os.PathLike[str],
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    options: ConvertOptions | None = None,
    progress: Progress | None = None,
) -> PullResult:
    """Download ``repo_id`` into the colibri container ``out`` (converted shard by shard, or
    downloaded and verified when the repository already is one)."""
    from huggingface_hub import hf_hub_download, hf_hub_url
    from huggingface_hub import utils as hf_utils

    report: Progress = progress or (lambda done, total, msg: None)

    def say(msg: str) -> None:
        report(0, None, msg)

    out_p = Path(out)
    api = _hub(endpoint, token)
    commit, sizes = _listing(api, repo_id, revision)
    shards = sorted(n for n in sizes if n.endswith(".safetensors"))
    source_bytes = sum(sizes[n] for n in shards)

    def download(name: str, where: Path) -> Path:
        try:
            return Path(
                hf_hub_download(
                    repo_id, name, revision=commit, local_dir=where, endpoint=endpoint, token=token
                )
            )
        except Exception as exc:  # huggingface_hub raises many kinds; one boundary here
            raise ColibriError(f"{repo_id}: cannot download {name}: {exc}") from exc

    if MANIFEST_NAME in sizes:  # already a colibri container: download, then verify
        out_p.mkdir(parents=True, exist_ok=True)
        for name in sorted(sizes):
            dst = out_p / name
            if dst.is_file() and dst.stat().st_size == sizes[name] and name != MANIFEST_NAME:
                continue
            say(f"downloading {name} ({sizes[name]:,} bytes)")
            got = download(name, out_p / ".download")
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, dst)
        shutil.rmtree(out_p / ".download", ignore_errors=True)
        _verify_container(out_p, say)
        return PullResult(out_p, repo_id, commit, "container", source_bytes, source_bytes, None)
    if not shards:
        raise ColibriError(f"{repo_id}: no *.safetensors files (not a checkpoint colibri reads)")

    staging = out_p.parent / f".{out_p.name}{_STAGING}"
    staging.mkdir(parents=True, exist_ok=True)
    for name in sorted(n for n in sizes if n not in shards and not n.startswith(".")):
        if name.endswith((".json", ".jinja", ".txt", ".model")) and "/" not in name:
            if not (staging / name).is_file() or (staging / name).stat().st_size != sizes[name]:
                say(f"downloading {name}")
                os.replace(download(name, staging / ".download"), staging / name)
    fetcher = _Fetcher(download, staging, {n: sizes[n] for n in shards}, say)
    headers = hf_utils.build_hf_headers(token=token)  # type: ignore[attr-defined]
    ident = hashlib.sha256(f"{repo_id}\0{commit}\0".encode())
    for name in shards:
        path = staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if fetcher.has_whole(name) and path.is_file() and path.stat().st_size == sizes[name]:
            header = _local_header(path)
        else:
            say(f"reading the header of {name}")
            url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
            header = _header_stub(url, headers, path, sizes[name])
        ident.update(f"{name}\0{sizes[name]}\0".encode() + header)
    identity = SourceIdentity(
        f"hf:{repo_id}@{commit}:{ident.hexdigest()}",
        tuple(SourceFile(n, sizes[n]) for n in shards),
    )
    result = convert(
        staging,
        out_p,
        options or ConvertOptions(),
        fetch=fetcher,
        identity=identity,
        progress=report,
    )
    shutil.rmtree(staging, ignore_errors=True)  # done: the source is not needed any more
    return PullResult(out_p, repo_id, commit, "converted", source_bytes, fetcher.peak, result)


def _verify_container(out: Path, say: Callable[[str], None]) -> None:
    from storage.manifest import sha256_file

    manifest = Manifest.load(out / MANIFEST_NAME)
    for entry in manifest.shards:
        say(f"verifying {entry.file}")
        path = out / entry.file
        if not path.is_file() or path.stat().st_size != entry.size:
            raise ColibriError(f"{path}: missing or of the wrong size after the download")
        if sha256_file(path) != entry.sha256:
            raise ColibriError(f"{path}: SHA-256 differs from the manifest (damaged download)")

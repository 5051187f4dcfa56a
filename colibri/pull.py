"""``coli pull``: a model by its Hugging Face repository id, converted as its shards land.

For a Hugging Face checkpoint the small files (config, tokenizer, index) are downloaded first and
every ``*.safetensors`` shard is represented by its header alone: two HTTP range requests, the
rest of the file a sparse hole. The converter builds its whole plan from those headers, then
asks for each source shard only while an output shard reads it (:class:`_Fetcher`, the
converter's ``SourceFetcher``) and gives it back right after, so the source never sits on disk
whole: at most the shards one output shard reads at a time. A repository that already is a
colibri container (``colibri-manifest.json``) is downloaded as is and verified against its
manifest (sizes and SHA-256 of every shard).

Resumable: the download is pinned to the commit the first listing saw (recorded beside the
container in ``.<name>.pull.json`` until the pull finishes, so a repository that moved since
does not change what a rerun fetches); an interrupted pull rerun with the same arguments keeps
the converted shards (the converter's own resumption, keyed
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
from storage.errors import ColibriError, ConversionError
from storage.manifest import MANIFEST_NAME, Manifest, SourceFile, SourceIdentity

__all__ = ["PullResult", "pull"]

# progress(done_bytes, total_bytes or None for a step, message)
Progress = Callable[[int, int | None, str], None]
_STAGING = ".pull-source"  # beside the container: <out>/../.<name>.pull-source
_DONE = ".complete.json"  # which source shards are whole on disk now
_PIN = ".pull.json"  # beside the container: <out>/../.<name>.pull.json, the pinned commit


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
    force: bool = False,
) -> PullResult:
    """Download ``repo_id`` into the colibri container ``out`` (converted shard by shard, or
    downloaded and verified when the repository already is one). ``options`` None: the
    converter's defaults (a container repository takes none). ``force``: discard an
    interrupted pull (its pinned commit, staged source and partial conversion) and start
    over."""
    from huggingface_hub import hf_hub_download, hf_hub_url
    from huggingface_hub import utils as hf_utils

    report: Progress = progress or (lambda done, total, msg: None)

    def say(msg: str) -> None:
        report(0, None, msg)

    out_p = Path(out)
    pin_path = out_p.parent / f".{out_p.name}{_PIN}"
    staging = out_p.parent / f".{out_p.name}{_STAGING}"
    if force:
        pin_path.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    pinned = _read_pin(pin_path)
    if pinned is not None:
        if pinned[0] != repo_id:
            raise ColibriError(
                f"{out_p} holds an interrupted pull of {pinned[0]}; finish it with `coli pull "
                f"{pinned[0]} {out_p}`, or pass --force to pull {repo_id} there instead"
            )
        if revision is not None and revision != pinned[1]:
            raise ColibriError(
                f"the interrupted pull of {repo_id} into {out_p} is pinned to commit "
                f"{pinned[1][:12]}; rerun without --revision to finish it, or pass --force to "
                f"start over at {revision}"
            )
        revision = pinned[1]
    api = _hub(endpoint, token)
    commit, sizes = _listing(api, repo_id, revision)
    if pinned is None:
        pin_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(pin_path, json.dumps({"repo_id": repo_id, "commit": commit}).encode())
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
        if options is not None and options != ConvertOptions():
            raise ColibriError(
                f"{repo_id} is already a colibri container: the format options (--experts, "
                "--dense, --io, --mtp, --shard-size) do not apply to it; drop them (or convert "
                "it again from its Hugging Face checkpoint)"
            )
        out_p.mkdir(parents=True, exist_ok=True)
        fetch_manifest = download(MANIFEST_NAME, out_p / ".download")
        os.replace(fetch_manifest, out_p / MANIFEST_NAME)
        sums = {e.file: e.sha256 for e in Manifest.load(out_p / MANIFEST_NAME).shards}
        for name in sorted(sizes):
            dst = out_p / name
            if name == MANIFEST_NAME:
                continue
            if dst.is_file() and dst.stat().st_size == sizes[name]:
                # a file of the right size from an earlier run: kept when it checks out (a
                # damaged or older one of the same size is fetched again, not kept forever)
                if name not in sums or _sha256(dst) == sums[name]:
                    continue
                say(f"{name} differs from the manifest: downloading it again")
            say(f"downloading {name} ({sizes[name]:,} bytes)")
            got = download(name, out_p / ".download")
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, dst)
        shutil.rmtree(out_p / ".download", ignore_errors=True)
        _verify_container(out_p, say)
        pin_path.unlink(missing_ok=True)
        return PullResult(out_p, repo_id, commit, "container", source_bytes, source_bytes, None)
    if not shards:
        raise ColibriError(f"{repo_id}: no *.safetensors files (not a checkpoint colibri reads)")

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
    try:
        result = convert(
            staging,
            out_p,
            options or ConvertOptions(),
            force=force,
            fetch=fetcher,
            identity=identity,
            progress=report,
        )
    except ConversionError as exc:
        # the converter names its SRC (here the staging dir) and options of its own
        raise ColibriError(
            f"{exc}".replace(str(staging), f"{repo_id}@{commit[:12]}")
            + " (coli pull takes --force too)"
        ) from exc
    shutil.rmtree(staging, ignore_errors=True)  # done: the source is not needed any more
    pin_path.unlink(missing_ok=True)
    return PullResult(out_p, repo_id, commit, "converted", source_bytes, fetcher.peak, result)


def _read_pin(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) an interrupted pull was pinned to, or None (no pin, or unreadable)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    repo, commit = doc.get("repo_id"), doc.get("commit")
    return (repo, commit) if isinstance(repo, str) and isinstance(commit, str) else None


def _sha256(path: Path) -> str:
    from storage.manifest import sha256_file

    return sha256_file(path)


def _verify_container(out: Path, say: Callable[[str], None]) -> None:
    from storage.manifest import sha256_file

    manifest = Manifest.load(out / MANIFEST_NAME)
    for entry in manifest.shards:
        say(f"verifying {entry.file}")
        path = out / entry.file
        if not path.is_file() or path.stat().st_size != entry.size:
            raise ColibriError(f"{path}: missing or of the wrong size after the download")
        if sha256_file(path) != entry.sha256:
            raise ColibriError(
                f"{path}: SHA-256 differs from the manifest (damaged download; a rerun fetches "
                "it again)"
            )

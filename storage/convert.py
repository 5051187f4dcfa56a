"""``coli convert``: a Hugging Face checkpoint -> a colibri container, resumable and deterministic.

Flow: read every input header (no tensor data) -> classify each tensor with :mod:`storage.arch`
-> plan all output shards up front (deterministic: same source + options = same bytes) -> check
free disk -> write the shards one by one, each streamed tensor by tensor (read, dequantize FP8,
quantize, write; big matrices in row blocks) so peak memory is about one tensor or one expert,
not the model -> copy the side files -> write ``colibri-manifest.json`` last.

Output layout (one shard)::

    [header, space-padded to 4 KiB]
    [small tensors: globals / attention / dense MLP / router / norms, each weight then its .qs]
    for each routed expert (layer, expert ascending):
        [pad to 4 KiB] down.weight gate.weight up.weight       <- one O_DIRECT read
        [pad to 4 KiB] down.weight.qs gate.weight.qs up.weight.qs
    [pad to 4 KiB]   (the file size is a multiple of 4 KiB)

Padding is named ``__pad__.*`` U8 tensors, so the file stays valid safetensors. Main shards are
``out-NNNNN.safetensors``, MTP-layer shards ``out-mtp-NNNNN.safetensors`` (both from 00000).

Crash safety: a shard is written to ``<name>.tmp`` and renamed; ``.colibri-convert.json`` records
options, source fingerprint and every finished shard's sha256. A rerun verifies finished shards,
redoes the rest and ends byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from storage.atomic import temp_target
from storage.convert_source import (
    FP8_BLOCK,
    SIDE_FILES,
    _build_catalog,
    _Catalog,
    _Item,
    _load_source,
    _Source,
    read_json_object,
)
from storage.errors import (
    ColibriError,
    ConfigError,
    ConversionError,
    SafetensorsError,
    UnknownQuantFormatError,
)
from storage.manifest import (
    CONVERT_STATE_NAME,
    MANIFEST_NAME,
    ExpertEntry,
    Manifest,
    ShardEntry,
    ShardKind,
    SourceIdentity,
    atomic_write_bytes,
    fsync_dir,
    sha256_file,
    verify_shards,
    with_checksums,
)
from storage.quant import QuantFormat, bf16_to_f32, fp8_block_dequantize, quantize
from storage.safetensors import (
    DTYPE_SIZES,
    PAD_PREFIX,
    TensorInfo,
    TensorSpec,
    plan_layout,
    read_tensor,
    write_safetensors,
)

__all__ = [
    "ALIGN",
    "CONVERTER_VERSION",
    "DEFAULTS",
    "DEFAULT_SHARD_SIZE",
    "FREE_DISK_FLOOR",
    "SIDE_FILES",
    "STATE_NAME",
    "ConvertOptions",
    "ConvertResult",
    "ProgressFn",
    "SourceFetcher",
    "convert",
    "main",
]

CONVERTER_VERSION = "1"
STATE_NAME = CONVERT_STATE_NAME  # the converter's progress in DST while it runs
ALIGN = 4096  # O_DIRECT-safe on every common device (this box enforces 512)
DEFAULT_SHARD_SIZE = 2 << 30
FREE_DISK_FLOOR = 64 << 20  # leave room for the manifest, logs and the filesystem's own needs
_ROW_CHUNK_BYTES = 64 << 20  # float32 working set per row block of a big matrix
PROJ_ORDER = ("down_proj", "gate_proj", "up_proj")  # alphabetical, as the public container has it
ROLE_FLAGS = ("experts", "dense", "io", "mtp")

ProgressFn = Callable[[int, int, str], None]
F32Array = npt.NDArray[np.float32]

_SHARD_RE = re.compile(r"^out-(?:mtp-)?\d{5}\.safetensors$")


# ----------------------------------------------------------------------------- public API


@dataclass(frozen=True)
class ConvertOptions:
    """What ``coli convert`` writes. Formats: ``f32 | bf16 | f16 | int8 | int4-row | int4-gNN``.

    Router, norms, biases and every 1-D tensor are always F32. ``shard_size`` is the target
    output shard size in bytes (a shard grows past it only when one layer part or one expert is
    bigger). Invalid formats raise :class:`ConversionError` at construction."""

    experts: str = "int4-g64"
    dense: str = "int4-g64"
    io: str = "int8"
    mtp: str = "int8"
    shard_size: int = DEFAULT_SHARD_SIZE

    def __post_init__(self) -> None:
        for flag in ROLE_FLAGS:
            value = getattr(self, flag)
            try:
                fmt = QuantFormat.parse(str(value))
            except UnknownQuantFormatError as exc:
                raise ConversionError(f"--{flag} {value!r}: {exc}") from exc
            gs = fmt.group_size
            if gs is not None and gs & (gs - 1):
                # The container records no group size: a reader infers it from the number of
                # scales per row, which for a width gs does not divide also fits other sizes
                # (int4-g48 on 160 columns reads back as g40): only powers of two come back.
                raise ConversionError(
                    f"--{flag} {value!r}: the group size must be a power of two (16, 32, 64, "
                    f"128 or 256): readers infer it from the scale count, and {gs} does not "
                    "always come back as itself"
                )
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int):
            raise ConversionError(f"--shard-size must be an integer, got {self.shard_size!r}")
        if self.shard_size < ALIGN:
            raise ConversionError(f"--shard-size {self.shard_size} is below {ALIGN} bytes")

    def format_for(self, role: str) -> QuantFormat:
        """The storage format of a :class:`storage.arch.TensorRole` role."""
        if role == "expert":
            return QuantFormat.parse(self.experts)
        if role in ("dense", "io", "mtp"):
            return QuantFormat.parse(str(getattr(self, role)))
        return QuantFormat("f32")

    def recorded(self) -> dict[str, str | int]:
        """Canonical form stored in the state file and manifest (what a resume must match)."""
        rec: dict[str, str | int] = {
            flag: QuantFormat.parse(str(getattr(self, flag))).name for flag in ROLE_FLAGS
        }
        rec["shard_size"] = self.shard_size
        return rec


DEFAULTS = ConvertOptions()


@dataclass(frozen=True)
class ConvertResult:
    """What a :func:`convert` call did. ``str(result)`` is a short human summary."""

    dst: Path
    manifest: Manifest
    written: tuple[str, ...]
    reused: tuple[str, ...]
    unknown_tensors: tuple[str, ...]
    notes: tuple[str, ...] = ()
    already_complete: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.manifest.shards)

    def __str__(self) -> str:
        return "\n".join([self.summary(), *self.notes])

    def summary(self) -> str:
        """What was converted (and unrecognised tensors copied), without the notes."""
        n = len(self.manifest.shards)
        if self.already_complete:
            lines = [f"{self.dst}: already converted ({n} shards); nothing to do"]
        else:
            lines = [
                f"{self.dst}: converted {n} shards, {_human(self.total_bytes)} "
                f"({len(self.written)} written, {len(self.reused)} reused from an earlier run)"
            ]
        if self.unknown_tensors:
            shown = ", ".join(self.unknown_tensors[:5])
            more = (
                f" and {len(self.unknown_tensors) - 5} more"
                if len(self.unknown_tensors) > 5
                else ""
            )
            lines.append(
                f"copied {len(self.unknown_tensors)} unrecognised tensors verbatim: {shown}{more}"
            )
        return "\n".join(lines)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: ConvertOptions = DEFAULTS,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    fetch: SourceFetcher | None = None,
    identity: SourceIdentity | None = None,
) -> ConvertResult:
    """Convert the Hugging Face checkpoint in ``src`` into a colibri container in ``dst``.

    ``fetch`` and ``identity`` are for a source whose shards are not all on disk (``coli pull``:
    headers only until ``fetch.need``); ``identity`` then names the source for resumption in
    place of the fingerprint of its files.

    Resumable: rerunning after an interruption (even SIGKILL) finishes the job and yields the
    same bytes as an uninterrupted run; rerunning a finished conversion is a no-op. A rerun with
    other options or another source raises :class:`ConversionError` unless ``force`` is set,
    which deletes colibri's files in ``dst`` first. ``progress(done_bytes, total_bytes, msg)``
    is called as output bytes are produced."""
    report: ProgressFn = progress or _no_progress
    src_p, dst_p = Path(src), Path(dst)
    source = _load_source(src_p, identity)
    if dst_p.resolve() == src_p.resolve():
        raise ConversionError(f"{dst_p}: DST must differ from SRC (the container is a new dir)")
    catalog = _build_catalog(source, options)
    plans = _plan_shards(catalog, options)
    total = sum(p.size for p in plans)
    rec = options.recorded()
    created = not dst_p.exists()
    if dst_p.exists() and not dst_p.is_dir():
        raise ConversionError(
            f"{dst_p} is a file, not a directory; DST is the container's directory"
        )
    try:
        dst_p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConversionError(f"{dst_p}: cannot create: {exc.strerror or exc}") from exc
    try:
        with _dir_lock(dst_p):
            return _run(source, catalog, plans, total, rec, dst_p, force, report, fetch)
    except ColibriError:
        # a conversion that stopped before writing anything (no disk space, a damaged
        # source) leaves no empty DST behind it made; one with shards in it stays, to resume
        if created:
            with contextlib.suppress(OSError):
                dst_p.rmdir()  # only when empty
        raise


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Unit:
    """What must stay together in one shard: a layer's non-expert part, or one routed expert."""

    layer: int  # -1: globals (embed_tokens, model.norm, lm_head, unknown non-layer tensors)
    expert: int | None
    items: tuple[_Item, ...]

    def specs(self) -> list[TensorSpec]:
        if self.expert is None:
            return [s for it in self.items for s in it.specs()]
        per = [it.specs() for it in self.items]
        weights = [p[0] for p in per]
        scales = [p[1] for p in per if len(p) > 1]
        # The blob and (separately) its scales start on 4 KiB so each is one clean O_DIRECT read.
        out = [_aligned(weights[0]), *weights[1:]]
        if scales:
            out += [_aligned(scales[0]), *scales[1:]]
        return out

    def estimate(self) -> int:
        pad = 2 * ALIGN if self.expert is not None else 0
        return sum(s.nbytes for s in self.specs()) + pad


class SourceFetcher(Protocol):
    """Brings source shards to disk only while a conversion needs them (``coli pull``): the
    source directory then holds every shard's header (the catalog is built from them) but the
    tensor bytes of a shard only between ``need`` and ``release``."""

    def need(self, paths: Sequence[Path]) -> None:
        """Make these source files whole on disk (the next output shard reads them)."""
        ...

    def release(self, paths: Sequence[Path]) -> None:
        """No output shard still to write reads these files."""
        ...


def _source_files(plan: _ShardPlan) -> set[Path]:
    """The source files whose bytes writing ``plan`` reads."""
    out: set[Path] = set()
    for unit in plan.units:
        for it in unit.items:
            out.add(it.info.path)
            if it.scale is not None:
                out.add(it.scale.path)
    return out


@dataclass(frozen=True)
class _ShardPlan:
    file: str
    kind: ShardKind
    units: tuple[_Unit, ...]
    specs: tuple[TensorSpec, ...]
    header: bytes
    layout: tuple[tuple[TensorSpec, int], ...]
    size: int
    experts: tuple[ExpertEntry, ...]
    n_tensors: int


def _aligned(spec: TensorSpec) -> TensorSpec:
    return TensorSpec(spec.name, spec.dtype, spec.shape, ALIGN)


def _plan_shards(catalog: _Catalog, options: ConvertOptions) -> list[_ShardPlan]:
    n_main = catalog.arch.num_hidden_layers
    dense: dict[int, list[_Item]] = {}
    experts: dict[tuple[int, int], list[_Item]] = {}
    for it in catalog.items:
        layer = -1 if it.layer is None else it.layer
        if it.expert is not None:
            experts.setdefault((layer, it.expert), []).append(it)
        else:
            dense.setdefault(layer, []).append(it)
    units: list[_Unit] = []
    for layer in sorted(set(dense) | {k[0] for k in experts}):
        if layer in dense:
            units.append(_Unit(layer, None, tuple(sorted(dense[layer], key=lambda x: x.name))))
        for lay, e in sorted(k for k in experts if k[0] == layer):
            parts = sorted(experts[(lay, e)], key=lambda x: PROJ_ORDER.index(x.proj or ""))
            if [p.proj for p in parts] != list(PROJ_ORDER):
                raise ConversionError(
                    f"layer {lay} expert {e}: found {[p.proj for p in parts]}, need all of "
                    f"{list(PROJ_ORDER)}"
                )
            units.append(_Unit(lay, e, tuple(parts)))
    # A source name that collides with a generated one (``X.weight.qs``) would make the
    # container ambiguous for every reader.
    seen: set[str] = set()
    for u in units:
        for spec in u.specs():
            if spec.name in seen:
                raise ConversionError(
                    f"tensor name {spec.name!r} would occur twice in the output (a source "
                    "tensor collides with a generated scales name); rename it in the source"
                )
            seen.add(spec.name)
    main = [u for u in units if u.layer < n_main]
    mtp = [u for u in units if u.layer >= n_main]
    plans = _pack(main, "out-", "main", options.shard_size)
    return plans + _pack(mtp, "out-mtp-", "mtp", options.shard_size)


def _pack(units: Sequence[_Unit], prefix: str, kind: ShardKind, target: int) -> list[_ShardPlan]:
    """Greedy, in model order: a new shard starts when the next unit would pass ``target``."""
    groups: list[list[_Unit]] = []
    cur: list[_Unit] = []
    size = 0
    for u in units:
        est = u.estimate()
        if cur and size + est > target:
            groups.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += est
    if cur:
        groups.append(cur)
    plans = []
    for k, g in enumerate(groups):
        ordered = [u for u in g if u.expert is None] + [u for u in g if u.expert is not None]
        plans.append(_layout_shard(f"{prefix}{k:05d}.safetensors", kind, ordered))
    return plans


def _layout_shard(file: str, kind: ShardKind, units: Sequence[_Unit]) -> _ShardPlan:
    specs = [s for u in units for s in u.specs()]
    header, layout = plan_layout(specs, header_align=ALIGN)
    end = len(header) + (layout[-1][1] + layout[-1][0].nbytes if layout else 0)
    tail = (-end) % ALIGN
    if tail:
        # The header is padded to 4 KiB, so appending a tensor never moves the others' alignment.
        specs.append(TensorSpec(f"{PAD_PREFIX}tail", "U8", (tail,)))
        header, layout = plan_layout(specs, header_align=ALIGN)
    data0 = len(header)
    size = data0 + (layout[-1][1] + layout[-1][0].nbytes if layout else 0)
    if size % ALIGN:
        raise ConversionError(f"{file}: internal layout error (size {size} not 4 KiB aligned)")
    offs = {s.name: (data0 + o, data0 + o + s.nbytes) for s, o in layout}
    entries = []
    for u in units:
        if u.expert is None:
            continue
        names = [it.name for it in u.items]
        spans = [offs[n] for n in names]
        contiguous = all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1))
        if spans[0][0] % ALIGN or not contiguous:
            raise ConversionError(f"{file}: internal layout error for expert {names[0]}")
        qs = [offs[n + ".qs"] for n in names if n + ".qs" in offs]
        entries.append(
            ExpertEntry(
                u.layer,
                u.expert,
                file,
                spans[0][0],
                spans[-1][1],
                qs[0][0] if qs else None,
                qs[-1][1] if qs else None,
            )
        )
    n_real = sum(1 for s in specs if not s.name.startswith(PAD_PREFIX))
    return _ShardPlan(
        file, kind, tuple(units), tuple(specs), header, tuple(layout), size, tuple(entries), n_real
    )


# ----------------------------------------------------------------------------- producing bytes


def _to_f32(raw: npt.NDArray[np.generic], dtype: str) -> F32Array:
    if dtype == "BF16":
        return bf16_to_f32(raw.view(np.uint16))
    return np.ascontiguousarray(raw, dtype=np.float32)


def _row_slice(info: TensorInfo, r0: int, r1: int) -> TensorInfo:
    """Rows ``[r0, r1)`` of a row-major 2-D tensor, as a tensor of its own."""
    row = info.shape[1] * DTYPE_SIZES[info.dtype]
    shape = (r1 - r0, info.shape[1])
    return TensorInfo(
        info.name, info.dtype, shape, info.path, info.start + r0 * row, info.start + r1 * row
    )


def _load_rows(item: _Item, r0: int, r1: int, scale: F32Array | None) -> F32Array:
    """float32 rows ``[r0, r1)`` of a source weight; FP8 uses the matching 128-row blocks."""
    info = item.info
    whole = len(info.shape) != 2 or (r0 == 0 and r1 == info.shape[0])
    raw = read_tensor(info if whole else _row_slice(info, r0, r1))
    if info.dtype != "F8_E4M3":
        return _to_f32(raw, info.dtype)
    if scale is None:  # the catalog guarantees scales; kept for a clear message
        raise ConversionError(f"{info.path}: tensor {item.name!r}: FP8 without block scales")
    bo = FP8_BLOCK[0]
    blocks = scale[r0 // bo : -(-r1 // bo)]  # r0 is a multiple of 128 (see _item_arrays)
    return fp8_block_dequantize(raw.view(np.uint8), blocks, FP8_BLOCK)


def _check_finite(item: _Item, w: npt.NDArray[np.floating]) -> None:
    """A source weight holding NaN or inf would convert into a model that answers garbage
    (or stops at its first token), with checksums that vouch for the damage."""
    if not np.isfinite(w).all():
        raise ConversionError(
            f"{item.info.path}: tensor {item.name!r} holds NaN or infinite values; the source "
            "checkpoint is damaged (re-download it)"
        )


def _convert_rows(
    item: _Item, fmt: QuantFormat, r0: int, r1: int, scale: F32Array | None
) -> list[npt.NDArray[np.generic]]:
    w = _load_rows(item, r0, r1, scale)
    _check_finite(item, w)
    if fmt.kind == "f32":
        return [w]
    qt = quantize(w, fmt)
    if fmt.kind == "f16" and not np.isfinite(qt.data.view(np.float16)).all():
        big = float(np.abs(w).max())
        raise ConversionError(
            f"{item.info.path}: tensor {item.name!r} holds values up to {big:.6g}, beyond "
            f"float16's range (65504): as f16 they would be infinite; convert its role "
            "(--dense / --experts / --io) to bf16 or f32 instead"
        )
    return [qt.data] if qt.scales is None else [qt.data, qt.scales]


def _item_arrays(item: _Item) -> list[npt.NDArray[np.generic]]:
    """The output arrays of one tensor, in :meth:`_Item.specs` order.

    Big matrices (embed_tokens, lm_head: 3.8 GB as f32 on GLM-5) are converted in row blocks:
    every format is row-independent, so the bytes equal a whole-matrix conversion while the
    working set stays at about ``_ROW_CHUNK_BYTES`` plus the (smaller) output."""
    fmt, info = item.fmt, item.info
    if fmt is None:
        raw = read_tensor(info)
        if info.dtype in ("F32", "F16", "BF16"):
            _check_finite(item, _to_f32(raw, info.dtype))
        return [raw]
    scale = None
    if item.scale is not None:
        scale = _to_f32(read_tensor(item.scale), item.scale.dtype)
    if len(info.shape) != 2:
        return _convert_rows(item, fmt, 0, 0, scale)
    o, i = info.shape
    bo = FP8_BLOCK[0]
    step = max(bo, (_ROW_CHUNK_BYTES // max(1, 4 * i)) // bo * bo)
    if step >= o:
        return _convert_rows(item, fmt, 0, o, scale)
    outs = [np.empty(spec.nbytes, dtype=np.uint8) for spec in item.specs()]
    fill = [0] * len(outs)
    for r0 in range(0, o, step):
        parts = _convert_rows(item, fmt, r0, min(o, r0 + step), scale)
        for k, a in enumerate(parts):
            b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            outs[k][fill[k] : fill[k] + b.size] = b
            fill[k] += b.size
    if fill != [a.size for a in outs]:
        raise ConversionError(f"{info.path}: tensor {item.name!r}: internal row-block error")
    return list(outs)


def _shard_arrays(plan: _ShardPlan) -> Iterator[tuple[str, npt.NDArray[np.generic]]]:
    """(spec name, array) in file order, one tensor (or one expert) in memory at a time."""
    for u in plan.units:
        if u.expert is None:
            for it in u.items:
                arrs = _item_arrays(it)
                for spec, a in zip(it.specs(), arrs, strict=True):
                    yield spec.name, a
            continue
        outs = [(it, _item_arrays(it)) for it in u.items]
        for it, arrs in outs:
            yield it.name, arrs[0]
        for it, arrs in outs:
            if len(arrs) > 1:
                yield it.name + ".qs", arrs[1]
    for s in plan.specs:
        if s.name == f"{PAD_PREFIX}tail":
            yield s.name, np.zeros(s.nbytes, dtype=np.uint8)


def _write_shard(
    dst: Path, plan: _ShardPlan, report: ProgressFn, base: int, total: int
) -> ShardEntry:
    # Hash the exact bytes write_safetensors emits (header, its zero pads, our chunks) as they
    # stream by, so a 2 GiB shard is not read back just to checksum it.
    h = hashlib.sha256(plan.header)
    pos = len(plan.header)
    real = {s.name for s in plan.specs}
    layout = list(plan.layout)

    def chunks() -> Iterator[npt.NDArray[np.generic]]:
        nonlocal pos
        li = 0
        for name, arr in _shard_arrays(plan):
            while layout[li][0].name not in real:
                pad = bytes(layout[li][0].nbytes)
                h.update(pad)
                pos += len(pad)
                li += 1
            spec = layout[li][0]
            li += 1
            if spec.name != name:
                raise ConversionError(f"{plan.file}: internal order error ({name} vs {spec.name})")
            a = np.ascontiguousarray(arr)
            h.update(a.data)  # no copy: the writer also takes the array's buffer as is
            pos += a.nbytes
            report(base + pos, total, f"{plan.file}: {name}")
            yield a
        # The writer stops pulling after the last tensor; `pos == plan.size` below is the
        # check that every byte was hashed.

    path = dst / plan.file
    try:
        write_safetensors(path, plan.specs, chunks(), header_align=ALIGN)
    except SafetensorsError as exc:
        with contextlib.suppress(OSError):
            path.with_name(path.name + ".tmp").unlink()
        if isinstance(exc.__cause__, OSError):  # a full or failing disk: the done shards stay
            raise ConversionError(
                f"{exc}; the shards already written are kept: free space (or fix the drive) "
                "and rerun the same command (it resumes)"
            ) from exc
        raise
    except BaseException:
        # Tidy up on an orderly failure; after a hard kill the next run removes the .tmp.
        with contextlib.suppress(OSError):
            path.with_name(path.name + ".tmp").unlink()
        raise
    fsync_dir(dst)
    size = path.stat().st_size
    if size != plan.size or pos != plan.size:
        raise ConversionError(f"{path}: wrote {size} bytes, planned {plan.size} (internal error)")
    return ShardEntry(plan.file, plan.kind, plan.size, h.hexdigest(), plan.n_tensors)


# ----------------------------------------------------------------------------- the run


# Weight files of other formats (PyTorch, GGUF, ...) a DST must not hold.
_FOREIGN_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")


def _check_not_a_checkpoint(dst: Path) -> None:
    """Refuse a DST holding another model's weights (a Hugging Face checkpoint, say): the
    container's config.json and tokenizer would overwrite theirs, and its shards would sit
    beside tensors of the same names (a model no reader can open). --force does not help:
    it removes colibri's files only."""
    names = os.listdir(dst)
    other = sorted(n for n in names if n.endswith(".safetensors") and not _SHARD_RE.match(n))
    if not other and not any(_SHARD_RE.match(n) or n in (MANIFEST_NAME, STATE_NAME) for n in names):
        # nothing of a conversion here: weights of another format, or the config / tokenizer
        # of another model, would be overwritten all the same
        other = sorted(n for n in names if n.endswith(_FOREIGN_WEIGHTS) or n in SIDE_FILES)
    if other:
        raise ConversionError(
            f"{dst} holds {other[0]}" + (f" (and {len(other) - 1} more)" if len(other) > 1 else "")
            + ", another model's weights or files; convert into an empty directory"
        )  # fmt: skip


def _run(
    source: _Source,
    catalog: _Catalog,
    plans: list[_ShardPlan],
    total: int,
    rec: dict[str, str | int],
    dst: Path,
    force: bool,
    report: ProgressFn,
    fetch: SourceFetcher | None = None,
) -> ConvertResult:
    _check_not_a_checkpoint(dst)
    if force:
        _wipe(dst)
    _remove_stale_tmp(dst)
    planned = {p.file: p for p in plans}
    notes = list(catalog.notes)
    candidates: dict[str, ShardEntry] = {}

    manifest_path = dst / MANIFEST_NAME
    state = _read_state(dst)
    if manifest_path.exists():
        try:
            old = Manifest.load(manifest_path)
        except ConfigError as exc:
            raise ConversionError(f"{exc}; pass --force to start over") from exc
        _check_same(
            dst, old.converter_version, dict(old.options), old.source, rec, source, finished=True
        )
        same_files = [s.file for s in old.shards] == [p.file for p in plans] and all(
            s.size == planned[s.file].size for s in old.shards
        )
        if same_files and not verify_shards(dst, old):  # sizes only: a no-op must be fast
            with contextlib.suppress(FileNotFoundError):
                (dst / STATE_NAME).unlink()
            fixed = _sync_side_files(dst, source, catalog)
            report(total, total, "already converted")
            return ConvertResult(
                dst,
                old,
                (),
                tuple(s.file for s in old.shards),
                old.unknown_tensors,
                # only what this run did (the conversion's own notes were said when it ran)
                (f"rewrote {', '.join(fixed)} from the source (missing or changed)",)
                if fixed
                else (),
                already_complete=True,
            )
        # Damaged finished container: salvage what still checks out, redo the rest. The state
        # file (every old shard a candidate, re-verified below) is written before the manifest
        # goes, so that a crash in between (re-hashing a large model takes long) leaves an
        # interrupted conversion a rerun resumes, not shards nothing claims.
        candidates = {s.file: s for s in old.shards}
        _write_state(dst, rec, source.identity, plans, candidates)
        manifest_path.unlink()
        fsync_dir(dst)
    elif state is not None:
        candidates = _state_done(state)
        if candidates:  # (a run that finished no shard has nothing to keep: it starts over)
            opts = state.get("options")
            _check_same(
                dst,
                str(state.get("converter_version")),
                opts if isinstance(opts, dict) else {},
                _state_source(state),
                rec,
                source,
            )
    else:
        foreign = sorted(n for n in os.listdir(dst) if _SHARD_RE.match(n))
        if foreign:
            raise ConversionError(
                f"{dst} already holds {foreign[0]} (and {len(foreign) - 1} more) from a "
                f"conversion this one did not start; pass --force to overwrite them"
            )

    done: dict[str, ShardEntry] = {}
    checked = 0
    for file, entry in sorted(candidates.items()):
        p = planned.get(file)
        path = dst / file
        if p is None or entry.size != p.size or not path.is_file():
            continue
        if path.stat().st_size != entry.size:
            continue
        report(checked, total, f"verifying {file}")
        if sha256_file(path) == entry.sha256:
            done[file] = entry
            checked += entry.size
    if done:
        notes.append(f"resumed: {len(done)} of {len(plans)} shards were already done and verified")

    _check_disk(dst, source, plans, done)

    _write_state(dst, rec, source.identity, plans, done)
    written: list[str] = []
    done_bytes = sum(planned[f].size for f in done)
    report(done_bytes, total, "converting")
    todo = [p for p in plans if p.file not in done]
    reads = [_source_files(p) for p in todo] if fetch is not None else []
    last_read = {path: i for i, paths in enumerate(reads) for path in paths}  # last reader
    for i, p in enumerate(todo):
        if fetch is not None:
            fetch.need(sorted(reads[i]))
        done[p.file] = _write_shard(dst, p, report, done_bytes, total)
        if fetch is not None:
            fetch.release(sorted(path for path in reads[i] if last_read[path] == i))
        done_bytes += p.size
        written.append(p.file)
        _write_state(dst, rec, source.identity, plans, done)

    _sync_side_files(dst, source, catalog)

    arch = catalog.arch
    manifest = Manifest(
        converter_version=CONVERTER_VERSION,
        model_type=arch.model_type,
        num_hidden_layers=arch.num_hidden_layers,
        num_mtp_layers=arch.num_mtp_layers,
        options=rec,
        source=source.identity,
        shards=tuple(done[p.file] for p in plans),
        # per-expert CRC-32s, read back from the finished shards (what --verify-reads checks)
        experts=tuple(with_checksums(e, dst / p.file) for p in plans for e in p.experts),
        unknown_tensors=catalog.unknown,
    )
    with _writing(dst / MANIFEST_NAME):
        manifest.save(dst)  # last: its presence means "complete"
    with contextlib.suppress(FileNotFoundError):
        (dst / STATE_NAME).unlink()
    fsync_dir(dst)
    report(total, total, "done")
    reused = tuple(p.file for p in plans if p.file not in written)
    return ConvertResult(dst, manifest, tuple(written), reused, catalog.unknown, tuple(notes))


def _side_data(source: _Source, catalog: _Catalog, name: str) -> bytes:
    """The bytes of side file ``name`` (config.json, the tokenizer's files ...) in DST."""
    if name == "config.json" and catalog.mtp_dropped:
        cfg = source.config if source.config is not None else _read_json(source.root / name)
        cfg = {**cfg, "num_nextn_predict_layers": 0}
        return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
    if name == "config.json" and source.config is not None:  # an unwrapped text model's
        return (json.dumps(source.config, indent=2, sort_keys=True) + "\n").encode()
    try:
        return (source.root / name).read_bytes()
    except OSError as exc:
        raise ConversionError(f"{source.root / name}: cannot read: {exc}") from exc


def _sync_side_files(dst: Path, source: _Source, catalog: _Catalog) -> list[str]:
    """Rewrite the side files of a finished DST that are missing or differ from what the
    source gives now (deleted by hand, or a fixed tokenizer / generation config in the
    source): the names rewritten."""
    fixed = []
    for name in source.side_files:
        data = _side_data(source, catalog, name)
        try:
            same = (dst / name).read_bytes() == data
        except OSError:
            same = False
        if not same:
            with _writing(dst / name):
                atomic_write_bytes(dst / name, data)
            fixed.append(name)
    return fixed


def _check_same(
    dst: Path,
    old_version: str,
    old_opts: Mapping[str, Any],
    old_source: SourceIdentity | None,
    rec: Mapping[str, str | int],
    source: _Source,
    *,
    finished: bool = False,
) -> None:
    """Refuse to mix two different conversions in one dst. ``finished``: dst holds a complete
    container (its manifest), not an interrupted conversion: a model that --force would
    delete, so the message says so rather than offer --force as the way on."""
    if finished:
        why = None
        if old_version != CONVERTER_VERSION:
            why = f"by converter version {old_version} (this is {CONVERTER_VERSION})"
        elif any(old_opts.get(k) != rec[k] for k in rec):
            k = next(k for k in rec if old_opts.get(k) != rec[k])
            flag = f"--{k.replace('_', '-')}"
            why = f"with {flag} {old_opts.get(k)} (this run: {flag} {rec[k]})"
        elif old_source is None or not old_source.same_source(source.identity):
            why = f"from another source checkpoint than {source.root}"
        if why is not None:
            raise ConversionError(
                f"{dst} already holds a finished model, converted {why}; convert into an "
                "empty directory instead (--force would delete that model and convert anew)"
            )
        return
    if old_version != CONVERTER_VERSION:
        raise ConversionError(
            f"{dst} was started by converter version {old_version}, this is "
            f"{CONVERTER_VERSION}; pass --force to start over"
        )
    diff = [k for k in rec if old_opts.get(k) != rec[k]]
    if diff:
        was = " ".join(f"--{k.replace('_', '-')} {old_opts.get(k)}" for k in diff)
        now = " ".join(f"--{k.replace('_', '-')} {rec[k]}" for k in diff)
        raise ConversionError(
            f"{dst} was started with {was} (this run: {now}); rerun with the same options or "
            "pass --force to start over"
        )
    if old_source is None or not old_source.same_source(source.identity):
        raise ConversionError(
            f"{dst} was started from a different source checkpoint than {source.root} (file "
            "names, sizes or contents differ); rerun with the original SRC or pass --force to "
            "start over"
        )


def _check_disk(
    dst: Path, source: _Source, plans: Sequence[_ShardPlan], done: Mapping[str, ShardEntry]
) -> None:
    shards = sum(p.size for p in plans if p.file not in done)
    side = sum((source.root / n).stat().st_size for n in source.side_files)
    # Manifest: ~170 bytes per expert line and per shard line, plus the state file twice over.
    records = sum(len(p.experts) + 1 for p in plans)
    need = shards + side + 3 * 170 * records + FREE_DISK_FLOOR
    free = shutil.disk_usage(dst).free
    if free < need:
        raise ConversionError(
            f"not enough free disk space in {dst}: the conversion needs {need} bytes "
            f"({_human(need)}, including a {_human(FREE_DISK_FLOOR)} floor) but {free} bytes "
            f"({_human(free)}) are free; free some space or pick another DST"
        )


# ----------------------------------------------------------------------------- dst bookkeeping


def _is_ours(name: str) -> bool:
    base = temp_target(name) or (name[:-4] if name.endswith(".tmp") else name)
    return bool(_SHARD_RE.match(base)) or base in (MANIFEST_NAME, STATE_NAME, *SIDE_FILES)


def _wipe(dst: Path) -> None:
    for name in sorted(os.listdir(dst)):
        if _is_ours(name) and (dst / name).is_file():
            (dst / name).unlink()
    fsync_dir(dst)


def _remove_stale_tmp(dst: Path) -> None:
    # Only a dead run leaves .tmp files: the dir lock guarantees no live writer.
    for name in sorted(os.listdir(dst)):
        if name.endswith(".tmp") and _is_ours(name) and (dst / name).is_file():
            (dst / name).unlink()


def _read_state(dst: Path) -> dict[str, Any] | None:
    p = dst / STATE_NAME
    if not p.exists():
        return None
    return read_json_object(p, "; pass --force to start over")


def _state_source(state: Mapping[str, Any]) -> SourceIdentity | None:
    try:
        return SourceIdentity.from_json(state.get("source"), STATE_NAME)
    except ConfigError:
        return None


def _state_done(state: Mapping[str, Any]) -> dict[str, ShardEntry]:
    out: dict[str, ShardEntry] = {}
    raw = state.get("done")
    if not isinstance(raw, list):
        return out
    for x in raw:
        try:
            e = ShardEntry.from_json(x, STATE_NAME)
        except ConfigError:
            continue  # an unusable record only means that shard is redone
        out[e.file] = e
    return out


def _write_state(
    dst: Path,
    rec: Mapping[str, str | int],
    ident: SourceIdentity,
    plans: Sequence[_ShardPlan],
    done: Mapping[str, ShardEntry],
) -> None:
    doc = {
        "state_version": 1,
        "converter_version": CONVERTER_VERSION,
        "options": dict(rec),
        "source": ident.to_json(),
        "plan": [[p.file, p.size] for p in plans],
        "done": [done[p.file].to_json() for p in plans if p.file in done],
    }
    with _writing(dst / STATE_NAME):
        atomic_write_bytes(dst / STATE_NAME, (json.dumps(doc, indent=1) + "\n").encode())


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An OS error writing ``path`` (the state file, a side file, the manifest) as a
    :class:`ConversionError` naming it and what to do (a bare "No space left on device", or
    a temp file's name, said neither)."""
    try:
        yield
    except OSError as exc:
        what = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            hint = "free some space there and rerun the same command (it resumes)"
        elif exc.errno == errno.EROFS:
            hint = "the destination is on a read-only filesystem; pick another DST"
        else:
            hint = "check the destination directory and rerun (it resumes)"
        raise ConversionError(f"{path}: cannot write: {what}; {hint}") from exc


@contextlib.contextmanager
def _dir_lock(dst: Path) -> Iterator[None]:
    """Exclusive flock on the dst directory itself: no lock file to leave behind, and the kernel
    drops it when a killed converter dies."""
    fd = os.open(dst, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ConversionError(
                f"{dst}: another `coli convert` is writing here; wait for it or stop it"
            ) from exc
        yield
    finally:
        os.close(fd)


def _no_progress(done: int, total: int, message: str) -> None:
    return None


def _human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}" if unit != "B" else f"{n} B"
        x /= 1024
    return f"{n} B"  # pragma: no cover


# ----------------------------------------------------------------------------- entry point


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return obj


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m storage.convert SRC DST [...]`` (``coli convert`` is the user-facing CLI)."""
    ap = argparse.ArgumentParser(
        prog="python -m storage.convert",
        description="Convert a Hugging Face checkpoint into a colibri container (resumable).",
    )
    ap.add_argument("src")
    ap.add_argument("dst")
    for flag in ROLE_FLAGS:
        ap.add_argument(f"--{flag}", default=getattr(DEFAULTS, flag))
    ap.add_argument("--shard-size", type=int, default=DEFAULTS.shard_size)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    try:
        opts = ConvertOptions(a.experts, a.dense, a.io, a.mtp, a.shard_size)
        result = convert(a.src, a.dst, opts, force=a.force)
    except ColibriError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

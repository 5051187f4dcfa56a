"""A colibri model directory: config, tokenizer files, safetensors shards, and the two indexes the
runtime needs (tensor name -> entry with its storage format, routed expert -> one byte extent).

Layout (the public colibri int4 container opens as-is, and so does a plain HF bf16/f32 checkpoint):

* ``config.json`` (required), ``generation_config.json``, ``tokenizer.json``,
  ``tokenizer_config.json``, optional ``colibri-manifest.json`` written by our converter;
* ``*.safetensors`` shards, ordered ``out-NNNNN`` (main), then ``out-mtp-NNNNN`` (MTP head), then
  any other name (``out-idx-*``, ``model.safetensors``, ``model-00001-of-00002.safetensors``);
* a quantized matrix ``X.weight`` is U8 1-D packed bytes plus ``X.weight.qs`` F32 1-D scales;
  there is no format id on disk: the format is inferred from byte counts against the [O, I]
  that ``config.json`` implies (:func:`storage.quant.infer_format`);
* padding tensors ``__pad__.*`` (our aligned writer) are ignored;
* a routed expert's three matrices are byte-adjacent in one shard, so one read fetches it.

The shards may be spread over several directories (``Container.open(path, shard_dirs=...)``,
``--model-dir`` on the command line): config and tokenizer files come from ``path``, each shard is
looked up in ``path`` and then in every other directory, and a shard present in two directories
must be an identical copy (same size, same header bytes:
:func:`storage.multidisk.identity.compare_copy_file`) or the later one is refused with one
warning. A shard the manifest (or an HF ``model.safetensors.index.json``) lists but no directory
holds is an error naming the file and every directory searched.

Every problem a user can cause is a :class:`~storage.errors.ColibriError` naming the file (and the
tensor) and what to do. ``Container.open(path)`` is strict: the first problem raises.
``Container.open(path, strict=False)`` (used by ``coli doctor``) records per-shard and per-tensor
problems in :attr:`Container.problems` and keeps going, so one report can list them all.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from storage import jsontext
from storage.aligned import HugeArena
from storage.arch import ArchConfig, TensorRole, classify
from storage.errors import (
    ColibriError,
    ConfigError,
    ContainerError,
    ExpertLayoutError,
    FormatError,
    TensorNotFoundError,
)
from storage.manifest import CONVERT_STATE_NAME, Manifest
from storage.multidisk.identity import compare_copy_file
from storage.quant import QTensor, QuantFormat, bf16_to_f32, dequantize, infer_format
from storage.safetensors import (
    PAD_PREFIX,
    WRITTEN_BY_COLIBRI,
    ShardHeader,
    TensorInfo,
    read_header,
    read_tensor,
)

__all__ = [
    "CONFIG_NAME",
    "EXPERT_PROJS",
    "GENERATION_CONFIG_NAME",
    "MANIFEST_NAME",
    "SCALES_SUFFIX",
    "TOKENIZER_CONFIG_NAME",
    "TOKENIZER_NAME",
    "Container",
    "ExpertExtent",
    "TensorEntry",
    "find_shards",
    "model_home",
    "shard_paths",
]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
MANIFEST_NAME = "colibri-manifest.json"
HF_INDEX_NAME = "model.safetensors.index.json"
SCALES_SUFFIX = ".qs"
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

_MAIN_SHARD = re.compile(r"^out-\d+\.safetensors$")
_MTP_SHARD = re.compile(r"^out-mtp-\d+\.safetensors$")
_FLOAT_DTYPES = ("F32", "BF16", "F16")
_QUANT_DTYPES = ("U8", "I8")

F32Array = npt.NDArray[np.float32]

_log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TensorEntry:
    """One logical tensor of the container (a ``.qs`` companion is folded into its weight)."""

    name: str  # HF name, e.g. "model.layers.3.mlp.experts.7.up_proj.weight"
    fmt: QuantFormat | None  # storage format of a matrix (inferred); None for 1-D/plain tensors
    shape: tuple[int, ...]  # logical shape: [O, I] for matrices, else the stored shape
    weight: TensorInfo  # where the bytes are
    scales: TensorInfo | None  # the "<name>.qs" companion (F32 1-D) for int8/int4
    role: str | None  # arch.classify role ("expert", "dense", "io", "mtp", "f32"); None: unknown

    @property
    def nbytes(self) -> int:
        """Bytes on disk, scales included."""
        return self.weight.nbytes + (self.scales.nbytes if self.scales is not None else 0)


@dataclass(frozen=True)
class ExpertExtent:
    """Where one routed expert lives: its three matrices as one contiguous byte range.

    ``parts[proj] = (offset inside [start, end), nbytes, fmt, (O, I))``; the matrices may be in
    any order inside the extent. Scales are separate small tensors (``scales[proj]``, None for
    float formats) because the public layout stores them apart from the U8 matrices.
    """

    layer: int
    expert: int
    path: Path
    start: int  # absolute byte offset in ``path``
    end: int
    parts: dict[str, tuple[int, int, QuantFormat, tuple[int, int]]]
    scales: dict[str, TensorInfo | None]

    @property
    def nbytes(self) -> int:
        """Bytes of the blob (the three matrices, scales excluded)."""
        return self.end - self.start

    def qtensors(
        self, blob: npt.NDArray[np.uint8], scales: Mapping[str, npt.NDArray[Any] | None]
    ) -> dict[str, QTensor]:
        """Views of ``blob`` as one :class:`QTensor` per projection (zero copy).

        ``blob`` is a uint8 1-D array whose first ``nbytes`` bytes are the file bytes
        ``[start, end)`` (a larger aligned read buffer works as is); ``scales[proj]`` is that
        projection's scales (float32 1-D) or None for float formats. The returned tensors alias
        ``blob``: keep it alive and unmodified while they are in use.
        """
        where = f"{self.path}: layer {self.layer} expert {self.expert}"
        if blob.dtype != np.uint8 or blob.ndim != 1 or blob.size < self.nbytes:
            raise ContainerError(
                f"{where}: blob must be uint8 1-D with at least {self.nbytes} bytes, got "
                f"{blob.dtype} {blob.shape}"
            )
        out: dict[str, QTensor] = {}
        for proj, (off, nb, fmt, (o, i)) in self.parts.items():
            raw = blob[off : off + nb]  # [nb] view
            if fmt.quantized:
                s = scales.get(proj)
                if s is None:
                    raise FormatError(f"{where}: {proj} is {fmt.name} but no scales were given")
                s32 = np.asarray(s, dtype=np.float32).reshape(-1)  # [n_scales]
                if s32.size != fmt.n_scales(o, i):
                    raise FormatError(
                        f"{where}: {proj} is {fmt.name} [{o}, {i}] and needs "
                        f"{fmt.n_scales(o, i)} scales, got {s32.size}"
                    )
                out[proj] = QTensor(fmt, (o, i), raw, s32)
            elif fmt.kind == "f32":
                out[proj] = QTensor(fmt, (o, i), raw.view(np.float32).reshape(o, i))
            else:  # bf16 / f16 as raw uint16 bits
                out[proj] = QTensor(fmt, (o, i), raw.view(np.uint16).reshape(o, i))
        return out

    def read_blob(self, out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """Read ``[start, end)`` with a plain pread (a reference path: the runtime has a reader)
        into a fresh array, or into ``out`` (uint8, C-contiguous, exactly ``nbytes``: e.g. a
        piece of a :class:`HugeArena`), which is returned."""
        name = f"layer {self.layer} expert {self.expert}"
        info = TensorInfo(name, "U8", (self.nbytes,), self.path, self.start, self.end)
        return np.asarray(read_tensor(info, out), dtype=np.uint8)

    def read_scales(self) -> dict[str, F32Array | None]:
        """Read every projection's scales (None for float formats)."""
        return {
            proj: None if info is None else np.asarray(read_tensor(info), np.float32).reshape(-1)
            for proj, info in self.scales.items()
        }


def shard_paths(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The ``*.safetensors`` files of a model directory in container order: ``out-NNNNN`` main
    shards, then ``out-mtp-NNNNN``, then any other name, each group sorted by name. Hidden files
    (``._*`` from macOS copies) and ``*.tmp`` leftovers are not shards."""
    d = Path(model_dir)
    try:
        files = [p for p in d.iterdir() if p.name.endswith(".safetensors")]
    except OSError as exc:
        raise ContainerError(f"{d}: cannot list the directory: {exc.strerror or exc}") from exc
    try:
        files = [p for p in files if not p.name.startswith(".") and p.is_file()]
    except OSError as exc:  # listable but not searchable (mode r-- without x)
        raise ContainerError(
            f"{d}: cannot look at its files ({exc.strerror or exc}); make the directory "
            "searchable (chmod a+x)"
        ) from exc
    return sorted(files, key=_shard_rank)


def _shard_rank(p: Path) -> tuple[int, str]:
    if _MAIN_SHARD.match(p.name):
        return (0, p.name)
    if _MTP_SHARD.match(p.name):
        return (1, p.name)
    return (2, p.name)


def model_home(dirs: Sequence[str | os.PathLike[str]]) -> Path:
    """The directory of ``dirs`` that holds ``config.json`` (the first one that does), else the
    first directory: where config, tokenizer and manifest are read from."""
    if not dirs:
        raise ContainerError("no model directory given")
    for d in dirs:
        if (Path(d) / CONFIG_NAME).is_file():
            return Path(d)
    return Path(dirs[0])


def _unique_dirs(dirs: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        if any(d == o or (d.exists() and o.exists() and os.path.samefile(d, o)) for o in out):
            continue
        out.append(d)
    return out


def find_shards(
    dirs: Sequence[str | os.PathLike[str]], expected: Sequence[str] | None = None
) -> tuple[list[Path], list[ColibriError]]:
    """The shard files of a model spread over ``dirs`` (searched in order), in container order,
    and the problems found (a missing directory, a shard in ``expected`` that no directory holds).

    A shard name found in several directories is taken from the first; a later copy is ignored
    when it is an identical copy (same size and header bytes) and refused with one warning when
    it is not (it cannot be told which one is stale)."""
    paths = _unique_dirs([Path(d) for d in dirs])
    problems: list[ColibriError] = []
    found: dict[str, Path] = {}
    for d in paths:
        if not d.is_dir():
            what = "does not exist" if not d.exists() else "is not a directory"
            problems.append(ContainerError(f"model directory {d} {what}"))
            continue
        for p in shard_paths(d):
            first = found.get(p.name)
            if first is None:
                found[p.name] = p
                continue
            why = compare_copy_file(first, p)
            if why is not None:
                _log.warning("shard copy refused", file=str(p), used=str(first), reason=why)
    searched = ", ".join(str(d) for d in paths)
    for name in expected or ():
        if name not in found:
            problems.append(
                ContainerError(
                    f"shard {name} is in none of the model directories searched ({searched}); "
                    "copy it into one of them or add the directory that holds it (--model-dir)"
                )
            )
    return sorted(found.values(), key=_shard_rank), problems


def _expected_shards(
    d: Path, manifest: Mapping[str, Any] | None, problems: _Problems
) -> list[str] | None:
    """Shard file names the manifest (else an HF index) says the model has; None if unknown."""
    if manifest is not None:
        shards = manifest.get("shards")
        if isinstance(shards, list):
            names = [s.get("file") for s in shards if isinstance(s, dict)]
            return [n for n in names if isinstance(n, str) and n]
    try:
        index = _load_json(d / HF_INDEX_NAME, required=False)
    except ConfigError as exc:
        problems.add(exc)
        return None
    wmap = None if index is None else index.get("weight_map")
    if not isinstance(wmap, dict):
        return None
    return sorted({v for v in wmap.values() if isinstance(v, str) and v})


_NUMBERED = re.compile(r"^(out(?:-mtp|-idx)?)-(\d{5})\.safetensors$")


def _numbering_gaps(names: set[str]) -> list[str]:
    """Shard names missing from the public layout's numbering (``out-00000``, ``out-00001``,
    ... and the same for ``out-mtp-`` and ``out-idx-``: each series from 00000, no gaps)."""
    series: dict[str, set[int]] = {}
    for n in names:
        m = _NUMBERED.match(n)
        if m is not None:
            series.setdefault(m.group(1), set()).add(int(m.group(2)))
    return [
        f"{prefix}-{i:05d}.safetensors"
        for prefix, got in sorted(series.items())
        for i in range(max(got))
        if i not in got
    ]


def _load_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when absent and not required."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: file not found") from None
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    try:
        doc = jsontext.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "fix or re-download the file"
        ) from exc
    except ValueError as exc:  # a huge integer; arrays nested too deeply
        raise ConfigError(f"{path}: not valid JSON ({exc}); fix or re-download the file") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _eos_ids(sources: list[tuple[Path, Mapping[str, Any]]]) -> list[int]:
    ids: set[int] = set()
    for where, doc in sources:
        v = doc.get("eos_token_id")
        if v is None:
            continue
        for x in v if isinstance(v, list) else [v]:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise ConfigError(
                    f"{where}: eos_token_id must be a token id or a list of token ids, got {v!r}"
                )
            ids.add(x)
    return sorted(ids)


class _Problems:
    """Strict mode raises at once; lenient mode collects (``coli doctor`` lists them all)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.items: list[ColibriError] = []

    def add(self, err: ColibriError) -> None:
        if self.strict:
            raise err
        self.items.append(err)


class Container:
    """An opened model directory (headers only: opening reads no tensor data).

    Attributes: ``path``, ``config`` (raw config.json), ``arch``, ``generation_config`` ({} if
    absent), ``eos_token_ids`` (union of config and generation_config, sorted), ``shards`` (each
    validated; a shard's path is the file in whichever directory holds it), ``dirs`` (the
    directories searched for shards, ``path`` first), ``manifest`` (parsed
    ``colibri-manifest.json`` or None) and ``problems`` (always empty when opened strict).
    """

    path: Path
    dirs: tuple[Path, ...]
    config: dict[str, Any]
    arch: ArchConfig
    generation_config: dict[str, Any]
    eos_token_ids: list[int]
    shards: list[ShardHeader]
    manifest: dict[str, Any] | None
    problems: list[ColibriError]

    def __init__(
        self,
        *,
        path: Path,
        config: dict[str, Any],
        arch: ArchConfig,
        generation_config: dict[str, Any],
        eos_token_ids: list[int],
        shards: list[ShardHeader],
        manifest: dict[str, Any] | None,
        entries: dict[str, TensorEntry],
        bad: dict[str, ColibriError],
        experts: dict[tuple[int, int], ExpertExtent],
        bad_experts: dict[tuple[int, int], ColibriError],
        problems: list[ColibriError],
        dirs: tuple[Path, ...] = (),
    ) -> None:
        """Internal: use :meth:`Container.open`."""
        self.path = path
        self.dirs = dirs or (path,)
        self.config = config
        self.arch = arch
        self.generation_config = generation_config
        self.eos_token_ids = eos_token_ids
        self.shards = shards
        self.manifest = manifest
        self.problems = problems
        self._entries = entries
        self._bad = bad
        self._experts = experts
        self._bad_experts = bad_experts
        self._arena: HugeArena | None = None  # made by the first load_qtensor

    # ------------------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        strict: bool = True,
        shard_dirs: Sequence[str | os.PathLike[str]] = (),
    ) -> Container:
        """Open a model directory: parse config.json, every shard header, infer every matrix's
        format and index every routed expert.

        ``shard_dirs``: more directories holding some of the shards (see the module docstring);
        ``path`` holds config.json and is searched first. ``strict=False`` still raises for an
        unusable directory or config.json, but records shard, tensor and expert problems in
        :attr:`problems` instead of raising them.
        """
        d = Path(path)
        if not d.is_dir():
            what = "does not exist" if not d.exists() else "is not a directory"
            raise ContainerError(
                f"{d} {what}; pass the model directory (the one holding config.json and "
                "*.safetensors)"
            )
        cfg_path = d / CONFIG_NAME
        if not cfg_path.is_file() and (d / CONVERT_STATE_NAME).is_file():
            # the converter writes config.json after the shards: this is its work in progress
            raise ContainerError(
                f"{d} holds an interrupted `coli convert` (no {CONFIG_NAME} yet): rerun the "
                "same `coli convert SRC DST` to finish it (it keeps the finished shards)"
            )
        if not cfg_path.is_file():
            raise ContainerError(
                f"{d} is not a colibri model directory: {CONFIG_NAME} not found (convert a "
                "Hugging Face checkpoint with `coli convert`, or point at the directory that "
                "holds config.json)"
            )
        config = _load_json(cfg_path, required=True) or {}
        arch = ArchConfig.from_dict(config, where=str(cfg_path))
        problems = _Problems(strict)

        generation_config: dict[str, Any] = {}
        manifest: dict[str, Any] | None = None
        try:
            generation_config = _load_json(d / GENERATION_CONFIG_NAME, required=False) or {}
        except ConfigError as exc:
            problems.add(exc)
        try:
            manifest = _load_json(d / MANIFEST_NAME, required=False)
            if manifest is not None:
                # its structure too (the doctor's check): a manifest whose shard list cannot be
                # read would leave the missing-shard checks below with nothing to compare
                Manifest.from_json(manifest, str(d / MANIFEST_NAME))
        except ConfigError as exc:
            problems.add(exc)
        eos: list[int] = []
        try:
            eos = _eos_ids([(cfg_path, config), (d / GENERATION_CONFIG_NAME, generation_config)])
        except ConfigError as exc:
            problems.add(exc)

        shards: list[ShardHeader] = []
        listed = _expected_shards(d, manifest, problems)
        if shard_dirs:
            dirs = tuple(_unique_dirs([d, *(Path(x) for x in shard_dirs)]))
            paths, missing = find_shards(dirs, listed)
            for err in missing:
                problems.add(err)
        else:
            dirs = (d,)
            paths = shard_paths(d)
            # the converter's own list (else a Hugging Face index): a shard it names must be
            # here (one an index named was found missing only through the tensors it held:
            # "the conversion is incomplete", or an MTP layer silently absent)
            present = {p.name for p in paths}
            source = MANIFEST_NAME if manifest is not None else HF_INDEX_NAME
            for name in listed or []:
                if name not in present:
                    problems.add(
                        ContainerError(
                            f"{d / name}: listed in {source} but missing; the download or "
                            "copy is incomplete (copy the file, or pass --model-dir for "
                            "shards kept elsewhere)"
                        )
                    )
        if listed is None:  # no list: the public layout numbers its shards without gaps
            where = "" if len(dirs) == 1 else " from every model directory searched"
            for gap in _numbering_gaps({p.name for p in paths}):
                problems.add(
                    ContainerError(
                        f"{d / gap}: missing{where} (the shards are numbered from 00000 "
                        "without gaps); the download or copy is incomplete"
                    )
                )
        for p in paths:
            try:
                shards.append(read_header(p))
            except ColibriError as exc:
                problems.add(exc)
        if not paths:
            where = ", ".join(str(x) for x in dirs)
            problems.add(
                ContainerError(
                    f"{where}: no *.safetensors shards found; the download or conversion is "
                    "incomplete"
                )
            )

        # (a container without colibri's manifest, whose shards do not say colibri wrote
        # them, may be the C engine's: its group rule first). colibri's: the public-layout
        # writer's mark, or `coli convert`'s alignment padding (a converted container whose
        # manifest was deleted read its ragged g64 matrices as g48), which the C engine's
        # converter never writes.
        ours = any(
            any(sh.metadata.get(k) == v for k, v in WRITTEN_BY_COLIBRI.items())
            or any(n.startswith(PAD_PREFIX) for n in sh.tensors)
            for sh in shards
        )
        entries, bad, roles = _index_tensors(
            d, arch, shards, problems, exact_first=manifest is None and not ours
        )
        experts, bad_experts = _index_experts(arch, entries, bad, roles, problems)
        return cls(
            path=d,
            config=config,
            arch=arch,
            generation_config=generation_config,
            eos_token_ids=eos,
            shards=shards,
            manifest=manifest,
            entries=entries,
            bad=bad,
            experts=experts,
            bad_experts=bad_experts,
            problems=problems.items,
            dirs=dirs,
        )

    @property
    def unusable(self) -> Mapping[str, ColibriError]:
        """Tensors present in a shard but unusable (size matching no format, ...), with the
        reason; only ever non-empty for a container opened with ``strict=False``."""
        return MappingProxyType(self._bad)

    def __repr__(self) -> str:
        return (
            f"Container({str(self.path)!r}, {self.arch.model_type}, {len(self.shards)} shards, "
            f"{len(self._entries)} tensors, {len(self._experts)} experts)"
        )

    # ------------------------------------------------------------------------------ tensors

    def has(self, name: str) -> bool:
        """Whether a usable tensor ``name`` exists (``.qs`` companions and padding excluded)."""
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        """The entry of ``name``; :class:`TensorNotFoundError` if absent (or the recorded
        problem if the tensor exists but is unusable)."""
        ent = self._entries.get(name)
        if ent is not None:
            return ent
        if name in self._bad:
            raise self._bad[name]
        raise TensorNotFoundError(
            f"{self.path}: tensor {name!r} is in none of the {len(self.shards)} shards; the "
            "download or conversion is incomplete (run `coli doctor --model "
            f"{self.path}`)"
        )

    def names(self) -> list[str]:
        """Sorted tensor names (padding tensors and ``.qs`` companions excluded)."""
        return sorted(self._entries)

    def load_qtensor(self, name: str) -> QTensor:
        """A matrix in its stored format: f32 as float32 [O, I], bf16/f16 as uint16 raw bits
        [O, I], int8/int4 as uint8 1-D packed bytes plus float32 1-D scales."""
        ent = self.entry(name)
        if ent.fmt is None:
            raise FormatError(
                f"{ent.weight.path}: tensor {name!r} is not a matrix with a shape colibri "
                "knows (read it with load_f32)"
            )
        o, i = ent.shape
        raw = self._read_resident(ent.weight)
        if ent.fmt.quantized:
            if ent.scales is None:  # format inference never lets this happen
                raise FormatError(f"{ent.weight.path}: tensor {name!r} has no scales")
            scales = np.asarray(self._read_resident(ent.scales), dtype=np.float32).reshape(-1)
            return QTensor(ent.fmt, (o, i), raw.view(np.uint8).reshape(-1), scales)
        if ent.fmt.kind == "f32":
            return QTensor(ent.fmt, (o, i), raw.reshape(o, i))
        return QTensor(ent.fmt, (o, i), raw.view(np.uint16).reshape(o, i))

    def _read_resident(self, info: TensorInfo) -> npt.NDArray[np.generic]:
        """A matrix's bytes (or its scales) read into this container's :class:`HugeArena`:
        weights that stay resident sit packed on transparent huge pages where the kernel
        allows them."""
        arena = self._arena
        if arena is None:  # a race here makes two arenas, both correct
            arena = self._arena = HugeArena()
        return read_tensor(info, arena.empty(info.nbytes))

    def load_f32(self, name: str) -> F32Array:
        """Any tensor as float32: F32/BF16/F16 stored tensors in their stored shape (matrices
        in their logical [O, I]); a quantized matrix is dequantized to [O, I]."""
        ent = self.entry(name)
        if ent.fmt is not None and ent.fmt.quantized:
            return dequantize(self.load_qtensor(name))
        dt = ent.weight.dtype
        if dt not in _FLOAT_DTYPES:
            raise FormatError(
                f"{ent.weight.path}: tensor {name!r} is stored as {dt}, not a float dtype "
                f"({', '.join(_FLOAT_DTYPES)}); it cannot be read as float32"
            )
        raw = read_tensor(ent.weight)
        if dt == "BF16":
            out = bf16_to_f32(raw.view(np.uint16))
        else:
            out = np.asarray(raw, dtype=np.float32)
        return out.reshape(ent.shape)

    # ------------------------------------------------------------------------------ experts

    def expert(self, layer: int, expert: int) -> ExpertExtent:
        """The extent of routed expert ``expert`` of ``layer`` (MTP layers included);
        :class:`ContainerError` (a subclass) if absent or badly laid out."""
        key = (layer, expert)
        ext = self._experts.get(key)
        if ext is not None:
            return ext
        if key in self._bad_experts:
            raise self._bad_experts[key]
        raise TensorNotFoundError(
            f"{self.path}: layer {layer} expert {expert} is in none of the shards (the config "
            f"has {self.arch.n_routed_experts} routed experts per MoE layer)"
        )

    def expert_layers(self) -> list[int]:
        """Layer indices that hold routed experts (MTP layers included), ascending."""
        return sorted({lay for lay, _ in self._experts} | {lay for lay, _ in self._bad_experts})

    def expert_extents(self) -> list[ExpertExtent]:
        """Every usable expert extent, ordered by (layer, expert)."""
        return [self._experts[k] for k in sorted(self._experts)]

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert blob (the largest, in case layers differ); 0 without experts."""
        return max((x.nbytes for x in self._experts.values()), default=0)

    def expert_nbytes_by_layer(self) -> dict[int, int]:
        """Bytes of one expert in each MoE layer as read and held: its blob and its scales
        (layers may differ: an MTP layer's experts are often stored in another format than
        the main layers'). The blob alone left the dashboard's tier bytes ~9% low."""
        out: dict[int, int] = {}
        for (layer, _), x in self._experts.items():
            size = x.nbytes + sum(t.nbytes for t in x.scales.values() if t is not None)
            out[layer] = max(out.get(layer, 0), size)
        return out

    def shard_checksums(self) -> dict[str, str]:
        """sha256 of each shard file by name, from ``colibri-manifest.json`` ({} without one,
        or when it cannot be read: ``Container.open`` reported that)."""
        if self.manifest is None:
            return {}
        try:
            m = Manifest.from_json(self.manifest, str(self.path / MANIFEST_NAME))
        except ConfigError:
            return {}
        return {s.file: s.sha256 for s in m.shards}

    # ------------------------------------------------------------------------------ side files

    def tokenizer_path(self) -> Path | None:
        """``tokenizer.json`` if present."""
        p = self.path / TOKENIZER_NAME
        return p if p.is_file() else None

    def tokenizer_config(self) -> dict[str, Any]:
        """``tokenizer_config.json`` parsed, or {} if absent (ConfigError if malformed)."""
        return _load_json(self.path / TOKENIZER_CONFIG_NAME, required=False) or {}


# ----------------------------------------------------------------------------- index building


def _index_tensors(
    d: Path,
    arch: ArchConfig,
    shards: list[ShardHeader],
    problems: _Problems,
    *,
    exact_first: bool = False,
) -> tuple[dict[str, TensorEntry], dict[str, ColibriError], dict[str, TensorRole]]:
    """Merge shard headers into entries, pairing ``X`` with ``X.qs`` and inferring formats
    (``exact_first``: see :func:`storage.quant.infer_format`)."""
    infos: dict[str, TensorInfo] = {}
    for sh in shards:
        for name, info in sh.tensors.items():
            if name.startswith(PAD_PREFIX):
                continue
            first = infos.get(name)
            if first is not None:
                problems.add(
                    ContainerError(
                        f"{d}: tensor {name!r} is in both {first.path.name} and "
                        f"{info.path.name}; one of them is stale (a leftover of another "
                        "conversion?): remove it"
                    )
                )
                continue
            infos[name] = info

    entries: dict[str, TensorEntry] = {}
    bad: dict[str, ColibriError] = {}
    roles: dict[str, TensorRole] = {}
    # A GLM-5 container has ~60k expert matrices in a handful of distinct formats: cache
    # successful inferences by their byte counts instead of re-running the group search.
    inferred: dict[tuple[str, int, int, tuple[int, int]], QuantFormat] = {}
    for name, info in infos.items():
        if name.endswith(".weight" + SCALES_SUFFIX):  # (any other "*.qs": an unknown tensor)
            if name[: -len(SCALES_SUFFIX)] not in infos:
                problems.add(
                    ContainerError(
                        f"{info.path}: scales tensor {name!r} has no weight "
                        f"{name[: -len(SCALES_SUFFIX)]!r}; the shards are inconsistent"
                    )
                )
            continue
        role = classify(name, arch)
        scales = infos.get(name + SCALES_SUFFIX)
        try:
            ent = _make_entry(name, info, scales, role, inferred, exact_first)
        except FormatError as exc:
            bad[name] = exc
            problems.add(exc)
            continue
        entries[name] = ent
        if role is not None:
            roles[name] = role
    return entries, bad, roles


def _make_entry(
    name: str,
    info: TensorInfo,
    scales: TensorInfo | None,
    role: TensorRole | None,
    inferred: dict[tuple[str, int, int, tuple[int, int]], QuantFormat],
    exact_first: bool = False,
) -> TensorEntry:
    where = f"{info.path}: tensor {name!r}"
    if scales is not None and scales.dtype != "F32":
        raise FormatError(
            f"{scales.path}: scales tensor {scales.name!r} is {scales.dtype}, not F32"
        )
    if role is None:  # unknown name: keep it as stored (coli doctor warns about it)
        return TensorEntry(name, None, info.shape, info, scales, None)
    if role.shape is None:  # 1-D float tensor: norms, biases, correction bias
        if scales is not None or info.dtype not in _FLOAT_DTYPES:
            raise FormatError(
                f"{where}: a norm/bias must be stored as {'/'.join(_FLOAT_DTYPES)} without "
                f"scales, found {info.dtype}{' + scales' if scales is not None else ''}"
            )
        if len(info.shape) != 1 or (role.length is not None and info.shape[0] != role.length):
            want = f"[{role.length}]" if role.length is not None else "one dimension"
            raise FormatError(
                f"{where}: shape {list(info.shape)}, but config.json implies {want} (a norm or "
                "bias of another length would be broadcast: wrong output)"
            )
        return TensorEntry(name, None, info.shape, info, None, role.role)
    n_scales = scales.numel if scales is not None else 0
    key = (info.dtype, info.nbytes, n_scales, role.shape)
    fmt = inferred.get(key)
    if fmt is None:
        if info.dtype.startswith("F8_"):
            raise FormatError(
                f"{where}: stored as {info.dtype}; FP8 checkpoints must be converted first "
                "(`coli convert`)"
            )
        try:
            fmt = infer_format(
                info.nbytes, n_scales, role.shape, dtype=info.dtype, where=where,
                exact_first=exact_first,
            )  # fmt: skip
        except FormatError as exc:
            raise FormatError(f"{exc}; does config.json belong to these shards?") from exc
        inferred[key] = fmt
    o, i = role.shape
    if not fmt.quantized and len(info.shape) == 2 and info.shape != (o, i):
        # Same byte count, wrong orientation: reading it as [O, I] would scramble the matrix.
        raise FormatError(
            f"{where}: stored shape {list(info.shape)} but config.json implies [{o}, {i}]"
        )
    return TensorEntry(name, fmt, (o, i), info, scales if fmt.quantized else None, role.role)


def _index_experts(
    arch: ArchConfig,
    entries: dict[str, TensorEntry],
    bad: dict[str, ColibriError],
    roles: dict[str, TensorRole],
    problems: _Problems,
) -> tuple[dict[tuple[int, int], ExpertExtent], dict[tuple[int, int], ColibriError]]:
    """Group expert matrices by (layer, expert) and check they form one contiguous extent."""
    groups: dict[tuple[int, int], dict[str, TensorEntry]] = {}
    for name, role in roles.items():
        if role.expert is None or role.layer is None or role.proj is None:
            continue
        groups.setdefault((role.layer, role.expert), {})[role.proj] = entries[name]
    # An expert whose matrix exists but is unusable is broken too (already reported).
    broken: dict[tuple[int, int], ColibriError] = {}
    for name, err in bad.items():
        r = classify(name, arch)
        if r is not None and r.expert is not None and r.layer is not None:
            broken.setdefault((r.layer, r.expert), err)
            groups.setdefault((r.layer, r.expert), {})

    experts: dict[tuple[int, int], ExpertExtent] = {}
    bad_experts: dict[tuple[int, int], ColibriError] = {}
    for key, parts in groups.items():
        if key in broken:
            bad_experts[key] = broken[key]
            continue
        try:
            experts[key] = _extent(key, parts)
        except ContainerError as exc:
            bad_experts[key] = exc
            problems.add(exc)
    return experts, bad_experts


def _extent(key: tuple[int, int], parts: dict[str, TensorEntry]) -> ExpertExtent:
    layer, expert = key
    what = f"layer {layer} expert {expert}"
    missing = [p for p in EXPERT_PROJS if p not in parts]
    if missing:
        some = next(iter(parts.values()))
        raise TensorNotFoundError(
            f"{some.weight.path.parent}: {what} lacks {', '.join(missing)} (has "
            f"{', '.join(sorted(parts))}); the conversion is incomplete"
        )
    paths = {e.weight.path for e in parts.values()}
    if len(paths) != 1:
        where = ", ".join(f"{p} in {parts[p].weight.path.name}" for p in EXPERT_PROJS)
        raise ExpertLayoutError(
            f"{parts[EXPERT_PROJS[0]].weight.path.parent}: {what}: its matrices are split over "
            f"shards ({where}); one read must fetch an expert: reconvert with `coli convert`"
        )
    path = paths.pop()
    order = sorted(EXPERT_PROJS, key=lambda p: parts[p].weight.start)
    for a, b in pairwise(order):
        if parts[b].weight.start != parts[a].weight.end:
            spans = ", ".join(
                f"{p} [{parts[p].weight.start}, {parts[p].weight.end})" for p in order
            )
            raise ExpertLayoutError(
                f"{path}: {what}: matrices are not byte-adjacent ({spans}); one read must fetch "
                "an expert: reconvert with `coli convert`"
            )
    start = parts[order[0]].weight.start
    end = parts[order[-1]].weight.end
    layout: dict[str, tuple[int, int, QuantFormat, tuple[int, int]]] = {}
    for p in EXPERT_PROJS:
        e = parts[p]
        if e.fmt is None or len(e.shape) != 2:  # expert roles always carry a shape
            raise FormatError(f"{path}: {what}: {p} is not a matrix")
        layout[p] = (e.weight.start - start, e.weight.nbytes, e.fmt, (e.shape[0], e.shape[1]))
    return ExpertExtent(
        layer, expert, path, start, end, layout, {p: parts[p].scales for p in EXPERT_PROJS}
    )

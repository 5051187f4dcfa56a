"""Reading a conversion's source for :mod:`storage.convert`: the checkpoint's headers, its
fingerprint, and the catalog of what becomes of every tensor (role, layer, target format, FP8
block scale), checked before any byte is written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.arch import (
    ArchConfig,
    TensorRole,
    classify,
    expected_tensors,
    math_keys,
    optional_tensors,
    rope_keys,
    rotary_keys,
)
from storage.errors import ConfigError, ConversionError
from storage.manifest import SourceFile, SourceIdentity
from storage.quant import QuantFormat
from storage.safetensors import (
    DTYPE_SIZES,
    PAD_PREFIX,
    ShardHeader,
    TensorInfo,
    TensorSpec,
    read_header,
)
from storage.units import format_bytes

if TYPE_CHECKING:
    from storage.convert import ConvertOptions

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = (128, 128)
INDEX_NAME = "model.safetensors.index.json"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FLOAT_INPUTS = ("F32", "BF16", "F16", "F64")


@dataclass(frozen=True)
class _Source:
    root: Path
    arch: ArchConfig
    tensors: dict[str, TensorInfo]  # container name -> where the source holds it
    identity: SourceIdentity
    side_files: tuple[str, ...]
    config: dict[str, Any] | None = None  # the config.json to write, when not the source's
    notes: tuple[str, ...] = ()
    # decoder layers config.json declares, MTP layers included (a GQA family's are kept as is)
    declared_layers: int | None = None


# Multimodal wrappers whose text model is a supported family: model_type -> (the key of the text
# model's config, the prefix of its tensor names). Kimi K2.5: a kimi_k2 (DeepSeek-V3 layout)
# language model beside a vision tower, which the container leaves out.
WRAPPERS: dict[str, tuple[str, str]] = {"kimi_k25": ("text_config", "language_model.")}


def _unwrap(cfg: dict[str, Any], where: Path) -> tuple[dict[str, Any], str] | None:
    """(the text model's config, its tensor prefix) for a wrapper config, else None."""
    wrap = WRAPPERS.get(str(cfg.get("model_type")))
    if wrap is None:
        return None
    key, prefix = wrap
    text = cfg.get(key)
    if not isinstance(text, dict):
        raise ConversionError(f"{where}: a {cfg['model_type']} config needs a {key!r} object")
    text = dict(text)
    text.setdefault("model_type", "kimi_k2")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k not in text and cfg.get(k) is not None:
            text[k] = cfg[k]
    return text, prefix


def read_json_object(path: Path, hint: str = "") -> dict[str, Any]:
    """``path`` parsed as a JSON object; a :class:`ConversionError` naming the file (and
    ``hint``: what to do) when it cannot be read or is not an object."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path}: cannot read JSON ({exc}){hint}") from exc
    if not isinstance(doc, dict):
        raise ConversionError(f"{path}: expected a JSON object{hint}")
    return doc


def _load_source(src: Path, identity: SourceIdentity | None = None) -> _Source:
    if not src.exists():
        raise ConversionError(f"{src} does not exist (SRC: a Hugging Face checkpoint dir)")
    if not src.is_dir():
        raise ConversionError(f"{src}: source is not a directory (expected a Hugging Face dir)")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{cfg_path}: missing; SRC must be a Hugging Face checkpoint dir")
    cfg = read_json_object(cfg_path)
    unwrapped = _unwrap(cfg, cfg_path)
    prefix = ""
    if unwrapped is not None:
        wrapper = str(cfg["model_type"])
        cfg, prefix = unwrapped
    try:
        arch = ArchConfig.from_dict(cfg, str(cfg_path))
        # what the runtime would refuse at the first run, found before hours of converting
        for keys in (math_keys, rope_keys, rotary_keys):
            keys(cfg, str(cfg_path))
    except ConfigError as exc:
        raise ConversionError(f"cannot convert: {exc}") from exc

    files = _shard_files(src)
    headers: list[ShardHeader] = [read_header(p) for p in files]  # SafetensorsError names file
    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if name.startswith(PAD_PREFIX):
                raise ConversionError(
                    f"{h.path}: tensor {name!r}: names starting with {PAD_PREFIX!r} are reserved "
                    "for padding (is SRC already a colibri container?)"
                )
            if name in tensors:
                raise ConversionError(
                    f"tensor {name!r} appears in both {tensors[name].path.name} and "
                    f"{h.path.name}; the checkpoint is inconsistent"
                )
            tensors[name] = info
    notes: tuple[str, ...] = ()
    embed, head = f"{prefix}model.embed_tokens.weight", f"{prefix}lm_head.weight"
    if cfg.get("tie_word_embeddings") is True and head not in tensors and embed in tensors:
        # save_pretrained leaves a tied lm_head out: it is the input embedding itself
        tensors[head] = dataclasses.replace(tensors[embed], name=head)
        notes = ("tie_word_embeddings: lm_head written from the input embedding",)
    ident_files = [cfg_path, *([src / INDEX_NAME] if (src / INDEX_NAME).exists() else []), *files]
    side = tuple(n for n in SIDE_FILES if (src / n).is_file())
    ident = identity if identity is not None else _fingerprint(src, ident_files, headers)
    nextn = cfg.get("num_nextn_predict_layers")
    declared = arch.num_hidden_layers + (nextn if isinstance(nextn, int) and nextn > 0 else 0)
    if unwrapped is None:
        return _Source(src, arch, tensors, ident, side, notes=notes, declared_layers=declared)
    text = {n[len(prefix) :]: info for n, info in tensors.items() if n.startswith(prefix)}
    left = len(tensors) - len(text)
    note = (
        f"{wrapper}: converted its text model ({arch.model_type}, tensors under {prefix!r}); "
        f"{left} other tensor(s) (vision tower, projector) are left out"
    )
    return _Source(src, arch, text, ident, side, cfg, (note, *notes), declared)


def _shard_files(src: Path) -> list[Path]:
    index = src / INDEX_NAME
    if index.exists():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
            wmap = doc["weight_map"]
            names = sorted({str(v) for v in wmap.values()})
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise ConversionError(f"{index}: not a valid safetensors index ({exc})") from exc
        outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
        if outside:
            raise ConversionError(
                f"{index} names a shard outside {src} ({outside[0]!r}); an index lists files "
                "of its own directory"
            )
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise ConversionError(
                f"{index} lists {len(missing)} shard(s) missing from {src}: "
                f"{', '.join(missing[:3])}; is the download complete?"
            )
        return [src / n for n in names]
    files = sorted(p for p in src.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        raise ConversionError(f"{src}: no *.safetensors shards found")
    return files


SAMPLE_BYTES = 256  # read from the middle of every tensor for SourceIdentity.samples


def _tensor_samples(headers: Sequence[ShardHeader]) -> str:
    """sha256 over ``SAMPLE_BYTES`` from the middle of every tensor (one small read each: a
    few seconds for a 700 GB checkpoint's ~10^5 tensors): a fine-tune of some layers changes
    those tensors' bytes everywhere, while names, sizes, headers and file ends stay alike."""
    h = hashlib.sha256()
    for hd in headers:
        try:
            fd = os.open(hd.path, os.O_RDONLY)
        except OSError as exc:
            raise ConversionError(f"{hd.path}: cannot read: {exc.strerror or exc}") from exc
        try:
            for t in sorted(hd.tensors.values(), key=lambda t: t.start):
                n = min(SAMPLE_BYTES, t.nbytes)
                at = t.start + (t.nbytes - n) // 2
                h.update(os.pread(fd, n, at))
        except OSError as exc:
            raise ConversionError(f"{hd.path}: cannot read: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
    return h.hexdigest()


def _fingerprint(
    root: Path, files: Sequence[Path], headers: Sequence[ShardHeader] = ()
) -> SourceIdentity:
    """Fast identity: names, sizes, the first MiB (headers live there) and last 64 KiB of each
    file, plus :func:`_tensor_samples` of ``headers``. Reading all of a 700 GB checkpoint just
    to resume would defeat the purpose."""
    h = hashlib.sha256()
    out: list[SourceFile] = []
    for p in files:
        try:
            with open(p, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                name = p.relative_to(root).as_posix()
                h.update(f"{name}\0{size}\0".encode())
                h.update(fh.read(1 << 20))
                if size > 1 << 20:
                    fh.seek(max(1 << 20, size - (64 << 10)))
                    h.update(fh.read())
        except OSError as exc:
            raise ConversionError(f"{p}: cannot read: {exc.strerror or exc}") from exc
        out.append(SourceFile(name, size))
    return SourceIdentity(h.hexdigest(), tuple(out), _tensor_samples(headers) if headers else None)


# ----------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class _Item:
    """One source tensor and how it is written. ``fmt`` None = copy verbatim (unknown name)."""

    name: str
    info: TensorInfo
    fmt: QuantFormat | None
    scale: TensorInfo | None = None  # FP8 block scales (``<name>_scale_inv``)
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None

    def specs(self) -> list[TensorSpec]:
        """Output tensors in write order (weight, then ``.qs`` for quantized formats)."""
        i = self.info
        if self.fmt is None:
            return [TensorSpec(self.name, i.dtype, i.shape, _natural(i.dtype))]
        f = self.fmt
        if f.kind == "f32":
            return [TensorSpec(self.name, "F32", i.shape, 4)]
        o, n = i.shape  # catalog guarantees a matrix for non-f32 formats
        if f.kind in ("bf16", "f16"):
            return [TensorSpec(self.name, f.kind.upper(), (o, n), 2)]
        return [
            TensorSpec(self.name, "U8", (f.weight_nbytes(o, n),)),
            TensorSpec(self.name + ".qs", "F32", (f.n_scales(o, n),), 4),
        ]


@dataclass(frozen=True)
class _Catalog:
    arch: ArchConfig
    items: tuple[_Item, ...]
    unknown: tuple[str, ...]
    notes: tuple[str, ...]
    # config.json declares MTP layers the source has no weights for: the container's config
    # declares none (num_nextn_predict_layers 0), so that it describes what the shards hold
    mtp_dropped: bool = False


def _build_catalog(source: _Source, options: ConvertOptions) -> _Catalog:
    arch, tensors = source.arch, source.tensors
    items: list[_Item] = []
    unknown: list[str] = []
    consumed: set[str] = set()
    for name in sorted(tensors):
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in tensors:
            continue  # decided with its base tensor below
        info = tensors[name]
        role = classify(name, arch)
        if role is None:
            continue
        scale = _check_tensor(info, role)
        if scale is not None:
            scale_info = tensors.get(scale)
            if scale_info is None:
                raise ConversionError(
                    f"{info.path}: tensor {name!r} is FP8 (F8_E4M3) but its block scales "
                    f"{scale!r} are in no shard; they are needed to dequantize it"
                )
            _check_scale(info, scale_info)
            consumed.add(scale)
        else:
            scale_info = None
        items.append(
            _Item(
                name,
                info,
                options.format_for(role.role),
                scale_info,
                role.layer,
                role.expert,
                role.proj,
            )
        )
    unused_mtp: list[str] = []
    for name in sorted(tensors):
        if name in consumed or classify(name, arch) is not None:
            continue
        m = _LAYER_RE.match(name)
        layer = int(m.group(1)) if m else None
        if layer is not None and arch.num_mtp_layers == 0 and layer >= arch.num_hidden_layers:
            # the MTP layer config.json declares for a family colibri runs no MTP head for
            # (GLM-4.5): never run, so left out (copied verbatim it was GBs of bf16 experts)
            if source.declared_layers is not None and layer < source.declared_layers:
                unused_mtp.append(name)
                continue
        # Unknown names are kept verbatim (same dtype and shape) so nothing is silently lost.
        items.append(_Item(name, tensors[name], None, None, layer))
        unknown.append(name)
    declared = source.declared_layers
    beyond = sorted(
        {int(m.group(1)) for n in unknown if (m := _LAYER_RE.match(n)) is not None}
        - set(range(declared if declared is not None else 1 << 30))
    )
    if beyond:
        n_extra = sum(_layer_of(n, -1) in beyond for n in unknown)
        raise ConversionError(
            f"{source.root}: config.json declares {declared} layers (num_hidden_layers"
            f"{' + num_nextn_predict_layers' if declared != arch.num_hidden_layers else ''}) "
            f"but the checkpoint holds model.layers.{beyond[0]}.* ({n_extra} tensors in "
            f"{len(beyond)} more layer(s)); the checkpoint and its config do not match"
        )

    notes: list[str] = list(source.notes)
    if unused_mtp:
        size = sum(tensors[n].nbytes for n in unused_mtp)
        notes.append(
            f"left out the MTP layer config.json declares ({len(unused_mtp)} tensors, "
            f"{format_bytes(size)}): colibri runs no MTP head for {arch.model_type} "
            "(--draft lookup drafts for it)"
        )
    ragged = [
        it
        for it in items
        if it.fmt is not None
        and it.fmt.group_size
        and len(it.info.shape) == 2
        # (a row narrower than one group is one group: the C engine's gs = I / 1 reads it)
        and it.info.shape[1] > it.fmt.group_size
        and it.info.shape[1] % it.fmt.group_size
    ]
    if ragged:
        first = ragged[0]
        assert first.fmt is not None
        notes.append(
            f"{len(ragged)} {'matrix' if len(ragged) == 1 else 'matrices'} (e.g. {first.name}, "
            f"{first.info.shape[1]} wide) {'is' if len(ragged) == 1 else 'are'} not a whole "
            f"number of {first.fmt} groups per row: colibri reads "
            f"{'it' if len(ragged) == 1 else 'them'} (a row's last group is shorter), the C "
            "engine, which derives the group size from the scale count, would not; a group size "
            "that divides the width makes a container both read"
        )
    missing = [n for n in expected_tensors(arch) if n not in tensors]
    optional = optional_tensors(arch)
    if optional and set(missing) == optional:  # an MTP layer without its (optional) indexer
        missing = []
        notes.append("the source has no DSA indexer for the MTP layer: it will attend densely")
    if missing:
        mtp_names = {
            n for n in expected_tensors(arch) if _layer_of(n, -1) >= arch.num_hidden_layers
        }
        core = [n for n in missing if n not in mtp_names]
        if core or len(missing) != len(mtp_names):
            raise ConversionError(
                f"{source.root}: {len(missing)} tensor(s) the architecture needs are in no shard, "
                f"e.g. {', '.join(missing[:3])}; is the download complete?"
            )
        notes.append(
            "the source has no MTP layer weights although config.json declares "
            f"{arch.num_mtp_layers}; the container has none (speculative decoding unavailable)"
        )
        return _Catalog(
            dataclasses.replace(arch, num_mtp_layers=0),
            tuple(items),
            tuple(unknown),
            tuple(notes),
            mtp_dropped=True,
        )
    # (a GQA family's MTP layer left out: the container's config declares none either)
    return _Catalog(arch, tuple(items), tuple(unknown), tuple(notes), mtp_dropped=bool(unused_mtp))


def _check_tensor(info: TensorInfo, role: TensorRole) -> str | None:
    """Validate dtype and shape against the config; returns the FP8 scale name if one is needed."""
    where = f"{info.path}: tensor {info.name!r}"
    if role.shape is not None:
        if info.shape != role.shape:
            raise ConversionError(
                f"{where}: shape {list(info.shape)} disagrees with config.json, which implies "
                f"{list(role.shape)}; the checkpoint and its config do not match"
            )
    elif len(info.shape) != 1:
        raise ConversionError(f"{where}: expected a 1-D tensor, got shape {list(info.shape)}")
    elif role.length is not None and info.shape[0] != role.length:
        raise ConversionError(
            f"{where}: shape {list(info.shape)} disagrees with config.json, which implies "
            f"[{role.length}]; the checkpoint and its config do not match"
        )
    if info.dtype in _FLOAT_INPUTS:
        return None
    if info.dtype == "F8_E4M3":
        if len(info.shape) != 2:
            raise ConversionError(f"{where}: FP8 is supported for 2-D weights only")
        return info.name + SCALE_SUFFIX
    raise ConversionError(
        f"{where}: dtype {info.dtype} is not supported (expected F32, BF16, F16, or F8_E4M3 "
        f"with {info.name + SCALE_SUFFIX})"
    )


def _check_scale(info: TensorInfo, scale: TensorInfo) -> None:
    o, i = info.shape
    want = (-(-o // FP8_BLOCK[0]), -(-i // FP8_BLOCK[1]))
    if scale.shape != want or scale.dtype not in ("F32", "BF16"):
        raise ConversionError(
            f"{scale.path}: tensor {scale.name!r}: {scale.dtype} {list(scale.shape)} is not the "
            f"F32 {list(want)} of 128x128 block scales that {info.name!r} {list(info.shape)} needs"
        )


def _layer_of(name: str, default: int) -> int:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else default


def _natural(dtype: str) -> int:
    return min(DTYPE_SIZES[dtype], 8)

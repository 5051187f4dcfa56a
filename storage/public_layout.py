"""Write a model directory laid out exactly like the public colibri int4 container (a fixture
writer for tests and tools; ``coli convert`` writes the aligned variant with a manifest).

What it reproduces:

* shards ``out-NNNNN.safetensors`` for the main layers and ``out-mtp-NNNNN.safetensors`` for
  layers >= ``num_hidden_layers``; both numbered from ``00000`` upward;
* inside a shard tensors are sorted by dtype (widest first, the order of the ``safetensors``
  library) then by name, so an expert's down, gate and up U8 matrices are adjacent and
  alphabetical while their F32 ``.qs`` scales sit elsewhere;
* a quantized matrix ``X`` is ``X`` U8 1-D plus ``X.qs`` F32 1-D; f32 / bf16 / f16 matrices are
  F32 / BF16 / F16 ``[O, I]``; plain numpy float arrays (norms, router, biases) are F32 with their
  shape, other numpy dtypes keep theirs;
* no alignment, no padding tensors, no manifest; each shard's ``__metadata__`` says colibri
  wrote it (``{"writer": "colibri"}``: its int4 group sizes follow colibri's rule);
* shards split at layer boundaries once over ``shard_bytes`` (an expert never straddles shards;
  a single layer larger than ``shard_bytes`` gets a shard of its own).

:func:`write_converter_passes` reproduces the directory the public converter leaves after its
three passes over a Hugging Face checkpoint of ``N`` source shards, numbered as it numbers them:

* main pass: ``out-{i:05d}`` for *every* source shard ``i`` (an empty shard, header ``{}``, when
  source shard ``i`` held only MTP or indexer tensors), main layers and globals, no indexer;
* MTP pass: ``out-mtp-{j:05d}`` over the source shards holding layer ``num_hidden_layers``, in
  source order, **without the MTP layer's DSA indexer**;
* indexer pass: ``out-idx-{k:05d}`` over the source shards holding a main layer's indexer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from storage.container import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    SCALES_SUFFIX,
    shard_paths,
)
from storage.errors import ConfigError, ContainerError
from storage.quant import QTensor
from storage.safetensors import WRITTEN_BY_COLIBRI, TensorSpec, write_safetensors

__all__ = ["dtype_sort_key", "write_converter_passes", "write_public_container"]

# The safetensors library sorts a shard's tensors by its Dtype enum, descending, then by name.
_DTYPE_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
    "F64", "I64", "U64",
)  # fmt: skip
_NUMPY_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64",
}  # fmt: skip
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

Item = tuple[TensorSpec, npt.NDArray[Any]]


def dtype_sort_key(dtype: str, name: str) -> tuple[int, str]:
    """Sort key of a tensor inside a shard: widest dtype first, then name (safetensors' order)."""
    return (-_DTYPE_ORDER.index(dtype), name)


def _items(name: str, t: QTensor | npt.NDArray[Any]) -> list[Item]:
    if isinstance(t, QTensor):
        o, i = t.shape
        if t.fmt.quantized:
            if t.scales is None:
                raise ContainerError(f"tensor {name!r}: {t.fmt.name} QTensor without scales")
            data = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
            scales = np.ascontiguousarray(t.scales, dtype=np.float32).reshape(-1)
            return [
                (TensorSpec(name, "U8", (data.size,)), data),
                (TensorSpec(name + SCALES_SUFFIX, "F32", (scales.size,)), scales),
            ]
        if t.fmt.kind == "f32":
            return [(TensorSpec(name, "F32", (o, i)), np.asarray(t.data, dtype=np.float32))]
        st = "BF16" if t.fmt.kind == "bf16" else "F16"
        return [(TensorSpec(name, st, (o, i)), np.asarray(t.data).view(np.uint16))]
    a = np.asarray(t)
    if np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float32)
        return [(TensorSpec(name, "F32", tuple(a.shape)), a)]
    other = _NUMPY_TO_ST.get(a.dtype.name)
    if other is None:
        raise ContainerError(f"tensor {name!r}: numpy dtype {a.dtype} has no safetensors dtype")
    return [(TensorSpec(name, other, tuple(a.shape)), a)]


def _group_key(name: str, n_layers: int) -> tuple[int, int]:
    """(0 main / 1 mtp, order): embed first, layers ascending, other global tensors last."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        return (1 if layer >= n_layers else 0, layer)
    return (0, -1 if name.startswith("model.embed_tokens.") else n_layers)


def write_public_container(
    dst: Path,
    config: dict[str, Any],
    tensors: Mapping[str, QTensor | npt.NDArray[Any]],
    *,
    tokenizer_files: Mapping[str, bytes] | None = None,
    generation_config: dict[str, Any] | None = None,
    shard_bytes: int = 2**30,
) -> None:
    """Write ``config`` (as config.json), ``tensors``, the tokenizer files (name -> bytes,
    written verbatim) and ``generation_config`` into ``dst`` in the public colibri layout.

    Only ``num_hidden_layers`` is read from ``config`` (to tell MTP layers apart), so a test can
    write a deliberately broken config. Refuses a ``dst`` that already holds shards: stale
    shards would duplicate tensors.
    """
    dst = Path(dst)
    try:
        n_layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config: num_hidden_layers is missing or bad ({exc})") from exc
    dst.mkdir(parents=True, exist_ok=True)
    if shard_paths(dst):
        raise ContainerError(f"{dst}: already holds *.safetensors shards; use an empty directory")

    groups: dict[tuple[int, int], list[Item]] = {}
    for name, t in tensors.items():
        groups.setdefault(_group_key(name, n_layers), []).extend(_items(name, t))

    counters = [0, 0]  # next shard number for main / mtp
    for kind in (0, 1):
        keys = sorted(k for k in groups if k[0] == kind)
        shard: list[Item] = []
        size = 0
        for k in keys:
            g = groups[k]
            g_size = sum(s.nbytes for s, _ in g)
            if shard and size + g_size > shard_bytes:
                _write_shard(dst, kind, counters, shard)
                shard, size = [], 0
            shard.extend(g)
            size += g_size
        if shard:
            _write_shard(dst, kind, counters, shard)

    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    if generation_config is not None:
        (dst / GENERATION_CONFIG_NAME).write_text(json.dumps(generation_config, indent=2) + "\n")
    for fname, data in (tokenizer_files or {}).items():
        (dst / fname).write_bytes(data)


def _source_units(names: list[str], n_layers: int) -> list[list[str]]:
    """The checkpoint's tensors in source order as indivisible units: one tensor, or one
    expert's three matrices (a source shard never splits an expert). Order: embed, the main
    layers, the final norm and lm_head, then the MTP layer (so the last source shards hold
    nothing but MTP tensors, as in the GLM-5 checkpoints)."""

    def key(name: str) -> tuple[int, int, str]:
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            return (3 if layer >= n_layers else 1, layer, name)
        return (0 if name.startswith("model.embed_tokens.") else 2, 0, name)

    units: dict[tuple[int, int, str], list[str]] = {}
    for name in sorted(names, key=key):
        k = key(name)
        e = re.match(r"^(model\.layers\.\d+\.mlp\.experts\.\d+)\.", name)
        unit_key = (k[0], k[1], e.group(1)) if e else k
        units.setdefault(unit_key, []).append(name)
    return list(units.values())


def write_converter_passes(
    dst: Path,
    config: dict[str, Any],
    tensors: Mapping[str, QTensor | npt.NDArray[Any]],
    *,
    source_shard_bytes: int,
    tokenizer_files: Mapping[str, bytes] | None = None,
    generation_config: dict[str, Any] | None = None,
    metadata: Mapping[str, str] | None = WRITTEN_BY_COLIBRI,
) -> list[str]:
    """Write ``tensors`` (already in the formats the passes chose) the way the public
    converter's main, MTP and indexer passes lay out a checkpoint whose source shards are cut
    every ``source_shard_bytes`` (in stored bytes, at unit boundaries). The MTP layer's indexer
    tensors, if given, are dropped as that converter drops them. Returns the shard names.
    ``metadata``: each shard's ``__metadata__`` (None: none, as the C engine's converter
    writes them; its int4 group sizes are then read by its rule, gs = I / groups)."""
    dst = Path(dst)
    n_layers = int(config["num_hidden_layers"])
    dst.mkdir(parents=True, exist_ok=True)
    if shard_paths(dst):
        raise ContainerError(f"{dst}: already holds *.safetensors shards; use an empty directory")
    sources: list[list[str]] = [[]]
    size = 0
    for unit in _source_units(list(tensors), n_layers):
        u_size = sum(s.nbytes for n in unit for s, _ in _items(n, tensors[n]))
        if sources[-1] and size + u_size > source_shard_bytes:
            sources.append([])
            size = 0
        sources[-1].extend(unit)
        size += u_size

    def layer(name: str) -> int:
        m = _LAYER.match(name)
        return int(m.group(1)) if m else -1

    def indexer(name: str) -> bool:
        return ".indexer." in name

    passes: list[tuple[str, Any]] = [
        ("out-", lambda n: layer(n) < n_layers and not indexer(n)),
        ("out-mtp-", lambda n: layer(n) == n_layers and not indexer(n)),
        ("out-idx-", lambda n: 0 <= layer(n) < n_layers and indexer(n)),
    ]
    written: list[str] = []
    for prefix, keep in passes:
        chosen = [[n for n in src if keep(n)] for src in sources]
        if prefix != "out-":  # only the main pass writes one output per source shard
            chosen = [c for c in chosen if c]
        for i, names in enumerate(chosen):
            items = sorted(
                (it for n in names for it in _items(n, tensors[n])),
                key=lambda it: dtype_sort_key(it[0].dtype, it[0].name),
            )
            fname = f"{prefix}{i:05d}.safetensors"
            write_safetensors(
                dst / fname,
                [s for s, _ in items],
                (a for _, a in items),
                metadata=metadata,
            )
            written.append(fname)
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    if generation_config is not None:
        (dst / GENERATION_CONFIG_NAME).write_text(json.dumps(generation_config, indent=2) + "\n")
    for fname, data in (tokenizer_files or {}).items():
        (dst / fname).write_bytes(data)
    return written


def _write_shard(dst: Path, kind: int, counters: list[int], items: list[Item]) -> None:
    prefix = "out-mtp-" if kind else "out-"
    path = dst / f"{prefix}{counters[kind]:05d}.safetensors"
    counters[kind] += 1
    items = sorted(items, key=lambda it: dtype_sort_key(it[0].dtype, it[0].name))
    write_safetensors(
        path, [s for s, _ in items], (a for _, a in items), metadata=WRITTEN_BY_COLIBRI
    )

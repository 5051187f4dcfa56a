"""Weight storage formats and their reference quantize / dequantize math (numpy).

Formats (``QuantFormat.name``): ``f32``, ``bf16``, ``f16``, ``int8`` (per row), ``int4-row`` and
``int4-gNN`` (grouped, NN in 16..256). The integer formats are bit-identical to the public colibri
container:

* int4: per row or per group ``s = max(absmax / 7, 1e-8)``, ``q = clip(rint(w / s), -8, 7)``, stored
  nibble ``q + 8``; byte ``j`` of a row holds column ``2j`` in the low nibble and ``2j + 1`` in the
  high nibble; row stride ``ceil(I / 2)``. Grouped: the row is padded with zeros to a multiple of
  the group size before the absmax; scales are row-major ``[O, ceil(I / gs)]``.
* int8: per row ``s = max(absmax / 127, 1e-8)``, ``q = clip(rint(w / s), -128, 127)``, two's
  complement bytes.

All arithmetic is float32 (``rint`` is round-half-even), so results match the C engine bit for bit.
The numba kernels in ``runtime.kernels`` compute with these layouts directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from storage.errors import FormatError, UnknownQuantFormatError

__all__ = [
    "FORMAT_NAMES",
    "QTensor",
    "QuantFormat",
    "bf16_to_f32",
    "dequantize",
    "f32_to_bf16",
    "fp8_block_dequantize",
    "fp8_e4m3_to_f32",
    "infer_format",
    "quantize",
]

Kind = Literal["f32", "bf16", "f16", "int8", "int4"]
F32Array = npt.NDArray[np.float32]
U8Array = npt.NDArray[np.uint8]

_EPS = np.float32(1e-8)
MIN_GROUP, MAX_GROUP = 16, 256


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A storage format. ``group_size`` is set only for grouped int4."""

    kind: Kind
    group_size: int | None = None

    @property
    def name(self) -> str:
        if self.kind == "int4":
            return f"int4-g{self.group_size}" if self.group_size else "int4-row"
        return self.kind

    @property
    def quantized(self) -> bool:
        return self.kind in ("int8", "int4")

    @staticmethod
    def parse(text: str) -> QuantFormat:
        """Parse ``f32 | bf16 | f16 | int8 | int4-row | int4-gNN``."""
        t = text.strip().lower()
        if t in ("f32", "bf16", "f16", "int8"):
            return QuantFormat(t)  # type: ignore[arg-type]
        if t == "int4-row":
            return QuantFormat("int4")
        if t.startswith("int4-g") and t[6:].isdigit():
            gs = int(t[6:])
            if not MIN_GROUP <= gs <= MAX_GROUP:
                raise UnknownQuantFormatError(
                    f"group size {gs} in {text!r} is outside {MIN_GROUP}..{MAX_GROUP}"
                )
            return QuantFormat("int4", gs)
        raise UnknownQuantFormatError(
            f"unknown format {text!r}; use one of f32, bf16, f16, int8, int4-row, int4-gNN "
            f"(NN in {MIN_GROUP}..{MAX_GROUP}, e.g. int4-g64)"
        )

    def weight_nbytes(self, out_features: int, in_features: int) -> int:
        o, i = out_features, in_features
        if self.kind == "f32":
            return o * i * 4
        if self.kind in ("bf16", "f16"):
            return o * i * 2
        if self.kind == "int8":
            return o * i
        return o * ((i + 1) // 2)

    def n_scales(self, out_features: int, in_features: int) -> int:
        if self.kind in ("int8",) or (self.kind == "int4" and self.group_size is None):
            return out_features
        if self.kind == "int4":
            assert self.group_size is not None
            return out_features * (-(-in_features // self.group_size))
        return 0

    def __str__(self) -> str:
        return self.name


FORMAT_NAMES = ("f32", "bf16", "f16", "int8", "int4-row", "int4-gNN")


@dataclass(frozen=True, slots=True)
class QTensor:
    """A 2-D weight ``[out_features, in_features]`` in some storage format.

    ``data`` is float32 [O, I] for f32, uint16 [O, I] (raw bits) for bf16 and f16, and uint8 1-D
    packed bytes for the integer formats; ``scales`` is float32 1-D (or None for float formats).
    """

    fmt: QuantFormat
    shape: tuple[int, int]
    data: npt.NDArray[np.generic]
    scales: F32Array | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (int(self.scales.nbytes) if self.scales is not None else 0)


def infer_format(
    weight_nbytes: int,
    n_scales: int,
    shape: tuple[int, int],
    *,
    dtype: str = "U8",
    where: str = "tensor",
    exact_first: bool = False,
) -> QuantFormat:
    """Infer a tensor's format from its byte counts against the [O, I] the config implies.

    ``dtype`` is the safetensors dtype of the weight tensor; ``n_scales`` is 0 when there is no
    ``.qs`` companion. Raises :class:`FormatError` naming ``where`` when nothing matches.
    ``exact_first``: a group count that divides I means the C engine's rule, gs = I / groups,
    before a power of two that gives the same count (a container colibri did not write: the
    C engine writes gs48 on a 96-wide matrix as 2 groups, which colibri's own rule reads as
    g64, wrong weights; colibri's converter writes powers of two, I may be ragged)."""
    o, i = shape
    if dtype == "F32" and n_scales == 0 and weight_nbytes == o * i * 4:
        return QuantFormat("f32")
    if dtype == "BF16" and n_scales == 0 and weight_nbytes == o * i * 2:
        return QuantFormat("bf16")
    if dtype == "F16" and n_scales == 0 and weight_nbytes == o * i * 2:
        return QuantFormat("f16")
    if dtype in ("U8", "I8") and n_scales > 0:
        if weight_nbytes == o * i and n_scales == o:
            return QuantFormat("int8")
        if weight_nbytes == o * ((i + 1) // 2):
            if n_scales == o:
                return QuantFormat("int4")
            if n_scales % o == 0:
                groups = n_scales // o
                fits = [g for g in range(MIN_GROUP, MAX_GROUP + 1) if -(-i // g) == groups]
                # Prefer a power-of-two group (what converters write; I may be padded), then
                # the C engine's rule gs = I / groups.
                pow2 = [g for g in fits if g & (g - 1) == 0]
                if exact_first and i % groups == 0 and (i // groups) in fits:
                    return QuantFormat("int4", i // groups)
                if pow2:
                    return QuantFormat("int4", pow2[-1] if len(pow2) == 1 else min(pow2))
                if i % groups == 0 and (i // groups) in fits:
                    return QuantFormat("int4", i // groups)
                if fits:
                    return QuantFormat("int4", fits[0])
    raise FormatError(
        f"{where}: {weight_nbytes} bytes of {dtype} with {n_scales} scales match no known format "
        f"for shape [{o}, {i}] (expected f32 {o * i * 4}, bf16/f16 {o * i * 2}, int8 {o * i} + "
        f"{o} scales, int4 {o * ((i + 1) // 2)} + {o} or {o}*groups scales)"
    )


# ----------------------------------------------------------------------------- float helpers


def bf16_to_f32(bits: npt.NDArray[np.uint16]) -> F32Array:
    """Raw bfloat16 bits -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: npt.NDArray[np.floating]) -> npt.NDArray[np.uint16]:
    """float32 -> raw bfloat16 bits, round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _fp8_e4m3_table() -> F32Array:
    table = np.zeros(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp = (b >> 3) & 0xF
        man = b & 0x7
        if exp == 0xF and man == 0x7:
            table[b] = np.nan
        elif exp == 0:
            table[b] = sign * (man / 8.0) * 2.0**-6
        else:
            table[b] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    table.flags.writeable = False  # a shared constant: no caller may change it
    return table


_FP8_TABLE = _fp8_e4m3_table()


def fp8_e4m3_to_f32(raw: npt.NDArray[np.uint8]) -> F32Array:
    """Decode float8 e4m3fn bytes (no infinities, 0x7F/0xFF are NaN) to float32."""
    return _FP8_TABLE[raw]


def fp8_block_dequantize(
    raw: npt.NDArray[np.uint8], scale_inv: F32Array, block: tuple[int, int] = (128, 128)
) -> F32Array:
    """DeepSeek-style FP8 weight with a ``weight_scale_inv`` per 128x128 block -> float32."""
    w = fp8_e4m3_to_f32(raw)
    bo, bi = block
    o, i = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return (w * s).astype(np.float32)


# ----------------------------------------------------------------------------- quantize


def _scale(absmax: F32Array, qmax: int) -> F32Array:
    s: F32Array = np.maximum(absmax / np.float32(qmax), _EPS).astype(np.float32)
    return s


def _pack_nibbles(nib: U8Array) -> U8Array:
    """[O, I] nibbles (0..15) -> [O, ceil(I/2)] bytes, even column in the low nibble."""
    o, i = nib.shape
    if i % 2:
        nib = np.concatenate([nib, np.full((o, 1), 8, dtype=np.uint8)], axis=1)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(packed: U8Array, o: int, i: int) -> U8Array:
    rows = packed.reshape(o, (i + 1) // 2)
    nib = np.empty((o, rows.shape[1] * 2), dtype=np.uint8)
    nib[:, 0::2] = rows & 0xF
    nib[:, 1::2] = rows >> 4
    return nib[:, :i]


def quantize(w: npt.NDArray[np.floating], fmt: QuantFormat | str) -> QTensor:
    """Quantize a 2-D float weight [O, I] into ``fmt`` (reference math, see module docstring)."""
    f = QuantFormat.parse(fmt) if isinstance(fmt, str) else fmt
    w32 = np.ascontiguousarray(w, dtype=np.float32)
    if w32.ndim != 2:
        raise FormatError(f"quantize expects a 2-D weight, got shape {w32.shape}")
    o, i = w32.shape
    if f.kind == "f32":
        return QTensor(f, (o, i), w32)
    if f.kind == "bf16":
        return QTensor(f, (o, i), f32_to_bf16(w32))
    if f.kind == "f16":
        with np.errstate(over="ignore"):  # (beyond its range: inf, which the converter refuses)
            return QTensor(f, (o, i), w32.astype(np.float16).view(np.uint16))
    if f.kind == "int8":
        s = _scale(np.abs(w32).max(axis=1), 127)  # [O]
        q = np.clip(np.rint(w32 / s[:, None]), -128, 127).astype(np.int8)
        return QTensor(f, (o, i), q.view(np.uint8).reshape(-1), s)
    if f.group_size is None:
        s = _scale(np.abs(w32).max(axis=1), 7)  # [O]
        q = np.clip(np.rint(w32 / s[:, None]), -8, 7).astype(np.int16)
        nib = (q + 8).astype(np.uint8)
        return QTensor(f, (o, i), _pack_nibbles(nib).reshape(-1), s)
    gs = f.group_size
    groups = -(-i // gs)
    padded = np.zeros((o, groups * gs), dtype=np.float32)
    padded[:, :i] = w32
    blocks = padded.reshape(o, groups, gs)
    s = _scale(np.abs(blocks).max(axis=2), 7)  # [O, G]
    q = np.clip(np.rint(blocks / s[:, :, None]), -8, 7).astype(np.int16)
    nib = (q + 8).astype(np.uint8).reshape(o, groups * gs)[:, :i]
    return QTensor(f, (o, i), _pack_nibbles(nib).reshape(-1), s.reshape(-1))


def dequantize(t: QTensor) -> F32Array:
    """Any stored weight -> float32 [O, I] (exactly what the kernels compute with)."""
    f, (o, i) = t.fmt, t.shape
    if f.kind == "f32":
        return np.ascontiguousarray(t.data, dtype=np.float32).reshape(o, i)
    if f.kind == "bf16":
        return bf16_to_f32(np.asarray(t.data).view(np.uint16).reshape(o, i))
    if f.kind == "f16":
        return np.asarray(t.data).view(np.float16).reshape(o, i).astype(np.float32)
    if t.scales is None:
        raise FormatError(f"{f.name} weight without scales")
    s = np.asarray(t.scales, dtype=np.float32)
    if f.kind == "int8":
        q = np.asarray(t.data).view(np.int8).reshape(o, i).astype(np.float32)
        return (q * s.reshape(o, 1)).astype(np.float32)
    nib = _unpack_nibbles(np.asarray(t.data, dtype=np.uint8), o, i)
    q = nib.astype(np.float32) - np.float32(8)
    if f.group_size is None:
        return (q * s.reshape(o, 1)).astype(np.float32)
    gs = f.group_size
    groups = -(-i // gs)
    col_scale = np.repeat(s.reshape(o, groups), gs, axis=1)[:, :i]
    return (q * col_scale).astype(np.float32)

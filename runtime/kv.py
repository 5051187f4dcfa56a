"""The KV cache of one sequence: all attention needs to continue it.

Two per-layer row arrays per token, named by the cache's ``layout``:

* ``"mla"``: the normed KV latent [C] and the roped shared rope key [R]; for layers that run
  their own DSA indexer, also the roped, normed index key [DI]. That is 576 floats per token per
  layer for GLM-5 instead of 32,768 for uncompressed K/V.
* ``"gqa"`` (grouped-query families): the roped, normed keys [KV] and the values [KV] of every
  KV head (KV = num_key_value_heads * head_dim), read through ``keys`` / ``values``.

Token ids are kept too (prefix reuse, ``.coli_kv`` records).

Writes go past ``length`` first (a forward fills rows [start, start + T) layer by layer) and
become visible with ``commit``; a forward that fails midway leaves ``length`` unchanged. Arrays
grow by doubling. The per-layer arrays (``latent``, ``k_rope``, ``index_keys``, ``tokens``) are
what persistence writes and reads back.

Shape legend: S tokens held, C kv_lora_rank, R qk_rope_head_dim, DI index_head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from runtime.kernels.aligned import zeros_aligned
from runtime.kernels.attention import write_rows_at
from storage.errors import ModelError

__all__ = ["KVCache"]

F32Array = npt.NDArray[np.float32]
I32Array = npt.NDArray[np.int32]


class KVCache:
    """KV cache for ``n_layers`` layers (layer slots 0..n_layers-1).

    For ``layout="gqa"`` the two widths are those of the keys and the values; the MLA names
    (``kv_lora_rank``, ``qk_rope_head_dim``, ``latent``, ``k_rope``) then mean keys and values,
    which is what persistence, written once for both, sees."""

    def __init__(
        self,
        n_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        index_head_dim: int = 0,
        indexed_layers: Sequence[int] = (),
        capacity: int = 64,
        *,
        layout: Literal["mla", "gqa"] = "mla",
    ) -> None:
        if layout == "gqa" and indexed_layers:
            raise ModelError("a grouped-query KV cache has no DSA index keys")
        self.layout: str = layout
        self.n_layers = n_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.index_head_dim = index_head_dim
        self.indexed_layers = tuple(sorted(indexed_layers))
        if self.indexed_layers and index_head_dim <= 0:
            raise ModelError("a KV cache with indexed layers needs index_head_dim > 0")
        self.length = 0
        self._cap = max(1, capacity)
        self._latent = [zeros_aligned((self._cap, kv_lora_rank)) for _ in range(n_layers)]
        self._k_rope = [zeros_aligned((self._cap, qk_rope_head_dim)) for _ in range(n_layers)]
        self._index = {
            layer: zeros_aligned((self._cap, index_head_dim)) for layer in self.indexed_layers
        }
        self._tokens = np.zeros(self._cap, np.int32)
        self._addresses = self._find_addresses()
        self._index_addresses = self._find_index_addresses()
        # A step queued on this cache ahead of its caller and not yet taken or abandoned
        # (runtime.scheduler.Ahead): the next generation on the cache settles it first.
        self.step_ahead: Any = None

    @property
    def shape(self) -> tuple[str, int, int, int, int, tuple[int, ...]]:
        """What a model's caches share (layout, layers, row widths, indexed layers): a cache
        serves only a model whose ``new_cache()`` has the same shape."""
        return (
            self.layout,
            self.n_layers,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.index_head_dim,
            self.indexed_layers,
        )

    def _find_addresses(self) -> list[tuple[int, int]]:
        return [
            (int(a.ctypes.data), int(b.ctypes.data))
            for a, b in zip(self._latent, self._k_rope, strict=True)
        ]

    def _find_index_addresses(self) -> dict[int, int]:
        return {layer: int(a.ctypes.data) for layer, a in self._index.items()}

    def addresses(self, layer: int) -> tuple[int, int]:
        """Where layer ``layer``'s latent and rope-key rows begin (64-byte aligned, C-contiguous
        float32, ``kv_lora_rank`` / ``qk_rope_head_dim`` per row): for a kernel that reads
        several caches in one call. Valid until the next :meth:`reserve` that grows the cache
        (the caller keeps the cache alive meanwhile)."""
        return self._addresses[layer]

    # ------------------------------------------------------------------------------ writing

    def reserve(self, n: int) -> None:
        """Make room for ``n`` tokens (rows beyond ``length`` are scratch until commit)."""
        if n <= self._cap:
            return
        cap = self._cap
        while cap < n:
            cap *= 2

        def grow(a: F32Array) -> F32Array:
            b = zeros_aligned((cap, *a.shape[1:]), a.dtype)
            b[: self._cap] = a
            return b

        # One array at a time, each old one let go as soon as its copy is made: a long context
        # doubles with one layer's old rows beside the new arrays, not all of them (GLM-5 at
        # 32k tokens: ~70 MB instead of 5.9 GB at the moment of growing). A failure midway
        # (no memory) leaves some layers bigger than needed, every row still there.
        try:
            for rows in (self._latent, self._k_rope):
                for i, a in enumerate(rows):
                    rows[i] = grow(a)
            for k, a in self._index.items():
                self._index[k] = grow(a)
        finally:
            self._addresses = self._find_addresses()
            self._index_addresses = self._find_index_addresses()
        tokens = np.zeros(cap, np.int32)
        tokens[: self._cap] = self._tokens
        self._tokens = tokens
        self._cap = cap

    def write(self, layer: int, start: int, latent: F32Array, k_rope: F32Array) -> None:
        """Store rows [start, start + T) of one layer: ``latent`` [T, C], ``k_rope`` [T, R]."""
        end = start + latent.shape[0]
        self.reserve(end)
        self._latent[layer][start:end] = latent
        self._k_rope[layer][start:end] = k_rope

    @staticmethod
    def write_seqs(
        caches: Sequence[KVCache],
        layer: int,
        starts: Sequence[int],
        bounds: npt.NDArray[np.int64],
        latent: F32Array,
        k_rope: F32Array,
    ) -> None:
        """:meth:`write` of several sequences in one kernel call: cache ``j`` gets rows
        ``bounds[j] .. bounds[j + 1]`` of ``latent`` [N, C] / ``k_rope`` [N, R] at its rows
        ``starts[j]`` on, which must be reserved already (a forward reserves every row of the
        step before its first layer). The same rows as one ``write`` per cache."""
        at, n = KVCache._rows_reserved(caches, layer, starts, bounds)
        first = caches[0]
        if latent.shape != (n, first.kv_lora_rank) or k_rope.shape != (n, first.qk_rope_head_dim):
            raise ModelError(
                f"write_seqs: latent {latent.shape}, k_rope {k_rope.shape} for {n} rows"
            )
        write_rows_at(
            latent, np.array([c._addresses[layer][0] for c in caches], np.int64), at, bounds
        )
        write_rows_at(
            k_rope, np.array([c._addresses[layer][1] for c in caches], np.int64), at, bounds
        )

    @staticmethod
    def write_index_seqs(
        caches: Sequence[KVCache],
        layer: int,
        starts: Sequence[int],
        bounds: npt.NDArray[np.int64],
        keys: F32Array,
    ) -> None:
        """:meth:`write_index` of several sequences in one kernel call (as :meth:`write_seqs`):
        index keys [N, DI] of an indexed layer."""
        at, n = KVCache._rows_reserved(caches, layer, starts, bounds)
        if any(layer not in c._index for c in caches):
            raise ModelError(f"layer slot {layer} has no DSA index keys in some cache")
        if keys.shape != (n, caches[0].index_head_dim):
            raise ModelError(f"write_index_seqs: keys {keys.shape} for {n} rows")
        write_rows_at(
            keys, np.array([c._index_addresses[layer] for c in caches], np.int64), at, bounds
        )

    @staticmethod
    def _rows_reserved(
        caches: Sequence[KVCache],
        layer: int,
        starts: Sequence[int],
        bounds: npt.NDArray[np.int64],
    ) -> tuple[npt.NDArray[np.int64], int]:
        """(starts as int64, rows in all) after checking that there are caches, that they
        share one shape with layer slot ``layer`` in it, and that each reserved its rows."""
        if not caches or len(starts) != len(caches) or bounds.shape != (len(caches) + 1,):
            raise ModelError(f"{len(caches)} caches, {len(starts)} starts, bounds {bounds.shape}")
        first = caches[0]
        if not 0 <= layer < first.n_layers:
            raise ModelError(f"layer slot {layer} outside 0..{first.n_layers - 1}")
        dims = (first.n_layers, first.kv_lora_rank, first.qk_rope_head_dim, first.index_head_dim)
        at = np.asarray(starts, dtype=np.int64)
        for c, a, t in zip(caches, starts, np.diff(bounds).tolist(), strict=True):
            same = c.layout == first.layout
            if (
                not same
                or (c.n_layers, c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim) != dims
            ):
                raise ModelError(
                    f"caches of different shapes in one write: {c.shape}, {first.shape}"
                )
            if a < 0 or t < 0 or a + t > c._cap:
                raise ModelError(f"rows {a}..{a + t} not reserved in a cache of {c._cap}")
        return at, int(bounds[-1])

    def write_index(self, layer: int, start: int, keys: F32Array) -> None:
        """Store index keys [T, DI] of an indexed layer at rows [start, start + T)."""
        if layer not in self._index:
            raise ModelError(f"layer slot {layer} has no DSA index keys in this cache")
        end = start + keys.shape[0]
        self.reserve(end)
        self._index[layer][start:end] = keys

    def write_tokens(self, start: int, ids: npt.NDArray[np.integer]) -> None:
        end = start + ids.shape[0]
        self.reserve(end)
        self._tokens[start:end] = ids

    def commit(self, length: int) -> None:
        """Make rows [0, length) the cache content (after every layer wrote them)."""
        if length > self._cap:
            raise ModelError(f"commit({length}) beyond the written rows ({self._cap} reserved)")
        self.length = length

    def truncate(self, n: int) -> None:
        """Forget every token from position ``n`` on (keep a common prefix)."""
        if not 0 <= n <= self.length:
            raise ModelError(f"truncate({n}) outside 0..{self.length}")
        self.length = n

    # ------------------------------------------------------------------------------ reading

    def latent(self, layer: int, end: int | None = None) -> F32Array:
        """KV latents [S, C] of rows [0, end) (default ``length``), a view."""
        return self._latent[layer][: self.length if end is None else end]

    def k_rope(self, layer: int, end: int | None = None) -> F32Array:
        """Roped rope keys [S, R] of rows [0, end), a view."""
        return self._k_rope[layer][: self.length if end is None else end]

    def index_keys(self, layer: int, end: int | None = None) -> F32Array:
        """DSA index keys [S, DI] of rows [0, end) of an indexed layer, a view."""
        if layer not in self._index:
            raise ModelError(f"layer slot {layer} has no DSA index keys in this cache")
        return self._index[layer][: self.length if end is None else end]

    def keys(self, layer: int, end: int | None = None) -> F32Array:
        """Roped keys [S, KV] of rows [0, end) of a grouped-query cache, a view."""
        return self.latent(layer, end)

    def values(self, layer: int, end: int | None = None) -> F32Array:
        """Values [S, KV] of rows [0, end) of a grouped-query cache, a view."""
        return self.k_rope(layer, end)

    @property
    def tokens(self) -> I32Array:
        """Token ids [S] held, a view."""
        return self._tokens[: self.length]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows in use."""
        per = self.n_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        per += len(self.indexed_layers) * self.index_head_dim
        return self.length * (4 * per + 4)

"""Typed in-memory weights of an MLA + MoE model, loaded from a container.

Dense (non-expert) weights are read once into per-layer structures of :class:`Linear` and float32
arrays. Routed experts come from an :class:`ExpertSource`: the model asks it once per MoE layer
and step for the sorted union of routed experts. :class:`ResidentExperts` reads every expert at
open; the streaming, tiered store implements the same protocol.

Shape legend: T tokens, D hidden, V vocab, E routed experts, NH heads, N qk_nope_head_dim,
V_ v_head_dim, C kv_lora_rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from runtime.kernels.heads import HeadsMatmul
from runtime.kernels.quant_matmul import Int4Layer
from runtime.layers.dsa_indexer import IndexerWeights
from runtime.layers.gqa import GQAWeights
from runtime.layers.mla import MLADims, MLAWeights
from runtime.layers.moe import MoEWeights
from runtime.layers.moe_router import RouterConfig
from runtime.layers.swiglu import MLPWeights, fused
from runtime.linear import Linear
from storage.aligned import HugeArena
from storage.arch import FAMILIES, ArchConfig, Family, attention_biases
from storage.errors import ModelError, ReadError
from storage.integrity import ExpertChecksums, crc32_of, crc_check
from storage.quant import QTensor, QuantFormat, dequantize

__all__ = [
    "ContainerLike",
    "ExpertSource",
    "ExpertWeights",
    "GQALayerWeights",
    "Guess",
    "LayerWeights",
    "Lookahead",
    "MTPWeights",
    "ModelWeights",
    "ResidentExperts",
    "embed_rows",
    "f32_linear",
    "load_gqa_layer",
    "load_layer",
    "load_mtp",
    "qtensor_rows",
]

F32Array = npt.NDArray[np.float32]
R = TypeVar("R")

# A routed expert is a SwiGLU MLP; the name says where it came from.
ExpertWeights = MLPWeights


@dataclass(frozen=True, slots=True)
class Lookahead:
    """A prediction of a later ``layer``'s ``experts`` (most likely first), and the
    compute-thread seconds it took (``cpu_s``: what ``--prefetch auto`` charges the layer's
    lookahead besides disk time)."""

    layer: int
    experts: Sequence[int]
    cpu_s: float = 0.0


#: A prediction not made yet: called on a pool worker while a step's reads are in flight, so
#: that its router does not delay the step (see :meth:`ExpertSource.map_arrivals`).
Guess = Callable[[], Lookahead | None]


class ExpertSource(Protocol):
    """Where routed experts come from (resident RAM, tiered cache + SSD reads, ...).

    Implementations: :class:`ResidentExperts` (everything in RAM) and
    :class:`runtime.experts.StreamingExperts` (the tiered store on the event loop)."""

    def wants_lookahead(self, layer: int) -> bool:
        """Whether a :meth:`prefetch` hint for ``layer`` would be used now (never when
        everything is resident); when False the caller does not even predict."""
        ...

    def arrivals(
        self, layer: int, experts: Sequence[int], lookahead: Lookahead | None = None
    ) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield ``(expert, weights)`` for each of ``experts`` (sorted, unique) of ``layer`` in
        the order they become available. The caller finishes computing with one expert before
        resuming the iterator (a streaming source recycles that expert's buffer then).
        ``lookahead``: a prediction ``(later layer, experts, most likely first)`` whose reads
        go after this step's own (a hint, as for :meth:`prefetch`)."""
        ...

    def map_arrivals(
        self,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, ExpertWeights], R],
        pool: Executor,
        guess: Guess | None = None,
        early: Callable[[int, ExpertWeights], Callable[[], R] | None] | None = None,
        *,
        started: Callable[[], None] | None = None,
    ) -> dict[int, R]:
        """``{e: fn(e, weights_e)}`` with each expert computed on ``pool`` as it arrives (a
        streaming source recycles an expert's buffer once its computation finished).
        ``guess``: a prediction to make on ``pool`` once the step's reads are queued (its
        reads then go after them, as the ``lookahead`` of :meth:`arrivals`); a source that
        reads nothing ahead ignores it. ``early``: for the step's last expert, when a source
        hands over its gate and up projections before its down projection landed,
        ``early(e, partial_weights)`` computes what needs only those and returns what
        finishes ``fn(e, weights)`` (the same result) once it landed, or None (then ``fn``
        runs as usual); a source that reads whole experts ignores it. ``started``: called
        once on the calling thread, when the caller's own work (the shared expert) may go to
        ``pool``: once the step's first read is on the device (within a bound), at once when
        nothing is read."""
        ...

    def prefetch(self, layer: int, experts: Sequence[int], cpu_s: float = 0.0) -> None:
        """Lookahead hint: ``layer`` will probably need ``experts`` soon (may be ignored);
        ``cpu_s``: the compute time the prediction took (see :class:`Lookahead`)."""
        ...


class ContainerLike(Protocol):
    """The parts of :class:`storage.container.Container` the runtime reads."""

    config: dict[str, Any]

    def has(self, name: str) -> bool: ...

    def load_qtensor(self, name: str) -> QTensor: ...

    def load_f32(self, name: str) -> F32Array: ...

    def expert(self, layer: int, expert: int) -> Any: ...

    def expert_layers(self) -> list[int]: ...


# ----------------------------------------------------------------------------- QTensor helpers


def qtensor_rows(q: QTensor, r0: int, r1: int) -> QTensor:
    """Rows [r0, r1) of a stored matrix as a QTensor view (no copy, no requantization).

    Every format stores rows contiguously (packed formats with a fixed row stride and row-major
    scales), so a row range is a plain slice.
    """
    o, i = q.shape
    if not 0 <= r0 <= r1 <= o:
        raise ModelError(f"row range [{r0}, {r1}) outside a [{o}, {i}] matrix")
    n = r1 - r0
    if not q.fmt.quantized:
        return QTensor(q.fmt, (n, i), np.asarray(q.data).reshape(o, i)[r0:r1])
    if q.scales is None:
        raise ModelError(f"{q.fmt.name} matrix without scales")
    data = np.asarray(q.data).reshape(o, -1)[r0:r1].reshape(-1)
    scales = np.asarray(q.scales).reshape(o, -1)[r0:r1].reshape(-1)
    return QTensor(q.fmt, (n, i), data, scales)


def embed_rows(q: QTensor, ids: npt.NDArray[np.integer]) -> F32Array:
    """Embedding lookup [T, D]: dequantize only the rows of ``ids`` [T] of the stored matrix."""
    o, i = q.shape
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= o):
        raise ModelError(f"token id out of range 0..{o - 1}: {ids.min()}..{ids.max()}")
    if not q.fmt.quantized:
        rows = QTensor(q.fmt, (ids.size, i), np.asarray(q.data).reshape(o, i)[ids])
    else:
        if q.scales is None:
            raise ModelError(f"{q.fmt.name} embedding without scales")
        data = np.asarray(q.data).reshape(o, -1)[ids].reshape(-1)
        scales = np.asarray(q.scales).reshape(o, -1)[ids].reshape(-1)
        rows = QTensor(q.fmt, (ids.size, i), data, scales)
    return dequantize(rows)  # [T, D]


def f32_linear(w: F32Array) -> Linear:
    """A Linear over a float32 matrix [O, I] (router weights, derived absorption matrices)."""
    a = np.ascontiguousarray(w, dtype=np.float32)
    return Linear(QTensor(QuantFormat("f32"), (a.shape[0], a.shape[1]), a))


# ----------------------------------------------------------------------------- structures


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's resident weights (``moe`` or ``mlp`` is set, never both)."""

    input_layernorm: F32Array  # [D]
    post_attention_layernorm: F32Array  # [D]
    attn: MLAWeights
    indexer: IndexerWeights | None  # layers that run their own DSA indexer
    mlp: MLPWeights | None  # dense layers
    moe: MoEWeights | None  # MoE layers (routed experts come from the ExpertSource)


@dataclass(frozen=True, slots=True)
class GQALayerWeights:
    """One grouped-query decoder layer's resident weights (``moe`` or ``mlp`` is set)."""

    input_layernorm: F32Array  # [D]
    post_attention_layernorm: F32Array  # [D]
    attn: GQAWeights
    mlp: MLPWeights | None
    moe: MoEWeights | None


@dataclass(frozen=True, slots=True)
class MTPWeights:
    """The multi-token-prediction head stored at layer index ``num_hidden_layers + i``."""

    enorm: F32Array  # [D]
    hnorm: F32Array  # [D]
    eh_proj: Linear  # [D, 2D]
    shared_head_norm: F32Array  # [D]
    shared_head: Linear  # [V, D]
    embed: QTensor | None  # its own embed_tokens, or None to share the main one
    layer: LayerWeights


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed: QTensor  # [V, D] stored (rows dequantized on lookup)
    norm: F32Array  # [D]
    lm_head: Linear  # [V, D]
    layers: Sequence[LayerWeights | GQALayerWeights]
    mtp: Sequence[MTPWeights]


# ----------------------------------------------------------------------------- loading


def _opt_f32(c: ContainerLike, name: str) -> F32Array | None:
    return c.load_f32(name) if c.has(name) else None


def _bias(c: ContainerLike, attn: str, proj: str) -> F32Array | None:
    """The bias of attention projection ``proj`` (``attn``: the layer's ``self_attn.``
    prefix), where the family and config.json's attention_bias give it one (as transformers
    builds the layer: a bias the checkpoint holds beyond those is never applied)."""
    mt = str(c.config.get("model_type", ""))
    if proj not in attention_biases(mt, c.config):
        return None
    return _opt_f32(c, f"{attn}{proj}.bias")


def _mla(c: ContainerLike, p: str, d: MLADims) -> MLAWeights:
    lin = c.load_qtensor
    kv_b = lin(p + "kv_b_proj.weight")  # [NH * (N + V_), C]
    n, v, nh = d.qk_nope_head_dim, d.v_head_dim, d.num_attention_heads
    per = n + v
    # Absorption needs q_nope[h] @ W_UK[h] (the transposed product), computed as a sum of W_UK
    # rows: dequantized from the int4 rows as they are used where the kernel takes them, else
    # from a float32 copy (the same values either way: the same bits); W_UV[h] is a row slice.
    uk_heads = None
    if kv_b.fmt.kind == "int4" and kv_b.scales is not None:
        uk_heads = HeadsMatmul.axpy_int4(
            np.asarray(kv_b.data), kv_b.scales, kv_b.fmt.group_size, d.kv_lora_rank, 0, per, n,
            nh,
        )  # fmt: skip
    if uk_heads is None:
        kv_b_f32 = dequantize(kv_b).reshape(nh, per, d.kv_lora_rank)  # [NH, N + V_, C]
        uk_heads = HeadsMatmul.axpy(kv_b_f32[:, :n])  # [NH, N, C]
    w_uv = [Linear(qtensor_rows(kv_b, h * per + n, (h + 1) * per)) for h in range(nh)]
    # Every head's W_UV product in one numba call (the same kernels as w_uv, the same bits).
    if kv_b.fmt.kind == "int4" and kv_b.scales is not None:
        uv_heads = HeadsMatmul.int4_rows(
            np.asarray(kv_b.data), kv_b.scales, kv_b.fmt.group_size, d.kv_lora_rank,
            n, per, v, w_uv, w_uv[0].lanes,
        )  # fmt: skip
    else:
        uv_heads = HeadsMatmul(w_uv)
    q: dict[str, Any] = {}
    if d.q_lora_rank is not None:
        q["q_a_proj"] = Linear(lin(p + "q_a_proj.weight"))
        q["q_a_layernorm"] = c.load_f32(p + "q_a_layernorm.weight")
        q["q_b_proj"] = Linear(lin(p + "q_b_proj.weight"))
    else:
        q["q_proj"] = Linear(lin(p + "q_proj.weight"))
    return MLAWeights(
        kv_a_proj_with_mqa=Linear(lin(p + "kv_a_proj_with_mqa.weight")),
        kv_a_layernorm=c.load_f32(p + "kv_a_layernorm.weight"),
        kv_b_proj=Linear(kv_b),
        o_proj=Linear(lin(p + "o_proj.weight")),
        uk_heads=uk_heads,
        w_uv=w_uv,
        uv_heads=uv_heads,
        q_a_bias=_bias(c, p, "q_a_proj"),
        kv_a_bias=_bias(c, p, "kv_a_proj_with_mqa"),
        o_bias=_bias(c, p, "o_proj"),
        **q,
    )


def _mlp(c: ContainerLike, p: str) -> MLPWeights:
    return MLPWeights(
        gate=Linear(c.load_qtensor(p + "gate_proj.weight")),
        up=Linear(c.load_qtensor(p + "up_proj.weight")),
        down=Linear(c.load_qtensor(p + "down_proj.weight")),
    )


# Every MLA family (GLM-5, DeepSeek-V3/V3.2, Kimi K2) names its MoE block the DeepSeek way.
_MLA_NAMES = FAMILIES["deepseek_v3"]


def _moe(c: ContainerLike, p: str, family: Family, router: RouterConfig) -> MoEWeights:
    """The resident part of the MoE block of the layer at prefix ``p``: the fp32 router, the
    correction bias (zeros for a family without one) and the shared experts, by the family's
    names (``mlp.*`` or ``block_sparse_moe.*``)."""
    shared = None
    if c.has(p + "mlp.shared_experts.gate_proj.weight"):
        shared = _mlp(c, p + "mlp.shared_experts.")
    bias = (
        c.load_f32(p + family.bias).reshape(-1)
        if family.bias is not None
        else np.zeros(router.n_routed_experts, np.float32)
    )
    return MoEWeights(
        router=f32_linear(c.load_f32(p + family.router)),  # fp32 router, [E, D]
        correction_bias=bias,
        shared=shared,
        config=router,
    )


def load_layer(
    c: ContainerLike,
    layer: int,
    dims: MLADims,
    router: RouterConfig,
    *,
    moe: bool,
    indexer: bool,
) -> LayerWeights:
    """Resident weights of decoder layer ``layer`` (HF names ``model.layers.{layer}.*``)."""
    p = f"model.layers.{layer}."
    idx = None
    if indexer:
        ip = p + "self_attn.indexer."
        idx = IndexerWeights(
            wq_b=Linear(c.load_qtensor(ip + "wq_b.weight")),
            wk=Linear(c.load_qtensor(ip + "wk.weight")),
            k_norm_weight=c.load_f32(ip + "k_norm.weight"),
            k_norm_bias=c.load_f32(ip + "k_norm.bias"),
            weights_proj=Linear(c.load_qtensor(ip + "weights_proj.weight")),
        )
    moe_w = None
    moe_w = _moe(c, p, _MLA_NAMES, router) if moe else None
    mlp_w = None if moe else _mlp(c, p + "mlp.")
    return LayerWeights(
        input_layernorm=c.load_f32(p + "input_layernorm.weight"),
        post_attention_layernorm=c.load_f32(p + "post_attention_layernorm.weight"),
        attn=_mla(c, p + "self_attn.", dims),
        indexer=idx,
        mlp=mlp_w,
        moe=moe_w,
    )


def load_gqa_layer(
    c: ContainerLike, layer: int, family: Family, router: RouterConfig, *, moe: bool
) -> GQALayerWeights:
    """Resident weights of grouped-query decoder layer ``layer``; the MoE block's names come
    from the family's row in :data:`storage.arch.FAMILIES` (``mlp.*`` / ``block_sparse_moe.*``)."""
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    attn = GQAWeights(
        q_proj=Linear(c.load_qtensor(a + "q_proj.weight")),
        k_proj=Linear(c.load_qtensor(a + "k_proj.weight")),
        v_proj=Linear(c.load_qtensor(a + "v_proj.weight")),
        o_proj=Linear(c.load_qtensor(a + "o_proj.weight")),
        q_bias=_bias(c, a, "q_proj"),
        k_bias=_bias(c, a, "k_proj"),
        v_bias=_bias(c, a, "v_proj"),
        o_bias=_bias(c, a, "o_proj"),
        q_norm=_opt_f32(c, a + "q_norm.weight"),
        k_norm=_opt_f32(c, a + "k_norm.weight"),
    )
    moe_w = _moe(c, p, family, router) if moe else None
    mlp_w = None if moe else _mlp(c, p + "mlp.")
    return GQALayerWeights(
        input_layernorm=c.load_f32(p + "input_layernorm.weight"),
        post_attention_layernorm=c.load_f32(p + "post_attention_layernorm.weight"),
        attn=attn,
        mlp=mlp_w,
        moe=moe_w,
    )


def load_mtp(
    c: ContainerLike, layer: int, dims: MLADims, router: RouterConfig, *, indexer: bool
) -> MTPWeights:
    """The MTP head stored at ``model.layers.{layer}`` (a MoE decoder layer plus its glue)."""
    p = f"model.layers.{layer}."
    embed = c.load_qtensor(p + "embed_tokens.weight") if c.has(p + "embed_tokens.weight") else None
    return MTPWeights(
        enorm=c.load_f32(p + "enorm.weight"),
        hnorm=c.load_f32(p + "hnorm.weight"),
        eh_proj=Linear(c.load_qtensor(p + "eh_proj.weight")),
        shared_head_norm=c.load_f32(p + "shared_head.norm.weight"),
        shared_head=Linear(c.load_qtensor(p + "shared_head.head.weight")),
        embed=embed,
        layer=load_layer(c, layer, dims, router, moe=True, indexer=indexer),
    )


# ----------------------------------------------------------------------------- experts


def _verify_resident(
    checksums: ExpertChecksums,
    layer: int,
    e: int,
    ext: Any,
    blob: npt.NDArray[np.uint8],
    scales: Mapping[str, F32Array | None],
) -> None:
    want = checksums.get(layer, e)
    where = f"layer {layer} expert {e} in {ext.path.name} [{ext.start}, {ext.end})"
    if want is None:
        raise ReadError(f"{where}: no checksum in the manifest")
    problem = crc_check(want[0], where)(blob)
    if problem is None and want[1] is not None:
        on_disk = sorted(  # the scale tensors in file order: the manifest's [qs_start, qs_end)
            ((proj, info.start) for proj, info in ext.scales.items() if info is not None),
            key=lambda t: t[1],
        )
        parts = [a for a in (scales[proj] for proj, _ in on_disk) if a is not None]
        if crc32_of(parts) != want[1]:
            problem = f"the scales of {where}: checksum mismatch: this copy on disk is damaged"
    if problem is not None:
        raise ReadError(problem)


class ResidentExperts:
    """Every routed expert read once at open (one pread of its blob plus its scales) and kept.

    For models that fit in RAM and for tests; ``get`` never blocks on I/O.
    """

    def __init__(
        self,
        container: ContainerLike,
        layers: Iterable[int] | None = None,
        *,
        checksums: ExpertChecksums | None = None,
        progress: Callable[[int, int], None] | None = None,
        keys: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        """``checksums`` (``--verify-reads``): each expert's bytes are checked as they load.
        ``progress(done, total)`` is called after each expert. ``keys``: only these
        ``(layer, expert)`` (a cluster worker's share) instead of every expert of ``layers``."""
        self._experts: dict[tuple[int, int], ExpertWeights] = {}
        self._tables: dict[int, Int4Layer | None] = {}  # int4_layer's, made on first use
        self.nbytes = 0
        # the blobs packed on transparent huge pages where the kernel allows them, as the
        # container keeps its dense weights: the experts' one-token GEMVs stream them from
        # DRAM with four read streams, ~6% faster than from 4 KiB pages (docs/benchmarks.md)
        self.arena = HugeArena()
        self._n_experts = ArchConfig.from_dict(container.config).n_routed_experts
        if keys is None:
            n_experts = self._n_experts
            todo = list(container.expert_layers() if layers is None else layers)
            wanted = [(layer, e) for layer in todo for e in range(n_experts)]
        else:
            wanted = sorted(keys)
        total, done = len(wanted), 0
        for layer, e in wanted:
            ext = container.expert(layer, e)
            blob = ext.read_blob(self.arena.empty(ext.nbytes))  # [end - start] uint8
            scales = ext.read_scales()
            if checksums is not None:
                _verify_resident(checksums, layer, e, ext, blob, scales)
            q = ext.qtensors(blob, scales)
            self._experts[(layer, e)] = ExpertWeights(
                gate=Linear(q["gate_proj"]),
                up=Linear(q["up_proj"]),
                down=Linear(q["down_proj"]),
            )
            self.nbytes += int(blob.nbytes) + sum(
                int(t.scales.nbytes) for t in q.values() if t.scales is not None
            )
            done += 1
            if progress is not None:
                progress(done, total)

    def get(self, layer: int, experts: Sequence[int]) -> Mapping[int, ExpertWeights]:
        try:
            return {e: self._experts[(layer, e)] for e in experts}
        except KeyError as exc:
            raise ModelError(f"layer {layer} expert {exc.args[0]} is not resident") from exc

    def arrivals(
        self, layer: int, experts: Sequence[int], lookahead: Lookahead | None = None
    ) -> Iterator[tuple[int, ExpertWeights]]:
        yield from self.get(layer, experts).items()

    def int4_layer(self, layer: int) -> Int4Layer | None:
        """Layer ``layer``'s routed experts as the tables of one int4 kernel call for all of
        them (:func:`runtime.kernels.quant_matmul.routed_layer_int4`), made on first use; None
        when an expert of the layer is not here or not int4 with the kernel (each expert then
        runs on its own)."""
        if layer in self._tables:
            return self._tables[layer]
        found = self.layer_experts(layer)
        table = None if found is None else Int4Layer.build([fused(w) for w in found])
        self._tables[layer] = table
        return table

    def layer_experts(self, layer: int) -> list[ExpertWeights] | None:
        """Every routed expert of ``layer``, by id; None when one of them is not here (a
        cluster worker's share)."""
        found = [self._experts.get((layer, e)) for e in range(self._n_experts)]
        return None if any(w is None for w in found) else found  # type: ignore[return-value]

    def map_arrivals(
        self,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, ExpertWeights], R],
        pool: Executor,
        guess: Guess | None = None,
        early: Callable[[int, ExpertWeights], Callable[[], R] | None] | None = None,
        *,
        started: Callable[[], None] | None = None,
    ) -> dict[int, R]:
        """``{e: fn(e, weights)}`` computed on ``pool`` (every expert is already resident)."""
        if started is not None:
            started()
        futures = {e: pool.submit(fn, e, w) for e, w in self.get(layer, experts).items()}
        return {e: f.result() for e, f in futures.items()}

    def wants_lookahead(self, layer: int) -> bool:
        return False  # everything is resident

    def prefetch(self, layer: int, experts: Sequence[int], cpu_s: float = 0.0) -> None:
        """Everything is resident: nothing to do."""

"""The decoder stack every MoE architecture shares, and its MLA form (DeepSeek-V3, GLM-5).

:class:`DecoderStack` is the shared part (embedding, the layer loop, the MLP / MoE half, the
head); :class:`MLAMoEModel` adds MLA attention (+ DSA hooks, MTP), and
:class:`runtime.models._gqa.GQAMoEModel` grouped-query attention.

Per layer: ``h += MLA(rms_norm(h))`` (optionally narrowed by a sparse-attention selection the
architecture supplies) then ``h += MLP-or-MoE(rms_norm(h))``; at the end ``rms_norm`` and
``lm_head``. An architecture file subclasses :class:`MLAMoEConfig` (its HF config keys) and
:class:`MLAMoEModel` (its hooks: which layers are MoE, rope pairing, DSA).

Code path choices (one code path for every T; the numbers differ only by rounding):

* every forward continues from ``cache.length``: new rows are written to the cache first, then
  the new queries attend over cache + new keys with a causal mask;
* MLA evaluation order: the call's ``StepContext.attention_mode`` "absorbed" (the default)
  computes every query row on its own over its causal keys, so a token's rows (KV, index keys,
  hidden, logits) are bit-identical whether it runs alone, in a prefill chunk of any size, in a
  speculative verify block or in a batched step with other sequences. "auto" (the labelled
  ``--fast-prefill``) picks the cheaper of reconstructing K/V (fresh prefill) or absorbing per
  call by multiply-add count (``runtime.layers.mla.prefer_absorbed``): equal up to rounding only.
* MoE: :func:`runtime.scheduler.moe_step` (route -> union -> place -> compute as arrivals land
  -> combine) once per layer per call, then the shared expert.

Every call takes a frozen :class:`~runtime.context.StepContext` (compute pool, observer,
attention mode); the model itself holds only config, weights and its expert source.

Shape legend: T new tokens, S keys (cache + new), D hidden, V vocab, K experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

import numpy as np
import numpy.typing as npt

from runtime.context import AttentionMode, Observer, StepContext
from runtime.kv import KVCache
from runtime.layers import mla
from runtime.layers.mla import MLADims
from runtime.layers.moe import MoEWeights
from runtime.layers.moe_router import RouterConfig
from runtime.layers.rms_norm import rms_norm
from runtime.layers.rope import Rope, RopeParameters, mla_softmax_scale
from runtime.linear import Linear
from runtime.scheduler import moe_step, predict_next
from runtime.weights import (
    ContainerLike,
    ExpertSource,
    GQALayerWeights,
    LayerWeights,
    ModelWeights,
    ResidentExperts,
    embed_rows,
    load_layer,
    load_mtp,
)
from storage.arch import ArchConfig, check_router, math_keys, with_family_defaults
from storage.errors import ConfigError, ModelError

__all__ = [
    "AttentionMode",
    "DecoderStack",
    "LogitsOut",
    "MLAMoEConfig",
    "MLAMoEModel",
    "MoEConfig",
    "Observer",
    "SeqState",
    "StepContext",
]

F32Array = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]


class LogitsOut(NamedTuple):
    """Result of a forward: logits [T, V] and the final normed hidden states [T, D]."""

    logits: F32Array
    hidden: F32Array


class SeqState(NamedTuple):
    """One sequence of a call: its cache, its first new position, rope tables [T, R/2]."""

    cache: KVCache
    start: int
    cos: F32Array
    sin: F32Array


class SelectionRows(NamedTuple):
    """What a sparse selection computes per new row before it looks at a cache, made once for
    the rows of several sequences (rows are independent: the same bits): index keys [N, DI],
    and, when some sequence scores, index queries [N, HI, DI] and head weights [N, HI]."""

    keys: F32Array
    queries: tuple[F32Array, F32Array] | None

    def part(self, lo: int, hi: int) -> SelectionRows:
        """Rows ``lo:hi`` (one sequence's)."""
        q = None if self.queries is None else (self.queries[0][lo:hi], self.queries[1][lo:hi])
        return SelectionRows(self.keys[lo:hi], q)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """HF config keys every MoE decoder stack reads (field name = config key).

    The structural keys come from :class:`storage.arch.ArchConfig` (``arch``: one parse, the
    one storage, the converter and doctor use); this class adds what only the math reads."""

    arch: ArchConfig
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int = 0
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 0
    rope_parameters: RopeParameters

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> Self:
        """Parse (and validate) a config.json dict; keys it leaves out take the family's
        defaults, as transformers' config class does (``storage.arch.with_family_defaults``)."""
        return cls(**cls._parse(with_family_defaults(cfg)))

    @classmethod
    def _parse(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        arch = ArchConfig.from_dict(cfg)  # the structure, parsed and validated once
        try:
            kw: dict[str, Any] = dict(
                arch=arch,
                model_type=arch.model_type,
                vocab_size=arch.vocab_size,
                hidden_size=arch.hidden_size,
                intermediate_size=arch.intermediate_size,
                moe_intermediate_size=arch.moe_intermediate_size,
                num_hidden_layers=arch.num_hidden_layers,
                num_attention_heads=arch.num_attention_heads,
                n_routed_experts=arch.n_routed_experts,
                n_shared_experts=arch.n_shared_experts,
                num_experts_per_tok=arch.top_k,
                n_group=arch.n_group,
                topk_group=arch.topk_group,
                num_nextn_predict_layers=arch.num_mtp_layers,
                # the keys only the math needs
                **math_keys(cfg),
                rope_parameters=RopeParameters.from_config(cfg),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json: a key has a bad value ({exc})") from exc
        return kw

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ConfigError(f"config.json: hidden_act {self.hidden_act!r} (only silu)")
        check_router(self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok)

    def is_moe_layer(self, layer: int) -> bool:
        """MoE or dense MLP (MTP layers, index >= num_hidden_layers, are MoE)."""
        return self.arch.is_moe_layer(layer)

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


@dataclass(frozen=True, kw_only=True)
class MLAMoEConfig(MoEConfig):
    """HF config keys of the MLA + MoE architectures (DeepSeek-V3, GLM-5)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int = 0

    @classmethod
    def _parse(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        kw = super()._parse(cfg)
        arch: ArchConfig = kw["arch"]
        kw.update(
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_nope_head_dim=arch.qk_nope_head_dim,
            qk_rope_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.v_head_dim,
            first_k_dense_replace=arch.first_k_dense_replace,
        )
        return kw

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_parameters.partial_rotary_factor not in (None, 1.0):
            raise ConfigError("config.json: partial_rotary_factor != 1 is not supported for MLA")

    def interleaved_rope(self) -> bool:
        """Whether rope pairs are interleaved (x0, x1), ... rather than split in halves."""
        return True

    @property
    def mla_dims(self) -> MLADims:
        return MLADims(
            num_attention_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )


class DecoderStack:
    """What every MoE decoder stack shares: embedding, the per-layer loop over attention (per
    sequence, the stack's own) and the MLP / MoE half (all rows of a step at once, one expert
    union per layer), the final norm and ``lm_head``. Subclasses: :class:`MLAMoEModel` and
    :class:`runtime.models._gqa.GQAMoEModel`.

    The model holds config, weights and its expert source; how a call computes (threads,
    observer, attention order) comes with the call as a :class:`StepContext`.
    """

    config: MoEConfig
    rope: Rope

    def __init__(self, config: MoEConfig, weights: ModelWeights, experts: ExpertSource) -> None:
        self.config = config
        self.weights = weights
        self.experts = experts

    def new_cache(self) -> KVCache:
        """An empty KV cache for the main layers."""
        raise NotImplementedError

    @property
    def has_mtp(self) -> bool:
        return bool(self.weights.mtp)

    def new_mtp_cache(self) -> KVCache:
        raise ModelError("this model has no MTP head (num_nextn_predict_layers / weights)")

    def mtp_step(
        self,
        hidden: F32Array,
        next_ids: npt.NDArray[np.integer],
        mtp_cache: KVCache,
        *,
        last_only: bool = True,
        ctx: StepContext | None = None,
    ) -> tuple[F32Array, F32Array]:
        """``mtp_forward`` that also returns the head's normed output [T, D] (the input of a
        chained draft) and, with ``last_only``, logits of the last row only ([1, V]): one
        sequence of :meth:`mtp_step_batch`."""
        out = self.mtp_step_batch([hidden], [next_ids], [mtp_cache], last_only=last_only, ctx=ctx)
        return out[0]

    def mtp_step_batch(
        self,
        hiddens: Sequence[F32Array],
        next_ids: Sequence[npt.NDArray[np.integer]],
        mtp_caches: Sequence[KVCache],
        *,
        last_only: bool = True,
        ctx: StepContext | None = None,
    ) -> list[tuple[F32Array, F32Array]]:
        raise ModelError("this model has no MTP head (num_nextn_predict_layers / weights)")

    # ------------------------------------------------------------------------------ forward

    def forward(
        self,
        ids: npt.NDArray[np.integer],
        cache: KVCache,
        *,
        last_only: bool = False,
        ctx: StepContext | None = None,
    ) -> LogitsOut:
        """Run ``ids`` [T] after the ``cache.length`` tokens already in ``cache``; commits them.

        ``last_only`` computes logits for the last row only ([1, V]: a prefill chunk needs no
        more, and [T, V] is big for a large vocabulary); ``hidden`` is still [T, D]. ``ctx``:
        the call's settings (default: serial, exact, absorbed)."""
        return self.forward_batch([ids], [cache], last_only=last_only, ctx=ctx)[0]

    def forward_batch(
        self,
        batch: Sequence[npt.NDArray[np.integer]],
        caches: Sequence[KVCache],
        *,
        last_only: bool | Sequence[bool] = False,
        ctx: StepContext | None = None,
    ) -> list[LogitsOut]:
        """Several sequences in one step: attention per sequence (each its own cache), the MLP /
        MoE half on all their rows at once, so each layer reads the union of their experts once.

        ``last_only``: for every sequence, or one flag per sequence (a prefill chunk beside
        decode rows: the chunk's last row only, every row of the others).
        Row results are bit-identical to running each sequence alone through :meth:`forward`
        (batch-invariant kernels, per-row MoE combination)."""
        if len(batch) != len(caches) or not batch:
            raise ModelError("forward_batch needs one cache per sequence and at least one")
        lasts = [last_only] * len(batch) if isinstance(last_only, bool) else list(last_only)
        if len(lasts) != len(batch):
            raise ModelError(f"forward_batch: {len(lasts)} last_only flags for {len(batch)} "
                             "sequences")  # fmt: skip
        ctx = ctx if ctx is not None else StepContext()
        seqs: list[SeqState] = []
        all_ids = []
        for ids_in, cache in zip(batch, caches, strict=True):
            ids = np.asarray(ids_in, dtype=np.int64).reshape(-1)
            if ids.shape[0] == 0:
                raise ModelError("forward needs at least one token")
            start = cache.length
            cos, sin = self.rope.cos_sin(np.arange(start, start + ids.shape[0]))  # [T, R/2]
            cache.reserve(start + ids.shape[0])
            seqs.append(SeqState(cache, start, cos, sin))
            all_ids.append(ids)
        hs = [embed_rows(self.weights.embed, ids) for ids in all_ids]  # [T_j, D] each
        sel: list[BoolArray | None] = [None] * len(seqs)
        bounds = np.cumsum([0] + [ids.shape[0] for ids in all_ids])
        # Activations that damaged weights blow up (inf, then NaN) are caught by the final
        # norm's check, which stops the generation with what to do; numpy's warnings on the
        # way there (an overflowing square in a layer's norm) would only print noise first.
        with np.errstate(over="ignore", invalid="ignore"):
            for i, lw in enumerate(self.weights.layers):
                hs, sel = self._attention_step(ctx, i, lw, hs, seqs, sel)
                h = self._mlp(ctx, i, lw, np.concatenate(hs))  # [sum T_j, D]
                hs = [h[bounds[j] : bounds[j + 1]] for j in range(len(seqs))]
        hidden = rms_norm(
            np.concatenate(hs), self.weights.norm, self.config.rms_norm_eps, check=True
        )
        # the rows whose logits are asked for: a sequence's last row (a prefill chunk needs no
        # more, and [T, V] is big for a large vocabulary) or all of them
        if all(lasts):
            picked = np.ascontiguousarray(hidden[bounds[1:] - 1])  # [n_seq, D]
        elif not any(lasts):
            picked = hidden  # [sum T_j, D]
        else:
            at = np.concatenate(
                [
                    np.array([bounds[j + 1] - 1]) if last else np.arange(bounds[j], bounds[j + 1])
                    for j, last in enumerate(lasts)
                ]
            )
            picked = np.ascontiguousarray(hidden[at])
        logits = ctx.compute.linear(self.weights.lm_head, picked)  # [rows picked, V]
        out = []
        k = 0  # the sequence's first row in ``logits``
        for j, (ids, seq) in enumerate(zip(all_ids, seqs, strict=True)):
            seq.cache.write_tokens(seq.start, ids)
            seq.cache.commit(seq.start + ids.shape[0])
            lo, hi = bounds[j], bounds[j + 1]
            n = 1 if lasts[j] else hi - lo
            out.append(LogitsOut(logits[k : k + n], hidden[lo:hi]))
            k += n
        return out

    # ------------------------------------------------------------------------------ layers

    def _attention_step(
        self,
        ctx: StepContext,
        layer: int,
        lw: Any,
        hs: list[F32Array],
        seqs: list[SeqState],
        sel: list[BoolArray | None],
        slot: int | None = None,
    ) -> tuple[list[F32Array], list[BoolArray | None]]:
        """Attention half of layer ``layer`` for every sequence of the step (each over its own
        cache, at ``slot``: default ``layer``; the MTP layer's is 0): the new hidden rows and
        sparse selections per sequence. A stack may share the projections of all sequences'
        rows (rows are independent: bit-identical)."""
        at = layer if slot is None else slot
        out = [
            self._attention(ctx, layer, at, lw, h, seq, prev)
            for h, seq, prev in zip(hs, seqs, sel, strict=True)
        ]
        return [h for h, _ in out], [s for _, s in out]

    def _attention(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: Any,
        h: F32Array,
        seq: SeqState,
        prev_selection: BoolArray | None,
    ) -> tuple[F32Array, BoolArray | None]:
        """Attention half of a layer over one sequence's cache: h + attn(norm(h)) [T, D] and
        the layer's sparse selection (None: dense), which the next layer may reuse."""
        raise NotImplementedError

    def _mlp(
        self, ctx: StepContext, layer: int, lw: LayerWeights | GQALayerWeights, h: F32Array
    ) -> F32Array:
        """MLP / MoE half of a layer: h + mlp(norm(h)) [T, D]. Rows are independent, so rows of
        several sequences can share one call (and one expert union)."""
        x = rms_norm(h, lw.post_attention_layernorm, self.config.rms_norm_eps)  # [T, D]
        if lw.moe is not None:
            c = self.config
            macs = 3 * c.hidden_size * c.moe_intermediate_size  # one row through one expert
            y = moe_step(ctx, self.experts, layer, lw.moe, x, macs, self._next_router(layer))
        elif lw.mlp is not None:
            ahead = predict_next(self.experts, layer, self._next_router(layer), x)
            if ahead is not None:  # the next MoE layer's reads start while this one computes
                self.experts.prefetch(ahead.layer, ahead.experts, ahead.cpu_s)
            y = ctx.compute.swiglu(x, lw.mlp)  # [T, D]
        else:
            raise ModelError(f"layer {layer} has neither an MLP nor a MoE block")
        return h + y

    def _next_router(self, layer: int) -> MoEWeights | None:
        """Layer L+1's MoE weights (its router predicts the next layer's experts for the
        lookahead), or None when L+1 is not a main MoE layer."""
        nxt = layer + 1
        if nxt >= len(self.weights.layers):
            return None
        return self.weights.layers[nxt].moe


class MLAMoEModel(DecoderStack):
    """An MLA + MoE decoder over stored weights. Build with :meth:`from_container`.

    ``forward`` continues a sequence held in a :class:`KVCache`; ``mtp_forward`` runs the
    multi-token-prediction head (when the container has one) with its own cache.
    """

    config_class: ClassVar[type[MLAMoEConfig]] = MLAMoEConfig
    config: MLAMoEConfig

    def __init__(self, config: MLAMoEConfig, weights: ModelWeights, experts: ExpertSource) -> None:
        super().__init__(config, weights, experts)
        self.dims = config.mla_dims
        self.rope = Rope(
            config.rope_parameters,
            config.qk_rope_head_dim,
            config.max_position_embeddings,
            config.interleaved_rope(),
        )
        self.softmax_scale = mla_softmax_scale(self.dims.qk_head_dim, config.rope_parameters)

    # ------------------------------------------------------------------------------ building

    @classmethod
    def from_container(cls, container: ContainerLike, experts: ExpertSource | None = None) -> Self:
        """Load the resident weights; experts default to :class:`ResidentExperts`."""
        config = cls.config_class.from_dict(container.config)
        dims, router = config.mla_dims, config.router
        layers = [
            load_layer(
                container,
                i,
                dims,
                router,
                moe=config.is_moe_layer(i),
                indexer=cls._loads_indexer(config, container, i),
            )
            for i in range(config.num_hidden_layers)
        ]
        mtp = []
        n = config.num_hidden_layers
        if config.num_nextn_predict_layers > 0 and container.has(
            f"model.layers.{n}.eh_proj.weight"
        ):
            mtp.append(
                load_mtp(
                    container, n, dims, router, indexer=cls._loads_indexer(config, container, n)
                )
            )
        weights = ModelWeights(
            embed=container.load_qtensor("model.embed_tokens.weight"),
            norm=container.load_f32("model.norm.weight"),
            lm_head=Linear(container.load_qtensor("lm_head.weight")),
            layers=layers,
            mtp=mtp,
        )
        return cls(config, weights, experts if experts is not None else ResidentExperts(container))

    @classmethod
    def _loads_indexer(cls, config: MLAMoEConfig, container: ContainerLike, layer: int) -> bool:
        """Whether layer ``layer`` has DSA indexer weights to load (none for plain MLA)."""
        return False

    # ------------------------------------------------------------------------------ caches

    def _indexed_slots(self, layers: range) -> list[int]:
        return [slot for slot, layer in enumerate(layers) if self._caches_index_keys(layer)]

    def _caches_index_keys(self, layer: int) -> bool:
        return False

    @property
    def _index_head_dim(self) -> int:
        return 0

    def new_cache(self) -> KVCache:
        """An empty KV cache for the main layers."""
        c = self.config
        return KVCache(
            c.num_hidden_layers,
            c.kv_lora_rank,
            c.qk_rope_head_dim,
            self._index_head_dim,
            self._indexed_slots(range(c.num_hidden_layers)),
        )

    def new_mtp_cache(self) -> KVCache:
        """An empty KV cache for the MTP layer (its attention has its own history)."""
        c = self.config
        n = c.num_hidden_layers
        return KVCache(
            1,
            c.kv_lora_rank,
            c.qk_rope_head_dim,
            self._index_head_dim,
            self._indexed_slots(range(n, n + 1)),
        )

    # ------------------------------------------------------------------------------ forward

    def mtp_forward(
        self,
        hidden: F32Array,
        next_ids: npt.NDArray[np.integer],
        mtp_cache: KVCache,
        *,
        ctx: StepContext | None = None,
    ) -> F32Array:
        """MTP logits [T, V] from main final-normed ``hidden`` [T, D] and ``next_ids`` [T].

        Row t combines h_t with the embedding of token t+1 and predicts token t+2:
        ``u = eh_proj(cat(enorm(embed(next)), hnorm(h)))``, the MTP decoder layer over u (its own
        cache, positions from ``mtp_cache.length``), then ``shared_head.head(shared_head.norm)``.
        """
        return self.mtp_step(hidden, next_ids, mtp_cache, last_only=False, ctx=ctx)[0]

    def mtp_step_batch(
        self,
        hiddens: Sequence[F32Array],
        next_ids: Sequence[npt.NDArray[np.integer]],
        mtp_caches: Sequence[KVCache],
        *,
        last_only: bool = True,
        ctx: StepContext | None = None,
    ) -> list[tuple[F32Array, F32Array]]:
        """:meth:`mtp_step` for several sequences in one call, each (``hiddens[j]`` [T_j, D],
        ``next_ids[j]`` [T_j]) after the rows already in its own ``mtp_caches[j]``: the head's
        projections and its MoE run once over every sequence's rows (each expert read once
        for all of them), attention per sequence. Each sequence's (logits [1 or T_j, V],
        normed [T_j, D]) is bit-identical to its :meth:`mtp_step` alone."""
        if not self.weights.mtp:
            raise ModelError("this model has no MTP head (num_nextn_predict_layers / weights)")
        if not (len(hiddens) == len(next_ids) == len(mtp_caches)) or not hiddens:
            raise ModelError("mtp_step_batch needs hidden rows, ids and a cache per sequence")
        ctx = ctx if ctx is not None else StepContext()
        mw = self.weights.mtp[0]
        c = self.config
        seqs: list[SeqState] = []
        ids_all: list[npt.NDArray[np.int64]] = []
        for hidden, ids_in, cache in zip(hiddens, next_ids, mtp_caches, strict=True):
            ids = np.asarray(ids_in, dtype=np.int64).reshape(-1)
            t = ids.shape[0]
            if t == 0 or hidden.shape != (t, c.hidden_size):
                raise ModelError(f"hidden {hidden.shape} does not match next_ids [{t}]")
            start = cache.length
            cos, sin = self.rope.cos_sin(np.arange(start, start + t))  # [T, R/2]
            cache.reserve(start + t)
            seqs.append(SeqState(cache, start, cos, sin))
            ids_all.append(ids)
        bounds = np.cumsum([0] + [ids.shape[0] for ids in ids_all])
        e = embed_rows(
            mw.embed if mw.embed is not None else self.weights.embed, np.concatenate(ids_all)
        )
        h_in = np.concatenate([np.asarray(h, dtype=np.float32) for h in hiddens])  # [N, D]
        eh = np.concatenate(
            [rms_norm(e, mw.enorm, c.rms_norm_eps), rms_norm(h_in, mw.hnorm, c.rms_norm_eps)],
            axis=-1,
        )  # [N, 2D]
        u = mw.eh_proj(eh)  # [N, D]
        n = c.num_hidden_layers
        us = [u[bounds[j] : bounds[j + 1]] for j in range(len(seqs))]
        hs, _ = self._attention_step(ctx, n, mw.layer, us, seqs, [None] * len(seqs), slot=0)
        out = self._mlp(ctx, n, mw.layer, np.concatenate(hs))  # [N, D]
        normed = rms_norm(out, mw.shared_head_norm, c.rms_norm_eps)  # [N, D]
        rows = normed[bounds[1:] - 1] if last_only else normed  # [n_seq or N, D]
        logits = ctx.compute.linear(mw.shared_head, np.ascontiguousarray(rows))
        res = []
        for j, (ids, seq) in enumerate(zip(ids_all, seqs, strict=True)):
            seq.cache.write_tokens(seq.start, ids)
            seq.cache.commit(seq.start + ids.shape[0])
            lo, hi = bounds[j], bounds[j + 1]
            res.append((logits[j : j + 1] if last_only else logits[lo:hi], normed[lo:hi]))
        return res

    # ------------------------------------------------------------------------------ layers

    def _attention_step(
        self,
        ctx: StepContext,
        layer: int,
        lw: Any,
        hs: list[F32Array],
        seqs: list[SeqState],
        sel: list[BoolArray | None],
        slot: int | None = None,
    ) -> tuple[list[F32Array], list[BoolArray | None]]:
        """Several decoding sequences (each a few rows, absorbed form): the norms, projections,
        W_UK / W_UV and ``o_proj`` run once over the rows of all of them (one small-T matmul
        per weight instead of one per sequence); only the latent attention and the sparse
        selection run per sequence. Rows are independent, so every row is bit-identical to its
        sequence run alone. Anything else (one sequence, long chunks, reconstruction): per
        sequence. A step that holds both (a prompt's chunk beside decode rows) takes its
        sequences in runs, in order: each run of short ones batched, each long one on its
        own with its rows split over the pool."""
        c, d = self.config, self.dims
        comp = ctx.compute
        rows = [h.shape[0] for h in hs]
        n = sum(rows)
        per_key = d.num_attention_heads * d.kv_lora_rank * 4
        long = [
            len(hs) >= 2 and comp.row_blocks(t, (seq.start + t) * per_key) is not None
            for t, seq in zip(rows, seqs, strict=True)
        ]
        if any(long) and not all(long):
            out_h: list[F32Array] = []
            out_s: list[BoolArray | None] = []
            j = 0
            while j < len(hs):
                k = j
                while k < len(hs) and long[k] == long[j]:
                    k += 1
                step = super()._attention_step if long[j] else self._attention_step
                got_h, got_s = step(ctx, layer, lw, hs[j:k], seqs[j:k], sel[j:k], slot)
                out_h += got_h
                out_s += got_s
                j = k
            return out_h, out_s
        absorbed = [
            mla.prefer_absorbed(d, t, seq.start + t)
            if ctx.attention_mode == "auto"
            else ctx.attention_mode == "absorbed"
            for t, seq in zip(rows, seqs, strict=True)
        ]
        if len(hs) < 2 or not all(absorbed) or comp.row_blocks(n, per_key) is not None:
            return super()._attention_step(ctx, layer, lw, hs, seqs, sel, slot)
        groups = comp.row_blocks(len(hs), self._attention_macs(lw, rows, seqs) // len(hs))
        if groups is not None and all(b - a >= 2 for a, b in groups):
            return self._attention_groups(ctx, layer, lw, hs, seqs, sel, slot, groups)
        at = layer if slot is None else slot
        h_all = np.concatenate(hs)  # [N, D]
        x_all = rms_norm(h_all, lw.input_layernorm, c.rms_norm_eps)  # [N, D]
        cos = np.concatenate([seq.cos for seq in seqs])
        sin = np.concatenate([seq.sin for seq in seqs])
        proj_all = self._project(ctx, lw, x_all, cos, sin)
        q_lat_all = mla.absorb_queries(lw.attn, d, proj_all.q_nope)  # [N, NH, C]
        bounds = np.cumsum([0, *rows])
        ends = [seq.start + t for seq, t in zip(seqs, rows, strict=True)]
        pre = self._selection_rows(layer, lw, x_all, proj_all, cos, sin, ends)
        # every sequence's new KV rows in one call (the step reserved them), then the sparse
        # selections: no Python per sequence where no sequence scores its keys
        KVCache.write_seqs(
            [seq.cache for seq in seqs], at, [seq.start for seq in seqs], bounds,
            proj_all.latent, proj_all.k_rope,
        )  # fmt: skip
        new_sel = self._selections(ctx, layer, at, lw, x_all, proj_all, seqs, sel, bounds, pre)
        # every sequence's rows over its own keys (its cache's rows, where they are: written
        # above, so no cache grows before the call) in one kernel call (the kernel bounds each
        # row by its causal keys: a mask only for a sparse selection)
        o_lat = mla.latent_attention_cached(
            q_lat_all, proj_all.q_rope, [seq.cache.addresses(at) for seq in seqs], ends, rows,
            new_sel, self.softmax_scale,
        )  # [N, NH, C]  # fmt: skip
        out = mla.out_proj(lw.attn, mla.unabsorb_values(lw.attn, d, o_lat), comp.linear)
        y = h_all + out  # [N, D]
        return [y[bounds[j] : bounds[j + 1]] for j in range(len(seqs))], new_sel

    def _attention_macs(self, lw: LayerWeights, rows: list[int], seqs: list[SeqState]) -> int:
        """Multiply-adds of one batched absorbed attention step over these sequences: the
        projections and ``o_proj`` per row, W_UK / W_UV per row and head, the latent
        attention per row and key (what decides whether the sequences split over the pool)."""
        d, w = self.dims, lw.attn
        per_row = sum(
            lin.in_features * lin.out_features
            for lin in (w.q_a_proj, w.q_b_proj, w.q_proj, w.kv_a_proj_with_mqa, w.o_proj)
            if lin is not None
        )
        per_row += d.num_attention_heads * d.kv_lora_rank * (d.qk_nope_head_dim + d.v_head_dim)
        per_key = d.num_attention_heads * (2 * d.kv_lora_rank + d.qk_rope_head_dim)
        return sum(
            t * (per_row + (seq.start + t) * per_key) for t, seq in zip(rows, seqs, strict=True)
        )

    def _attention_groups(
        self,
        ctx: StepContext,
        layer: int,
        lw: LayerWeights,
        hs: list[F32Array],
        seqs: list[SeqState],
        sel: list[BoolArray | None],
        slot: int | None,
        groups: list[tuple[int, int]],
    ) -> tuple[list[F32Array], list[BoolArray | None]]:
        """The batched attention step with the sequences in ``groups``, one group per thread
        of the pool: each group is a batched step of its own (its rows through the
        projections as one small-T matmul, its sequences' latent attention in one call), so
        both cores work through the attention half instead of one with a few of its matmuls
        split. Rows are independent: every row is bit-identical to the step over all the
        sequences. Observations (DSA scores and selections) are made in the groups and passed
        on afterwards in sequence order, as the single step makes them."""
        seen: list[list[tuple[str, int, npt.NDArray[Any]]]] = [[] for _ in groups]

        def group(i: int) -> tuple[list[F32Array], list[BoolArray | None]]:
            a, b = groups[i]
            g = (
                ctx
                if ctx.observer is None
                else ctx.replace(observer=lambda ev, at, arr: seen[i].append((ev, at, arr)))
            )
            return self._attention_step(g, layer, lw, hs[a:b], seqs[a:b], sel[a:b], slot)

        parts = ctx.compute.map_rows(
            [(i, i + 1) for i in range(len(groups))], lambda i, _: group(i)
        )
        for got in seen:
            for ev, at, arr in got:
                ctx.observe(ev, at, arr)
        return [h for p in parts for h in p[0]], [s for p in parts for s in p[1]]

    def _attention(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: LayerWeights,
        h: F32Array,
        seq: SeqState,
        prev_selection: BoolArray | None,
    ) -> tuple[F32Array, BoolArray | None]:
        """Attention half of a layer over one sequence's cache: h + attn(norm(h)) [T, D] and the
        layer's sparse selection (None: dense)."""
        c, d = self.config, self.dims
        t = h.shape[0]
        s = seq.start + t
        x = rms_norm(h, lw.input_layernorm, c.rms_norm_eps)  # [T, D]
        proj = self._project(ctx, lw, x, seq.cos, seq.sin)
        seq.cache.write(slot, seq.start, proj.latent, proj.k_rope)
        selection = self._sparse_selection(ctx, layer, slot, lw, x, proj, seq, prev_selection)
        # None: every causal key (the kernels bound each row by its causal keys themselves,
        # so a mask is built only for a sparse selection)
        allowed = None if selection is None else mla.causal_mask(t, s) & selection  # [T, S]
        if ctx.attention_mode == "auto":
            absorbed = mla.prefer_absorbed(d, t, s)
        else:
            absorbed = ctx.attention_mode == "absorbed"
        latent, k_rope = seq.cache.latent(slot, s), seq.cache.k_rope(slot, s)
        comp = ctx.compute
        nh, c_lat, v = d.num_attention_heads, d.kv_lora_rank, d.v_head_dim
        # absorbed, per row: W_UK, W_UV and o_proj (counted twice: a prefill's blocks ran
        # them at about half the latent attention's multiply-adds per second), then per key
        # its score and weighted sum
        per_row = 2 * (nh * c_lat * (d.qk_nope_head_dim + v) + nh * v * c.hidden_size)
        causal = (s, per_row, nh * (2 * c_lat + d.qk_rope_head_dim)) if absorbed else None
        blocks = comp.row_blocks(t, s * nh * c_lat * 4, causal)
        if absorbed and blocks is not None:
            # Rows are independent in the absorbed form: blocks on the pool, bit-identical.
            def rows(a: int, b: int) -> F32Array:
                part = mla.MLAProjection(
                    *(None if v is None else v[a:b] for v in proj)  # type: ignore[arg-type]
                )
                return mla.attend(
                    lw.attn, d, part, latent, k_rope, None if allowed is None else allowed[a:b],
                    self.softmax_scale, True, rows_after=t - b, mm=comp.linear,
                )  # fmt: skip

            out = np.concatenate(comp.map_rows(blocks, rows))
        else:
            out = mla.attend(
                lw.attn, d, proj, latent, k_rope, allowed, self.softmax_scale, absorbed,
                mm=comp.linear, heads=comp.mla_heads,
            )  # fmt: skip
        return h + out, selection  # [T, D]

    def _project(
        self, ctx: StepContext, lw: LayerWeights, x: F32Array, cos: F32Array, sin: F32Array
    ) -> Any:
        """:func:`mla.project`, rows split over the compute pool for a long chunk (every row
        is projected on its own: bit-identical)."""
        d, w, il = self.dims, lw.attn, self.rope.interleave
        per_row = sum(
            lin.in_features * lin.out_features
            for lin in (w.q_a_proj, w.q_b_proj, w.q_proj, w.kv_a_proj_with_mqa)
            if lin is not None
        )
        comp = ctx.compute
        blocks = comp.row_blocks(x.shape[0], per_row)
        if blocks is None:
            return mla.project(w, d, x, cos, sin, il, comp.linear, comp.linears, comp.lora)
        parts = comp.map_rows(
            blocks, lambda a, b: mla.project(w, d, x[a:b], cos[a:b], sin[a:b], il, comp.linear)
        )
        return mla.MLAProjection(
            *(  # type: ignore[arg-type]
                None if parts[0][k] is None else np.concatenate([p[k] for p in parts])
                for k in range(len(parts[0]))
            )
        )

    def _selections(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: LayerWeights,
        x_all: F32Array,
        proj_all: mla.MLAProjection,
        seqs: list[SeqState],
        sel: list[BoolArray | None],
        bounds: npt.NDArray[np.int64],
        pre: SelectionRows | None,
    ) -> list[BoolArray | None]:
        """:meth:`_sparse_selection` of every sequence of a batched step, in order (sequence
        ``j``'s rows ``bounds[j] .. bounds[j + 1]`` of ``x_all`` / ``proj_all`` / ``pre``, its
        KV rows of this layer already written)."""
        reads = self._selection_reads_rows(layer)
        out: list[BoolArray | None] = []
        for j, seq in enumerate(seqs):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            proj = None
            if reads:  # only a layer that scores keys reads this sequence's projections
                proj = mla.MLAProjection(
                    *(None if v is None else v[lo:hi] for v in proj_all)  # type: ignore[arg-type]
                )
            part = None if pre is None else pre.part(lo, hi)
            x = x_all[lo:hi]
            out.append(
                self._sparse_selection(ctx, layer, slot, lw, x, proj, seq, sel[j], rows=part)
            )
        return out

    def _sparse_selection(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: LayerWeights,
        x: F32Array,
        proj: mla.MLAProjection | None,
        seq: SeqState,
        prev_selection: BoolArray | None,
        *,
        rows: SelectionRows | None = None,
    ) -> BoolArray | None:
        """Keys each new query may attend to beyond causality [T, S]; None = all (dense MLA).
        ``rows``: this sequence's part of :meth:`_selection_rows`, when made for a batch.
        ``proj``: the sequence's projections, given where :meth:`_selection_reads_rows`."""
        return None

    def _selection_reads_rows(self, layer: int) -> bool:
        """Whether :meth:`_sparse_selection` of ``layer`` reads the sequence's projections
        (a layer that scores keys; dense MLA: never)."""
        return False

    def _selection_rows(
        self,
        layer: int,
        lw: LayerWeights,
        x: F32Array,
        proj: mla.MLAProjection,
        cos: F32Array,
        sin: F32Array,
        ends: list[int],
    ) -> SelectionRows | None:
        """The per-row part of layer ``layer``'s sparse selection for the rows of several
        sequences at once (``ends``: each sequence's length after this step), or None when
        there is none to share (dense MLA: always)."""
        return None

"""The grouped-query-attention MoE stack (OLMoE, Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2).

Per layer: ``h += GQA(rms_norm(h))`` (:mod:`runtime.layers.gqa`: q/k norm of the family, partial
half-split RoPE, K/V per KV head in the cache) then ``h += MLP-or-MoE(rms_norm(h))``, the MoE half
being the one every stack shares (:class:`~runtime.models._decoder.DecoderStack`, expert tiers,
streaming and batching unchanged). A family file subclasses :class:`GQAMoEConfig` to state its
router (softmax or sigmoid top-k), its defaults and what it refuses.

The KV cache has ``layout="gqa"``: per layer and token the roped keys and the values of every
KV head. Attention is row by row over each row's causal keys, so a token's rows are bit-identical
alone, in a prefill chunk, in a verify block or in a batched step; ``--fast-prefill`` changes
nothing here (there is no second evaluation order).

Shape legend: T new tokens, S keys, D hidden, KV = num_key_value_heads * head_dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Self

import numpy as np
import numpy.typing as npt

from runtime.context import StepContext
from runtime.kv import KVCache
from runtime.layers import gqa
from runtime.layers.moe_router import RouterConfig
from runtime.layers.rms_norm import rms_norm
from runtime.layers.rope import Rope
from runtime.linear import Linear
from runtime.models._decoder import DecoderStack, MoEConfig, SeqState
from runtime.weights import (
    ContainerLike,
    ExpertSource,
    GQALayerWeights,
    ModelWeights,
    ResidentExperts,
    load_gqa_layer,
)
from storage.arch import ArchConfig, rotary_keys
from storage.errors import ModelError

__all__ = ["GQAMoEConfig", "GQAMoEModel"]

F32Array = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, kw_only=True)
class GQAMoEConfig(MoEConfig):
    """Config keys of the grouped-query MoE families (field name = config key where HF has
    one). Class variables are the family's fixed choices."""

    scoring: ClassVar[Literal["sigmoid", "softmax"]] = "softmax"
    norm_eps: ClassVar[float] = 0.0  # added to the top-k weight sum before normalising
    always_norm_topk: ClassVar[bool] = False  # Mixtral, MiniMax-M2: no norm_topk_prob key
    norm_topk_default: ClassVar[bool] = False  # when config.json omits norm_topk_prob
    scales_routed: ClassVar[bool] = False  # whether routed_scaling_factor applies

    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: Literal["none", "head", "full"] = "none"
    clip_qkv: float | None = None

    @classmethod
    def _parse(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        kw = super()._parse(cfg)
        arch: ArchConfig = kw["arch"]
        kw["norm_topk_prob"] = cls.always_norm_topk or bool(
            cfg.get("norm_topk_prob", cls.norm_topk_default)
        )
        if not cls.scales_routed:
            kw["routed_scaling_factor"] = 1.0
        rope = kw["rope_parameters"]
        rot = rotary_keys(cfg)  # sliding window refused, rotary width checked (storage.arch)
        partial, rotary = rot["partial_rotary_factor"], rot["rotary_dim"]
        clip = cfg.get("clip_qkv")
        kw.update(
            rope_parameters=replace(rope, partial_rotary_factor=partial),
            num_key_value_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            rotary_dim=rotary,
            qk_norm=arch.qk_norm,
            clip_qkv=None if clip is None else float(clip),
        )
        return kw

    @property
    def router(self) -> RouterConfig:
        return replace(super().router, scoring=self.scoring, norm_eps=self.norm_eps)

    @property
    def dims(self) -> gqa.GQADims:
        return gqa.GQADims(
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rotary_dim=self.rotary_dim,
            qk_norm=self.qk_norm,
            rms_norm_eps=self.rms_norm_eps,
            clip_qkv=self.clip_qkv,
        )


class GQAMoEModel(DecoderStack):
    """A grouped-query MoE decoder over stored weights. Build with :meth:`from_container`."""

    config_class: ClassVar[type[GQAMoEConfig]] = GQAMoEConfig
    config: GQAMoEConfig

    def __init__(self, config: GQAMoEConfig, weights: ModelWeights, experts: ExpertSource) -> None:
        super().__init__(config, weights, experts)
        self.dims = config.dims
        self.rope = Rope(
            config.rope_parameters, config.rotary_dim, config.max_position_embeddings, False
        )

    @classmethod
    def from_container(cls, container: ContainerLike, experts: ExpertSource | None = None) -> Self:
        """Load the resident weights; experts default to :class:`ResidentExperts`."""
        config = cls.config_class.from_dict(container.config)
        family, router = config.arch.family, config.router
        layers = [
            load_gqa_layer(container, i, family, router, moe=config.is_moe_layer(i))
            for i in range(config.num_hidden_layers)
        ]
        head = "lm_head.weight"
        if not container.has(head):
            if not container.config.get("tie_word_embeddings"):
                raise ModelError(
                    "the container has no lm_head.weight (and tie_word_embeddings is not set)"
                )
            head = "model.embed_tokens.weight"
        weights = ModelWeights(
            embed=container.load_qtensor("model.embed_tokens.weight"),
            norm=container.load_f32("model.norm.weight"),
            lm_head=Linear(container.load_qtensor(head)),
            layers=layers,
            mtp=[],
        )
        return cls(config, weights, experts if experts is not None else ResidentExperts(container))

    def new_cache(self) -> KVCache:
        """An empty K/V cache for the main layers."""
        kv = self.dims.kv_width
        return KVCache(self.config.num_hidden_layers, kv, kv, layout="gqa")

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
        """Several decoding sequences: norms, q/k/v projections and ``o_proj`` once over all
        their rows (one small-T matmul per weight), the attention per sequence over its own
        cache; every row bit-identical to its sequence alone. Otherwise per sequence."""
        if not isinstance(lw, GQALayerWeights):
            raise ModelError(f"layer {layer} holds no grouped-query attention weights")
        d, w, comp = self.dims, lw.attn, ctx.compute
        rows = [h.shape[0] for h in hs]
        n = sum(rows)
        per_row = sum(lin.in_features * lin.out_features for lin in (w.q_proj, w.k_proj, w.v_proj))
        if len(hs) < 2 or comp.row_blocks(n, per_row) is not None:
            return super()._attention_step(ctx, layer, lw, hs, seqs, sel, slot)
        at = layer if slot is None else slot
        h_all = np.concatenate(hs)  # [N, D]
        x_all = rms_norm(h_all, lw.input_layernorm, self.config.rms_norm_eps)  # [N, D]
        cos = np.concatenate([seq.cos for seq in seqs])
        sin = np.concatenate([seq.sin for seq in seqs])
        q, k, v = gqa.project(w, d, x_all, cos, sin, comp.linear)
        heads = np.empty((n, d.num_attention_heads * d.head_dim), dtype=np.float32)
        bounds = np.cumsum([0, *rows])
        for j, seq in enumerate(seqs):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            s = seq.start + hi - lo
            seq.cache.write(at, seq.start, k[lo:hi], v[lo:hi])
            keys, values = seq.cache.keys(at, s), seq.cache.values(at, s)
            heads[lo:hi] = gqa.attend_heads(d, q[lo:hi], keys, values)
        y = h_all + gqa.out_proj(w, heads, comp.linear)  # [N, D]
        return [y[bounds[j] : bounds[j + 1]] for j in range(len(seqs))], [None] * len(seqs)

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
        if not isinstance(lw, GQALayerWeights):
            raise ModelError(f"layer {layer} holds no grouped-query attention weights")
        d, w = self.dims, lw.attn
        t = h.shape[0]
        s = seq.start + t
        x = rms_norm(h, lw.input_layernorm, self.config.rms_norm_eps)  # [T, D]
        comp = ctx.compute
        per_row = sum(lin.in_features * lin.out_features for lin in (w.q_proj, w.k_proj, w.v_proj))
        blocks = comp.row_blocks(t, per_row)
        if blocks is None:
            q, k, v = gqa.project(w, d, x, seq.cos, seq.sin, comp.linear)
        else:  # every row is projected on its own: bit-identical in blocks
            parts = comp.map_rows(
                blocks,
                lambda a, b: gqa.project(w, d, x[a:b], seq.cos[a:b], seq.sin[a:b], comp.linear),
            )
            q, k, v = (np.concatenate([p[n] for p in parts]) for n in range(3))
        seq.cache.write(slot, seq.start, k, v)
        keys, values = seq.cache.keys(slot, s), seq.cache.values(slot, s)
        per_key = d.num_attention_heads * d.head_dim * 2  # a score and a weighted value
        o_macs = w.o_proj.in_features * w.o_proj.out_features
        blocks = comp.row_blocks(t, s * per_key, (s, o_macs, per_key))
        if blocks is None:
            out = gqa.attend(w, d, q, keys, values, mm=comp.linear)
        else:
            out = np.concatenate(
                comp.map_rows(
                    blocks,
                    lambda a, b: gqa.attend(
                        w, d, q[a:b], keys, values, rows_after=t - b, mm=comp.linear
                    ),
                )
            )
        return h + out, None  # [T, D]

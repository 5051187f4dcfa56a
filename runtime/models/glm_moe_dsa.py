"""GLM-5 (``model_type: glm_moe_dsa``): MLA + DSA lightning indexer + MoE (+ MTP head).

Differences from the shared stack:

* ``mlp_layer_types[L]`` ("dense" / "sparse") decides dense MLP vs MoE;
* rope pairs are always interleaved (main attention and indexer);
* DSA: a ``"full"`` layer (``indexer_types``) scores every key with its lightning indexer and
  lets each query attend only to its ``index_topk`` best keys (on top of causality); a
  ``"shared"`` layer reuses the selection of the nearest earlier full layer of the same
  forward. With ``index_topk >= S`` the selection is a no-op and is skipped (index keys are
  still cached for later, longer steps). MTP layers (index >= num_hidden_layers) are full.
* containers without indexer weights (the public int4 one ships them separately) still run
  sequences up to ``index_topk`` tokens, where DSA changes nothing; longer ones are an error.
  The MTP layer's indexer is optional (the public converter never writes it): without it the
  MTP layer attends densely at any length, as the C engine does. That changes drafts only.

Shape legend: T new tokens, S keys (cache + new), D hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from runtime.context import StepContext
from runtime.kv import KVCache
from runtime.layers import dsa_indexer as dsa
from runtime.layers.mla import MLAProjection
from runtime.models._decoder import MLAMoEConfig, MLAMoEModel, SelectionRows, SeqState
from runtime.weights import ContainerLike, ExpertSource, LayerWeights, ModelWeights
from storage.arch import ArchConfig
from storage.errors import ConfigError, ModelError

__all__ = ["GlmMoeDsa", "GlmMoeDsaConfig"]

F32Array = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaConfig(MLAMoEConfig):
    """GLM-5 config keys (field name = HF config key)."""

    indexer_interleave: ClassVar[bool] = True  # rope pairing of the indexer (GLM: interleaved)

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]

    @classmethod
    def _parse(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        kw = super()._parse(cfg)
        arch: ArchConfig = kw["arch"]
        try:
            kw["index_topk"] = int(cfg.get("index_topk") or 2048)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json: index_topk has a bad value ({exc})") from exc
        kw["index_head_dim"] = arch.index_head_dim
        kw["index_n_heads"] = arch.index_n_heads
        kw["indexer_types"] = arch.indexer_types
        kw["mlp_layer_types"] = arch.mlp_layer_types
        return kw

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.q_lora_rank is None:
            raise ConfigError(
                f"config.json: {self.model_type} needs q_lora_rank (the indexer reads it)"
            )
        bad = set(self.indexer_types) - {"full", "shared"}
        if bad:
            raise ConfigError(f"config.json: unknown indexer_types {sorted(bad)}")
        if self.indexer_types and self.indexer_types[0] == "shared":
            raise ConfigError(
                "config.json: indexer_types[0] is 'shared' but no earlier layer is full"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError("config.json: index_head_dim is smaller than qk_rope_head_dim")

    def runs_indexer(self, layer: int) -> bool:
        """ "full" layers (and MTP layers, beyond the list) run their own indexer."""
        return self.arch.has_indexer(layer)

    @property
    def indexer_dims(self) -> dsa.IndexerDims:
        return dsa.IndexerDims(
            index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            index_topk=self.index_topk,
            qk_rope_head_dim=self.qk_rope_head_dim,
            interleave=self.indexer_interleave,
        )


class GlmMoeDsa(MLAMoEModel):
    """GLM-5 decoder with DeepSeek sparse attention."""

    config_class: ClassVar[type[MLAMoEConfig]] = GlmMoeDsaConfig
    config: GlmMoeDsaConfig

    def __init__(self, config: MLAMoEConfig, weights: ModelWeights, experts: ExpertSource) -> None:
        if not isinstance(config, GlmMoeDsaConfig):
            raise ModelError("GlmMoeDsa needs a GlmMoeDsaConfig")
        super().__init__(config, weights, experts)
        self.indexer_dims = config.indexer_dims

    @classmethod
    def _loads_indexer(cls, config: MLAMoEConfig, container: ContainerLike, layer: int) -> bool:
        if not isinstance(config, GlmMoeDsaConfig) or not config.runs_indexer(layer):
            return False
        return container.has(f"model.layers.{layer}.self_attn.indexer.wq_b.weight")

    def _caches_index_keys(self, layer: int) -> bool:
        if layer >= self.config.num_hidden_layers:
            return self._mtp_has_indexer()
        return self.config.runs_indexer(layer)

    def _mtp_has_indexer(self) -> bool:
        """The public container has no MTP indexer: the MTP layer then attends densely."""
        return bool(self.weights.mtp) and self.weights.mtp[0].layer.indexer is not None

    @property
    def _index_head_dim(self) -> int:
        return self.config.index_head_dim

    def _selection_rows(
        self,
        layer: int,
        lw: LayerWeights,
        x: F32Array,
        proj: MLAProjection,
        cos: F32Array,
        sin: F32Array,
        ends: list[int],
    ) -> SelectionRows | None:
        """Index keys for every row (and queries when some sequence scores) in one projection
        each, for a layer that runs the indexer."""
        if not self.config.runs_indexer(layer) or lw.indexer is None or proj.q_resid is None:
            return None
        dims = self.indexer_dims
        keys = dsa.index_keys(lw.indexer, dims, x, cos, sin)  # [N, DI]
        queries = None
        if max(ends) > dims.index_topk:
            queries = dsa.index_queries(lw.indexer, dims, x, proj.q_resid, cos, sin)
        return SelectionRows(keys, queries)

    def _selection_reads_rows(self, layer: int) -> bool:
        return self.config.runs_indexer(layer)

    def _sparse_selection(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: LayerWeights,
        x: F32Array,
        proj: MLAProjection | None,
        seq: SeqState,
        prev_selection: BoolArray | None,
        *,
        rows: SelectionRows | None = None,
    ) -> BoolArray | None:
        if not self.config.runs_indexer(layer):
            return prev_selection  # "shared": the previous full layer's keys
        assert proj is not None  # given where _selection_reads_rows
        cache, start, cos, sin = seq
        t = x.shape[0]
        s = start + t
        topk = self.indexer_dims.index_topk
        if lw.indexer is None:
            if layer >= self.config.num_hidden_layers:
                # MTP layer without indexer weights (the public converter writes none): dense,
                # as the C engine runs it. Only drafts change; the main layers verify them.
                return None
            if s > topk:
                raise ModelError(
                    f"layer {layer}: the sequence has {s} tokens, more than index_topk={topk}, "
                    "and this container has no DSA indexer weights (add the indexer shards)"
                )
            return None
        if proj.q_resid is None:
            raise ModelError("the DSA indexer needs the MLA query residual (q_lora_rank)")
        if rows is not None:
            keys = rows.keys
        else:
            keys = dsa.index_keys(lw.indexer, self.indexer_dims, x, cos, sin)  # [T, DI]
        cache.write_index(slot, start, keys)
        if s <= topk:
            return None  # every key is selected: skip scoring
        return self._scored(ctx, layer, slot, lw, x, proj.q_resid, seq, rows)

    def _scored(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: LayerWeights,
        x: F32Array,
        q_resid: F32Array,
        seq: SeqState,
        rows: SelectionRows | None,
    ) -> BoolArray | None:
        """The top-k selection of ``seq``'s new rows over its index keys (written, more than
        ``index_topk`` of them), observed as ``dsa_scores`` / ``dsa_select``."""
        assert lw.indexer is not None
        cache, start, cos, sin = seq
        s = start + x.shape[0]
        scores = dsa.index_scores(
            lw.indexer, self.indexer_dims, x, q_resid, cache.index_keys(slot, s), cos, sin,
            queries=None if rows is None else rows.queries,
        )  # [T, S]  # fmt: skip
        selection = dsa.select(scores, self.indexer_dims.index_topk)  # [T, S]
        ctx.observe("dsa_scores", layer, scores)
        if selection is not None:
            ctx.observe("dsa_select", layer, selection)
        return selection

    def _selections(
        self,
        ctx: StepContext,
        layer: int,
        slot: int,
        lw: LayerWeights,
        x_all: F32Array,
        proj_all: MLAProjection,
        seqs: list[SeqState],
        sel: list[BoolArray | None],
        bounds: npt.NDArray[np.int64],
        pre: SelectionRows | None,
    ) -> list[BoolArray | None]:
        """A shared layer takes each sequence's previous selection; a layer that runs its
        indexer writes every sequence's index keys in one call and scores only the sequences
        with more than ``index_topk`` keys, each as :meth:`_sparse_selection` does (the same
        bits, the same observations in sequence order). Anything else (no indexer weights, no
        query residual): :meth:`_sparse_selection` per sequence, with its errors."""
        if not self.config.runs_indexer(layer):
            return list(sel)  # "shared": the previous full layer's keys
        if lw.indexer is None or pre is None or proj_all.q_resid is None:
            return super()._selections(
                ctx, layer, slot, lw, x_all, proj_all, seqs, sel, bounds, pre
            )
        KVCache.write_index_seqs(
            [seq.cache for seq in seqs], slot, [seq.start for seq in seqs], bounds, pre.keys
        )
        topk = self.indexer_dims.index_topk
        out: list[BoolArray | None] = []
        for j, seq in enumerate(seqs):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            if seq.start + hi - lo <= topk:
                out.append(None)  # every key is selected: skip scoring
                continue
            x, q_resid = x_all[lo:hi], proj_all.q_resid[lo:hi]
            out.append(self._scored(ctx, layer, slot, lw, x, q_resid, seq, pre.part(lo, hi)))
        return out

"""Per-architecture tensor naming: one table that maps a Hugging Face tensor name to its role
(which precision policy applies) and its logical [out, in] shape from config.json.

HF names are kept verbatim on disk; this is the only place that knows them. Each supported
``model_type`` has one :class:`Family` row (:data:`FAMILIES`): its attention kind (MLA: GLM-5,
DeepSeek-V3; grouped-query attention: OLMoE, Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2), the module
name of its MoE block, the on-disk names of an expert's gate/up/down matrices, where its router
correction bias lives and which config key sizes its experts. Roles carry the canonical projection
names (``gate_proj``/``up_proj``/``down_proj``) whatever the family calls them on disk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from storage.errors import ConfigError

__all__ = [
    "FAMILIES",
    "INDEXER_TENSORS",
    "SUPPORTED_MODEL_TYPES",
    "ArchConfig",
    "Family",
    "Role",
    "TensorRole",
    "classify",
    "default_indexer_types",
    "expected_tensors",
    "optional_tensors",
    "rotary_keys",
    "with_family_defaults",
]

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # canonical order: gate, up, down


@dataclass(frozen=True, slots=True)
class Family:
    """How one HF ``model_type`` names and shapes its tensors (one row per architecture)."""

    model_type: str
    attention: Literal["mla", "gqa"]
    moe_prefix: str = "mlp"  # module of the MoE block: mlp.gate, mlp.experts.E.*
    expert_names: tuple[str, str, str] = EXPERT_PROJS  # on-disk names of gate, up, down
    bias: str | None = "mlp.gate.e_score_correction_bias"  # router correction bias (per layer)
    expert_size_key: str = "moe_intermediate_size"  # config key sizing one routed expert
    qk_norm: Literal["none", "head", "full", "config"] = "none"  # config: use_qk_norm -> head
    dsa: bool = False  # DeepSeek sparse attention: a lightning indexer per "full" layer
    # The attention projections (after ``self_attn.``) that carry a bias when config.json's
    # attention_bias is true, as transformers builds them; any other projection bias is an
    # unknown tensor (kept, never applied: transformers ignores it too)
    attn_biases: tuple[str, ...] = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
    # What transformers' config class takes for a key config.json leaves out (the keys that
    # change the math and that colibri would otherwise default alike for every family).
    defaults: tuple[tuple[str, Any], ...] = ()

    def expert_tensor(self, expert: int, proj: str) -> str:
        """Name (after ``model.layers.L.``) of one expert matrix; ``proj`` canonical."""
        on_disk = self.expert_names[EXPERT_PROJS.index(proj)]
        return f"{self.moe_prefix}.experts.{expert}.{on_disk}.weight"

    @property
    def router(self) -> str:
        return f"{self.moe_prefix}.gate.weight"


_W123 = ("w1", "w3", "w2")  # Mixtral's gate, up, down
_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# transformers 5's config-class defaults (DeepseekV3Config, DeepseekV32Config, GlmMoeDsaConfig,
# Glm4MoeConfig, OlmoeConfig, Qwen3MoeConfig, MixtralConfig, MiniMaxM2Config); Kimi K2 ships
# DeepSeek-V3's config class as remote code.
_DSV3_DEFAULTS = (
    ("rms_norm_eps", 1e-6),
    ("routed_scaling_factor", 2.5),
    ("n_group", 8),
    ("topk_group", 4),
    ("n_shared_experts", 1),
    ("first_k_dense_replace", 3),
    ("q_lora_rank", 1536),
    ("norm_topk_prob", True),
    ("rope_theta", 10000.0),
    ("max_position_embeddings", 4096),  # last: DeepSeek-V3.2 replaces it
)
FAMILIES: dict[str, Family] = {
    "glm_moe_dsa": Family("glm_moe_dsa", "mla", dsa=True, defaults=(
        ("rms_norm_eps", 1e-5), ("routed_scaling_factor", 2.5), ("n_group", 1),
        ("topk_group", 1), ("n_shared_experts", 1), ("first_k_dense_replace", 3),
        ("q_lora_rank", 2048), ("norm_topk_prob", True), ("max_position_embeddings", 202752),
        ("rope_theta", 10000.0))),
    "deepseek_v3": Family("deepseek_v3", "mla", defaults=_DSV3_DEFAULTS),
    # Kimi K2: the DeepSeek-V3 layout under its own name
    "kimi_k2": Family("kimi_k2", "mla", defaults=_DSV3_DEFAULTS),
    "deepseek_v32": Family("deepseek_v32", "mla", dsa=True, defaults=(
        *_DSV3_DEFAULTS[:-1], ("max_position_embeddings", 163840))),
    "olmoe": Family("olmoe", "gqa", bias=None, expert_size_key="intermediate_size",
                    qk_norm="full", attn_biases=_QKVO, defaults=(
                        ("rms_norm_eps", 1e-5), ("norm_topk_prob", False),
                        ("max_position_embeddings", 4096), ("rope_theta", 10000.0))),
    "qwen3_moe": Family("qwen3_moe", "gqa", bias=None, qk_norm="head", attn_biases=_QKVO,
                        defaults=(
        ("rms_norm_eps", 1e-6), ("norm_topk_prob", False), ("decoder_sparse_step", 1),
        ("max_position_embeddings", 32768), ("rope_theta", 10000.0))),
    "mixtral": Family("mixtral", "gqa", moe_prefix="block_sparse_moe", expert_names=_W123,
                      bias=None, expert_size_key="intermediate_size", attn_biases=(), defaults=(
                          ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072),
                          ("rope_theta", 1000000.0))),
    "glm4_moe": Family("glm4_moe", "gqa", qk_norm="config", attn_biases=_QKVO[:3], defaults=(
        ("rms_norm_eps", 1e-5), ("routed_scaling_factor", 1.0), ("n_group", 1),
        ("topk_group", 1), ("n_shared_experts", 1), ("first_k_dense_replace", 1),
        ("norm_topk_prob", True), ("use_qk_norm", False), ("max_position_embeddings", 131072),
        ("rope_theta", 10000.0))),
    "minimax_m2": Family("minimax_m2", "gqa", moe_prefix="block_sparse_moe", expert_names=_W123,
                         bias="block_sparse_moe.e_score_correction_bias",
                         expert_size_key="intermediate_size", qk_norm="full", attn_biases=(),
                         defaults=(
                             ("rms_norm_eps", 1e-6), ("max_position_embeddings", 196608),
                             ("rope_theta", 5000000.0))),
}  # fmt: skip


def with_family_defaults(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with the keys it leaves out filled as transformers' config class for its
    ``model_type`` fills them (:attr:`Family.defaults`): a config.json without
    ``routed_scaling_factor`` means 2.5 to DeepSeek-V3, not 1.0. Keys present (even null) are
    kept; an unknown model_type is returned as is (``ArchConfig.from_dict`` refuses it)."""
    fam = FAMILIES.get(str(cfg.get("model_type")))
    out = dict(cfg)
    if fam is not None:
        for key, val in fam.defaults:
            out.setdefault(key, val)
    return out


SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")

# expert: routed expert matrix; dense: resident matrices (attention, dense MLP, shared experts,
# indexer); io: embed_tokens / lm_head; mtp: matrices of the MTP layer(s); f32: norms, router,
# biases and everything 1-D (kept float32).
Role = Literal["expert", "dense", "io", "mtp", "f32"]

# The DSA lightning indexer of one layer (suffixes after ``model.layers.L.``).
INDEXER_TENSORS = (
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight",
)


def config_int(where: str, key: str, value: object, minimum: int = 0) -> int:
    """``value`` of config key ``key`` as an int >= ``minimum``: an int, or a float with an
    integral value (never a bool, a string or 32.5); a :class:`ConfigError` naming the key
    otherwise."""
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    n = int(value)
    if n < minimum:
        raise ConfigError(f"{where}: {key} must be >= {minimum}, got {n}")
    return n


def config_float(where: str, key: str, value: object, *, positive: bool = True) -> float:
    """``value`` of config key ``key`` as a finite float (> 0 with ``positive``): a
    :class:`ConfigError` naming the key for a string, a bool, NaN or an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ConfigError(f"{where}: {key} must be a finite{' positive' if positive else ''} "
                          f"number, got {value!r}")  # fmt: skip
    return x


#: the MLP activations the runtime implements
SUPPORTED_HIDDEN_ACTS = ("silu",)


def math_keys(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The config keys only the model math reads (defaults where absent), checked: what the
    runtime's model configs are built from and what ``coli doctor`` checks, so a config that
    would not run does not pass the doctor. Keys left out take the family's defaults
    (:func:`with_family_defaults`)."""
    cfg = with_family_defaults(cfg)

    def opt(key: str, default: Any) -> Any:
        val = cfg.get(key)
        return default if val is None else val

    norm_topk = opt("norm_topk_prob", True)
    if not isinstance(norm_topk, bool):
        raise ConfigError(f"{where}: norm_topk_prob must be true or false, got {norm_topk!r}")
    act = opt("hidden_act", "silu")
    if act not in SUPPORTED_HIDDEN_ACTS:
        raise ConfigError(
            f"{where}: hidden_act {act!r} is not supported "
            f"(only {', '.join(SUPPORTED_HIDDEN_ACTS)})"
        )
    return {
        "norm_topk_prob": norm_topk,
        "routed_scaling_factor": config_float(
            where, "routed_scaling_factor", opt("routed_scaling_factor", 1.0)
        ),
        "rms_norm_eps": config_float(where, "rms_norm_eps", opt("rms_norm_eps", 1e-6)),
        "max_position_embeddings": config_int(
            where, "max_position_embeddings", opt("max_position_embeddings", 4096), 1
        ),
        "hidden_act": str(act),
    }


# GQA families whose sliding_window is on only when this key is true (the others: when set)
_SLIDING_SWITCH = {"qwen3_moe": "use_sliding_window"}
# GQA families whose rotary width, when config.json does not say, is a share of head_dim
_DEFAULT_PARTIAL_ROTARY = {"glm4_moe": 0.5}


def rotary_keys(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """How the attention applies rope, checked against what the runtime computes: a
    grouped-query family's rotary width (``partial_rotary_factor``, else MiniMax-M2's
    ``rotary_dim``, else the family's share of ``head_dim``: even and within it) and no
    sliding window; an MLA family's full-width rope. What the runtime's model config uses,
    ``coli doctor`` checks and ``coli convert`` refuses before converting."""
    cfg = with_family_defaults(cfg)
    arch = ArchConfig.from_dict(cfg, where)
    partial = rope_keys(cfg, where)["partial_rotary_factor"]
    if arch.family.attention == "mla":
        if partial not in (None, 1.0):
            raise ConfigError(f"{where}: partial_rotary_factor != 1 is not supported for MLA")
        return {"partial_rotary_factor": partial, "rotary_dim": None}
    switch = _SLIDING_SWITCH.get(arch.model_type)
    window = cfg.get("sliding_window")
    if window is not None and (switch is None or cfg.get(switch)):
        ctx = cfg.get("max_position_embeddings")

        def number(x: Any) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool)

        # a window as long as the context never cuts a key: full attention, as transformers
        # computes it (some Mistral-derived MoE configs carry one)
        if not (number(window) and number(ctx) and window >= ctx):
            why = (
                f"shorter than the {ctx}-token context"
                if number(window) and number(ctx)
                else "not a number of tokens"
                if not number(window)
                else "with no context length to compare it with"
                if ctx is None
                else f"and max_position_embeddings {ctx!r} is not a number"
            )
            raise ConfigError(
                f"{where}: sliding-window attention (sliding_window {window!r}, {why}) is not "
                "supported"
            )
    if partial is None:  # config.json does not say: the legacy key, else the family's
        rotary_dim = cfg.get("rotary_dim")  # MiniMax-M2's released checkpoints
        partial = (
            config_int(where, "rotary_dim", rotary_dim, 1) / arch.head_dim
            if rotary_dim is not None
            else _DEFAULT_PARTIAL_ROTARY.get(arch.model_type, 1.0)
        )
    rotary = int(arch.head_dim * partial)
    if rotary <= 0 or rotary % 2 or rotary > arch.head_dim:
        raise ConfigError(
            f"{where}: rotary dims {rotary} (head_dim {arch.head_dim} x partial rotary factor "
            f"{partial}) must be even and within head_dim"
        )
    return {"partial_rotary_factor": partial, "rotary_dim": rotary}


def rope_keys(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``, normalised
    and checked: the fields of ``runtime.layers.rope.RopeParameters``. Without a rope_theta
    anywhere, the family's (:func:`with_family_defaults`)."""
    cfg = with_family_defaults(cfg)
    raw = cfg.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {raw!r}")
    params: dict[str, Any] = dict(raw)
    if not params:
        scaling = cfg.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
        params = dict(scaling)
        if "rope_theta" not in params and cfg.get("rope_theta") is not None:
            params["rope_theta"] = cfg["rope_theta"]
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if params.get("rope_theta") is None:
        raise ConfigError(f"{where}: no rope_theta in rope_parameters or at top level")
    if rope_type not in ("default", "yarn", "linear"):
        raise ConfigError(
            f"{where}: rope_type {rope_type!r} is not supported (default, linear, yarn)"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    orig = params.get("original_max_position_embeddings")
    if orig is None and rope_type == "yarn":
        # transformers' standardize_rope_params falls back to max_position_embeddings.
        orig = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))

    def opt(key: str) -> float | None:
        val = params.get(key)
        return None if val is None else config_float(where, key, val, positive=False)

    return {
        "rope_type": rope_type,
        "rope_theta": config_float(where, "rope_theta", params["rope_theta"]),
        "factor": opt("factor"),
        "original_max_position_embeddings": (
            None if orig is None else config_int(where, "original_max_position_embeddings", orig, 1)
        ),
        "beta_fast": opt("beta_fast"),
        "beta_slow": opt("beta_slow"),
        "mscale": opt("mscale"),
        "mscale_all_dim": opt("mscale_all_dim"),
        "attention_factor": opt("attention_factor"),
        "truncate": bool(params.get("truncate", True)),
        "partial_rotary_factor": (
            None if partial is None else config_float(where, "partial_rotary_factor", partial)
        ),
    }


def check_router(
    n_routed_experts: int, n_group: int, topk_group: int, num_experts_per_tok: int
) -> None:
    """The routing keys must describe a router that can run (one rule for every reader of
    config.json: ``coli doctor``, the converter and the runtime)."""
    if n_routed_experts <= 0:
        return  # a dense model: nothing is routed
    if not 1 <= num_experts_per_tok <= n_routed_experts:
        raise ConfigError(
            f"config.json: num_experts_per_tok {num_experts_per_tok} outside 1..n_routed_experts "
            f"({n_routed_experts})"
        )
    if n_group < 1 or n_routed_experts % n_group:
        raise ConfigError(
            f"config.json: n_routed_experts {n_routed_experts} is not divisible into "
            f"n_group {n_group} groups"
        )
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"config.json: topk_group {topk_group} outside 1..n_group")
    if num_experts_per_tok > topk_group * (n_routed_experts // n_group):
        raise ConfigError(
            "config.json: num_experts_per_tok exceeds the experts in topk_group groups"
        )


def default_indexer_types(cfg: Mapping[str, Any], n_layers: int) -> list[str]:
    """``indexer_types`` for a GLM-5 config that does not list them, by transformers' rule:
    ``index_topk_pattern`` ("FSSF..." or a list), else every ``index_topk_freq``-th layer from
    ``index_skip_topk_offset`` on is "full" and the rest "shared" (freq 1: every layer full).

    This is the one place the rule lives; the storage checks and the runtime both use it."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            try:
                return [{"F": "full", "S": "shared"}[ch] for ch in pattern]
            except KeyError as exc:
                raise ConfigError(
                    f"config.json: index_topk_pattern {pattern!r} may hold only F and S"
                ) from exc
        if not isinstance(pattern, list):
            raise ConfigError("config.json: index_topk_pattern must be a string or a list")
        return [str(p) for p in pattern]
    try:
        freq = max(int(cfg.get("index_topk_freq") or 1), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: a DSA key has a bad value ({exc})") from exc
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


def _default_mlp_types(
    model_type: str, cfg: Mapping[str, Any], n_layers: int, first_dense: int, n_routed: int
) -> list[str]:
    """Dense or sparse per layer when config.json has no ``mlp_layer_types``: Qwen3-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step`` rule, else the first
    ``first_k_dense_replace`` layers dense."""
    if model_type == "qwen3_moe":
        only = {int(i) for i in cfg.get("mlp_only_layers") or []}
        step = int(cfg.get("decoder_sparse_step") or 1)
        return [
            "sparse" if i not in only and n_routed > 0 and (i + 1) % step == 0 else "dense"
            for i in range(n_layers)
        ]
    return ["dense" if i < first_dense else "sparse" for i in range(n_layers)]


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """The config.json keys the storage layer needs (a typed view, validated once).

    MLA keys (``kv_lora_rank`` ...) are 0 for grouped-query families; ``num_key_value_heads``
    and ``head_dim`` are what those use. ``moe_intermediate_size`` is one routed expert's width
    whichever key the family sizes it with."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_mtp_layers: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int | None  # None: absent (the runtime needs it; doctor says so)
    n_group: int
    topk_group: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]
    num_key_value_heads: int = 0
    head_dim: int = 0
    qk_norm: Literal["none", "head", "full"] = "none"
    attention_biases: frozenset[str] = frozenset()  # see attention_biases()

    @staticmethod
    def from_dict(cfg: Mapping[str, Any], where: str = "config.json") -> ArchConfig:
        """The structure of ``cfg``, checked; keys left out take the family's defaults
        (:func:`with_family_defaults`)."""
        cfg = with_family_defaults(cfg)

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"{where}: missing required key {key!r}")
            return cfg[key]

        def need_int(key: str, minimum: int = 1) -> int:
            return config_int(where, key, need(key), minimum)

        def opt_int(key: str, default: int, minimum: int = 0) -> int:
            val = cfg.get(key)
            return default if val is None else config_int(where, key, val, minimum)

        mt = str(need("model_type"))
        fam = FAMILIES.get(mt)
        if fam is None:
            raise ConfigError(
                f"{where}: model_type {mt!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        mla = fam.attention == "mla"
        n_layers = need_int("num_hidden_layers")
        first_dense = opt_int("first_k_dense_replace", 0)
        count_key = next((k for k in _EXPERT_COUNT_KEYS if cfg.get(k) is not None), None)
        if count_key is None:  # (named the DeepSeek key to a Mixtral config)
            raise ConfigError(
                f"{where}: missing the routed expert count (one of {', '.join(_EXPERT_COUNT_KEYS)})"
            )
        n_routed = config_int(where, count_key, cfg[count_key], 0)
        try:
            mlp_types = cfg.get("mlp_layer_types") or _default_mlp_types(
                mt, cfg, n_layers, first_dense, n_routed
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: a key that places the MoE layers is bad ({exc})") from exc
        # A short or non-list mlp_layer_types would surface later as an IndexError deep in
        # classify(); reject it here with the key named.
        if (
            not isinstance(mlp_types, list)
            or len(mlp_types) != n_layers
            or any(t not in ("dense", "sparse") for t in mlp_types)
        ):
            raise ConfigError(
                f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                f"{n_layers} layers, got {mlp_types!r}"
            )
        top_k_raw = cfg.get("num_experts_per_tok")
        top_k = None if top_k_raw is None else config_int(where, "num_experts_per_tok", top_k_raw)
        n_group = opt_int("n_group", 1, 1) if cfg.get("n_group") else 1
        topk_group = opt_int("topk_group", 1, 1) if cfg.get("topk_group") else 1
        if top_k is not None:
            check_router(n_routed, n_group, topk_group, top_k)
        is_dsa = fam.dsa
        idx_types = cfg.get("indexer_types") or (
            # DeepSeek-V3.2: every layer runs its own indexer
            ["full"] * n_layers
            if mt == "deepseek_v32"
            else default_indexer_types(cfg, n_layers)
            if is_dsa
            else []
        )
        if not isinstance(idx_types, list):
            raise ConfigError(f"{where}: indexer_types must be a list, got {idx_types!r}")
        n_heads = need_int("num_attention_heads")
        hidden = need_int("hidden_size")
        qk_norm = fam.qk_norm
        if qk_norm == "config":
            qk_norm = "head" if cfg.get("use_qk_norm") else "none"
        gqa: dict[str, Any] = {}
        if not mla:
            head_dim = opt_int("head_dim", 0) or hidden // n_heads
            n_kv = opt_int("num_key_value_heads", 0) or n_heads
            if head_dim <= 0 or n_kv <= 0 or n_heads % n_kv:
                raise ConfigError(
                    f"{where}: num_attention_heads {n_heads} is not a multiple of "
                    f"num_key_value_heads {n_kv} (or head_dim {head_dim} is not positive)"
                )
            gqa = dict(num_key_value_heads=n_kv, head_dim=head_dim, qk_norm=qk_norm)
        q_lora = cfg.get("q_lora_rank")
        return ArchConfig(
            model_type=mt,
            hidden_size=hidden,
            vocab_size=need_int("vocab_size"),
            num_hidden_layers=n_layers,
            # MTP layers run on the MLA stack only; a GQA family's are left on disk unused
            num_mtp_layers=opt_int("num_nextn_predict_layers", 0) if mla else 0,
            intermediate_size=need_int("intermediate_size"),
            moe_intermediate_size=need_int(fam.expert_size_key),
            n_routed_experts=n_routed,
            n_shared_experts=opt_int("n_shared_experts", 0),
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            num_attention_heads=n_heads,
            q_lora_rank=None if q_lora is None else config_int(where, "q_lora_rank", q_lora, 1),
            kv_lora_rank=need_int("kv_lora_rank") if mla else 0,
            qk_nope_head_dim=need_int("qk_nope_head_dim") if mla else 0,
            qk_rope_head_dim=need_int("qk_rope_head_dim") if mla else 0,
            v_head_dim=need_int("v_head_dim") if mla else 0,
            first_k_dense_replace=first_dense,
            mlp_layer_types=tuple(str(t) for t in mlp_types),
            index_n_heads=need_int("index_n_heads") if is_dsa else 0,
            index_head_dim=need_int("index_head_dim") if is_dsa else 0,
            indexer_types=tuple(str(t) for t in idx_types),
            attention_biases=attention_biases(mt, cfg),
            **gqa,
        )

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def is_mla(self) -> bool:
        return self.family.attention == "mla"

    @property
    def kv_floats_per_token(self) -> int:
        """Floats the KV cache keeps per token over all layers (MTP included): the MLA latent
        and rope key (+ a DSA index key, counted on every layer: an upper bound), or K and V of
        every KV head."""
        if self.is_mla:
            index = self.index_head_dim if self.family.dsa else 0
            return self.total_layers * (self.kv_lora_rank + self.qk_rope_head_dim + index)
        return self.total_layers * 2 * self.num_key_value_heads * self.head_dim

    @property
    def top_k(self) -> int:
        """``num_experts_per_tok``; a ConfigError naming the key when config.json lacks it."""
        if self.num_experts_per_tok is None:
            raise ConfigError("config.json: missing required key 'num_experts_per_tok'")
        return self.num_experts_per_tok

    @property
    def total_layers(self) -> int:
        """Decoder layers on disk, MTP layers included (they follow the main ones)."""
        return self.num_hidden_layers + self.num_mtp_layers

    def is_moe_layer(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:
            return True  # MTP layers are MoE layers
        return self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        """Whether layer ``layer`` runs its own DSA indexer: a "full" main layer, or an MTP
        layer (whose indexer is optional on disk: see :func:`optional_tensors`)."""
        if not self.family.dsa:
            return False
        if layer < len(self.indexer_types):
            return self.indexer_types[layer] == "full"
        return True


@dataclass(frozen=True, slots=True)
class TensorRole:
    role: Role
    shape: tuple[int, int] | None  # logical [out, in] of a matrix; None for 1-D tensors
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None  # gate_proj / up_proj / down_proj for MLP matrices
    # a 1-D tensor's length where config.json fixes it (norms over the hidden size, the
    # correction bias, MLA's latent norms); None: a matrix, or a vector left unchecked
    length: int | None = None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _expert_re(fam: Family) -> re.Pattern[str]:
    names = "|".join(fam.expert_names)
    return re.compile(rf"^{re.escape(fam.moe_prefix)}\.experts\.(\d+)\.({names})\.weight$")


_EXPERT = {mt: _expert_re(f) for mt, f in FAMILIES.items()}


_ATTN_BIAS = re.compile(r"self_attn\.(\w+_proj\w*)\.bias")


def attention_biases(model_type: str, cfg: Mapping[str, Any]) -> frozenset[str]:
    """The attention projections (names after ``self_attn.``) whose bias the model applies:
    the family's (:attr:`Family.attn_biases`) when config.json's ``attention_bias`` is true,
    else none, as transformers builds the layers."""
    fam = FAMILIES.get(model_type)
    if fam is None or not cfg.get("attention_bias"):
        return frozenset()
    return frozenset(fam.attn_biases)


def classify(name: str, arch: ArchConfig) -> TensorRole | None:
    """Role and logical shape of an HF tensor name, or None if the name is unknown."""
    h, v = arch.hidden_size, arch.vocab_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return TensorRole("io", (v, h))
    if name == "model.norm.weight":
        return TensorRole("f32", None, length=h)
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= arch.total_layers:
        return None
    mtp = layer >= arch.num_hidden_layers
    mat: Role = "mtp" if mtp else "dense"
    fam = arch.family
    proj_bias = _ATTN_BIAS.fullmatch(rest)
    if proj_bias is not None and proj_bias.group(1) not in arch.attention_biases:
        return None  # (a bias the family's attention has no place for: unknown, never applied)
    if rest.startswith("self_attn.indexer.") and not arch.has_indexer(layer):
        return None  # (a layer that runs no indexer: DeepSeek-V3, a GLM-5 "shared" layer)
    if rest.endswith((".bias", "_bias")) and rest not in _used_biases(arch, layer):
        # (a router, expert, shared-expert or norm bias: no family here applies one, and it
        # was counted known and dropped without a word; as transformers, it is not applied)
        return None
    if rest.endswith(("norm.weight", ".bias", "e_score_correction_bias")) or (rest == fam.router):
        if rest == fam.router:
            return TensorRole("f32", (arch.n_routed_experts, h), layer)
        return TensorRole("f32", None, layer, length=_vector_len(rest, arch))
    e = _EXPERT[arch.model_type].match(rest)
    if e:
        # An expert the config does not have (dense layer, index past n_routed_experts) is an
        # unknown name, not a tensor to index.
        if not arch.is_moe_layer(layer) or int(e.group(1)) >= arch.n_routed_experts:
            return None
        i = arch.moe_intermediate_size
        canonical = EXPERT_PROJS[fam.expert_names.index(e.group(2))]
        eshape = (h, i) if canonical == "down_proj" else (i, h)
        return TensorRole("mtp" if mtp else "expert", eshape, layer, int(e.group(1)), canonical)
    shape = _matrix_shape(rest, layer, arch)
    if shape is None:
        return None
    if mtp and rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return TensorRole("mtp", shape, layer)
    return TensorRole(
        mat, shape, layer, None, rest.split(".")[-2] if rest.startswith("mlp.") else None
    )


def _used_biases(a: ArchConfig, layer: int) -> frozenset[str]:
    """The bias tensors (names after ``model.layers.N.``) the model applies in ``layer``: the
    router's correction bias (an MoE layer's), the DSA indexer's key-norm bias (a layer that
    runs an indexer) and the attention projection biases the family and config give
    (:func:`attention_biases`) to projections the layer has (no ``q_a_proj`` without
    ``q_lora_rank``)."""
    used = {
        f"self_attn.{p}.bias"
        for p in a.attention_biases
        if _matrix_shape(f"self_attn.{p}.weight", layer, a) is not None
    }
    if a.family.bias is not None and a.is_moe_layer(layer):
        used.add(a.family.bias)
    if a.has_indexer(layer):
        used.add("self_attn.indexer.k_norm.bias")
    return frozenset(used)


_HIDDEN_NORMS = frozenset(
    {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
    }
)


def _vector_len(rest: str, a: ArchConfig) -> int | None:
    """The length config.json implies for a layer's 1-D tensor ``rest``, where it is certain
    (a norm or bias of another length was broadcast silently: wrong logits); None elsewhere."""
    if rest in _HIDDEN_NORMS:
        return a.hidden_size
    if rest.endswith("e_score_correction_bias"):
        return a.n_routed_experts
    if a.is_mla:
        if rest == "self_attn.q_a_layernorm.weight":
            return a.q_lora_rank
        if rest == "self_attn.kv_a_layernorm.weight":
            return a.kv_lora_rank
        if rest in ("self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias"):
            return a.index_head_dim or None
    return None


def _matrix_shape(rest: str, layer: int, a: ArchConfig) -> tuple[int, int] | None:
    h, nh = a.hidden_size, a.num_attention_heads
    if not a.is_mla:
        return _gqa_matrix_shape(rest, layer, a)
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q_in = a.q_lora_rank if a.q_lora_rank is not None else h
    moe = a.is_moe_layer(layer)
    shared_i = a.moe_intermediate_size * a.n_shared_experts
    table: dict[str, tuple[int, int]] = {
        "self_attn.q_proj.weight": (nh * qk, h),
        "self_attn.kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, h),
        "self_attn.kv_b_proj.weight": (nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        "self_attn.o_proj.weight": (h, nh * a.v_head_dim),
        "self_attn.indexer.wq_b.weight": (a.index_n_heads * a.index_head_dim, q_in),
        "self_attn.indexer.wk.weight": (a.index_head_dim, h),
        "self_attn.indexer.weights_proj.weight": (a.index_n_heads, h),
        "embed_tokens.weight": (a.vocab_size, h),
        "shared_head.head.weight": (a.vocab_size, h),
        "eh_proj.weight": (h, 2 * h),
    }
    if a.q_lora_rank is not None:
        table["self_attn.q_a_proj.weight"] = (a.q_lora_rank, h)
        table["self_attn.q_b_proj.weight"] = (nh * qk, a.q_lora_rank)
    if moe:
        table["mlp.shared_experts.gate_proj.weight"] = (shared_i, h)
        table["mlp.shared_experts.up_proj.weight"] = (shared_i, h)
        table["mlp.shared_experts.down_proj.weight"] = (h, shared_i)
    else:
        table["mlp.gate_proj.weight"] = (a.intermediate_size, h)
        table["mlp.up_proj.weight"] = (a.intermediate_size, h)
        table["mlp.down_proj.weight"] = (h, a.intermediate_size)
    return table.get(rest)


def _gqa_matrix_shape(rest: str, layer: int, a: ArchConfig) -> tuple[int, int] | None:
    h, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    table: dict[str, tuple[int, int]] = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
    }
    if a.is_moe_layer(layer):
        shared_i = a.moe_intermediate_size * a.n_shared_experts
        for x in ("gate_proj", "up_proj"):
            table[f"mlp.shared_experts.{x}.weight"] = (shared_i, h)
        table["mlp.shared_experts.down_proj.weight"] = (h, shared_i)
    else:
        for x in ("gate_proj", "up_proj"):
            table[f"mlp.{x}.weight"] = (a.intermediate_size, h)
        table["mlp.down_proj.weight"] = (h, a.intermediate_size)
    return table.get(rest)


def optional_tensors(arch: ArchConfig) -> frozenset[str]:
    """Names of :func:`expected_tensors` a complete container may lack: the DSA indexer of the
    MTP layer(s). The public converter never writes it (its MTP pass skips indexer tensors),
    and without it the MTP layer attends densely, as the C engine does; that only changes
    drafts, which the main model verifies. A main layer's indexer is never optional."""
    return frozenset(
        f"model.layers.{layer}.{t}"
        for layer in range(arch.num_hidden_layers, arch.total_layers)
        if arch.has_indexer(layer)
        for t in INDEXER_TENSORS
    )


def expected_tensors(arch: ArchConfig) -> list[str]:
    """Every tensor name of the full model (MTP layers included when the config declares them),
    the MTP indexer too although it is optional (:func:`optional_tensors`).

    Other optional tensors (a separate MTP ``embed_tokens``, attention biases) are not listed."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    if not arch.is_mla:
        return names + _gqa_expected(arch)
    for layer in range(arch.total_layers):
        p = f"model.layers.{layer}."
        attn = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if arch.q_lora_rank is not None:
            attn += ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                     "self_attn.q_b_proj.weight"]  # fmt: skip
        else:
            attn += ["self_attn.q_proj.weight"]
        attn += ["self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                 "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"]  # fmt: skip
        if arch.has_indexer(layer):
            attn += list(INDEXER_TENSORS)
        if arch.is_moe_layer(layer):
            attn += ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]
            if arch.n_shared_experts:
                attn += [
                    f"mlp.shared_experts.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")
                ]
            for e in range(arch.n_routed_experts):
                attn += [
                    f"mlp.experts.{e}.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")
                ]
        else:
            attn += [f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
        if layer >= arch.num_hidden_layers:
            attn += ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight"]  # fmt: skip
        names += [p + x for x in attn]
    return names


def _gqa_expected(arch: ArchConfig) -> list[str]:
    fam, names = arch.family, []
    for layer in range(arch.num_hidden_layers):
        p = f"model.layers.{layer}."
        t = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        t += [f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if arch.qk_norm != "none":
            t += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if arch.is_moe_layer(layer):
            t.append(fam.router)
            if fam.bias is not None:
                t.append(fam.bias)
            if arch.n_shared_experts:
                t += [f"mlp.shared_experts.{x}.weight" for x in EXPERT_PROJS]
            t += [
                fam.expert_tensor(e, x) for e in range(arch.n_routed_experts) for x in EXPERT_PROJS
            ]
        else:
            t += [f"mlp.{x}.weight" for x in EXPERT_PROJS]
        names += [p + x for x in t]
    return names

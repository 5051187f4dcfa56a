#!/usr/bin/env python3
"""Make tiny seeded random-weight Hugging Face checkpoints plus reference outputs (the oracle).

The oracle is the judge of colibri's own numpy/numba model math. For each model NAME it writes

* ``DIR/NAME/``: a real HF checkpoint (``config.json``, ``model.safetensors`` with the MTP tensors,
  ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) that loads with
  ``AutoModelForCausalLM.from_pretrained`` (the MTP keys are reported as unexpected and ignored);
* ``DIR/NAME.ref.npz``: reference tensors computed in fp32 on the bf16-rounded weights;
* ``DIR/NAME.ref.json``: a small human-readable summary.

Models: ``glm_moe_dsa`` (GLM-5 layout: MLA + DSA lightning indexer, sigmoid router with
correction bias, n_group 1), ``deepseek_v3`` (MLA, group-limited routing, YaRN rope),
``deepseek_v32`` (MLA + DSA on every layer with a half-split indexer RoPE, groups, YaRN), and the
grouped-query families ``olmoe``, ``qwen3_moe``, ``mixtral``, ``glm4_moe``, ``minimax_m2`` (each
with its q/k norm, bias, partial-rotary and router options on; no MTP head, no ``mtp_logits``).

Weights: every parameter and buffer is drawn from one seeded ``torch.Generator`` (Linear and
Embedding weights N(0, gain^2/fan_in), RMSNorm/LayerNorm weights 1 + 0.1 N, biases 0.1 N, router
``e_score_correction_bias`` 0.05 N), then rounded to bf16. The checkpoint stores bf16 except
``e_score_correction_bias`` (F32). All references run in fp32 on exactly those rounded values.

Reference npz keys, for each prompt i (0..3):

* ``prompt_i`` int64 [T]; ``logits_i`` float32 [T, V] (full forward, no cache);
* ``hidden_i`` float32 [T, H]: final hidden states after ``model.norm``;
* ``greedy_i`` int64 [32]: greedy continuation, each step a full no-cache forward over the whole
  sequence so far (the mathematical definition; EOS does not stop it);
  ``greedy_margin_i`` float32 [32]: top-1 minus top-2 logit at each step;
* ``mtp_logits_i`` float32 [T-1, V]: the MTP head, defined below;
* DSA models only, for prompts longer than ``index_topk``: ``dsa_scores_i_layer_L`` float32
  [T, T] (indexer score of key t for query s, -inf where masked by causality) for every layer L
  that runs its own indexer ("full" in ``indexer_types``), ``dsa_topk_i_layer_L`` int64 [T, k]
  (the set transformers selected, causal members ascending, padded with -1), and the same two
  for the MTP layer as ``dsa_scores_i_mtp`` / ``dsa_topk_i_mtp`` when T - 1 > ``index_topk``.
  "shared" layers run no indexer and reuse the top-k of the nearest earlier "full" layer.

MTP (multi-token prediction) head. transformers does not build it for these checkpoints (its MTP
path is broken for glm_moe_dsa in 5.24), so it is built here from the same module classes and
stored as ``model.layers.{num_hidden_layers}.*``:

* ``enorm`` (RMSNorm H), ``hnorm`` (RMSNorm H), ``eh_proj`` (Linear 2H -> H, weight [H, 2H],
  no bias);
* a full MoE decoder layer with the usual names (``input_layernorm``, ``self_attn.*`` including
  ``self_attn.indexer.*`` for glm_moe_dsa, ``post_attention_layernorm``, ``mlp.gate.*``,
  ``mlp.experts.E.{gate,up,down}_proj``, ``mlp.shared_experts.*``);
* ``shared_head.norm`` (RMSNorm H) and ``shared_head.head`` (Linear H -> V, its own random weight,
  not a copy of ``lm_head``). There is no MTP ``embed_tokens``: ``model.embed_tokens`` is shared.
  The three MTP RMSNorms use ``config.rms_norm_eps``.

Definition (colibri implements exactly this). Given prompt ids x[0..T-1] and the main model's final
hidden states h[0..T-1] AFTER the final norm ``model.norm``, for t = 0..T-2::

    e_t = embed_tokens(x[t+1])
    u_t = eh_proj(cat([enorm(e_t), hnorm(h_t)], -1))

then run the MTP decoder layer over u_0..u_{T-2} as one causal sequence with position ids
0..T-2 (its own attention and, for glm_moe_dsa, its own "full" indexer; no KV shared with the
main layers), and ``mtp_logits = shared_head.head(shared_head.norm(out))``. Row t predicts
x[t+2]. RoPE is relative, so positions 1..T-1 would give the same result up to rounding.

Usage: ``python tools/make_oracle.py --out DIR [--only NAME ...] [--seed 0]``.
Reruns with the same seed and software versions give byte-identical files.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

TOOL_VERSION = "1.0"
MLA_NAMES: tuple[str, ...] = ("glm_moe_dsa", "deepseek_v3", "deepseek_v32")
DSA_NAMES: tuple[str, ...] = ("glm_moe_dsa", "deepseek_v32")  # with a lightning indexer
# Grouped-query families: no MTP head (transformers has none for them).
GQA_NAMES: tuple[str, ...] = ("olmoe", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2")
MODEL_NAMES: tuple[str, ...] = MLA_NAMES + GQA_NAMES

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")
TOKENIZER_VOCAB_SIZE = 1000
# Roles as "<|role|>\n" + content; generation prompt "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# (source text, token length); each prompt is the first `length` tokens of its text.
PROMPT_SOURCES: tuple[tuple[str, int], ...] = (
    ("The quick brown fox jumps over the lazy dog.", 5),
    (
        "A function definition defines a user-defined function object, and the body is run later.",
        12,
    ),
    (
        "When the interpreter reads a module for the first time, it compiles the source into "
        "byte code, stores the result in a cache directory, and then executes every statement "
        "from top to bottom so that classes and functions are bound to their names.",
        30,
    ),
    (
        "Exceptions are a way of breaking out of the normal flow of control of a code block in "
        "order to handle errors or other exceptional conditions. An exception is raised at the "
        "point where the error is detected; it may be handled by the surrounding code block or "
        "by any code block that directly or indirectly invoked the code block where the error "
        "occurred, and the handler may return or continue with the next statement.",
        48,
    ),
)
GREEDY_STEPS = 32

HIGHLIGHT_KEYS = tuple(
    """vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers
    first_k_dense_replace mlp_layer_types num_attention_heads n_routed_experts
    num_experts_per_tok n_shared_experts n_group topk_group routed_scaling_factor norm_topk_prob
    q_lora_rank kv_lora_rank qk_rope_head_dim qk_nope_head_dim v_head_dim rms_norm_eps
    rope_parameters rope_interleave index_topk index_head_dim index_n_heads indexer_types
    eos_token_id bos_token_id""".split()
)

# Gains for N(0, gain^2 / fan_in) weights; chosen so activations stay O(1), logits are not flat
# and sigmoid router scores spread over most of (0, 1).
ROUTER_GAIN = 2.0
LM_HEAD_GAIN = 3.0
EMBED_STD = 1.0


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def training_corpus() -> list[str]:
    """Offline English text: CPython's ``pydoc_data.topics``, in sorted topic order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Any:
    """Train a deterministic byte-level BPE (``tokenizers.Tokenizer``) with our special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    return tok


def special_ids(tok: Any) -> dict[str, int]:
    return {name: int(tok.token_to_id(name)) for name in SPECIAL_TOKENS}


def eos_ids(tok: Any) -> list[int]:
    ids = special_ids(tok)
    return [ids["<|endoftext|>"], ids["<|user|>"]]


def make_prompts(tok: Any) -> list[list[int]]:
    """Token ids of the fixed prompts (no BOS), truncated to their target lengths."""
    prompts = []
    for text, length in PROMPT_SOURCES:
        ids = tok.encode(text).ids
        if len(ids) < length:
            raise RuntimeError(f"prompt text too short: {len(ids)} < {length} tokens: {text!r}")
        prompts.append([int(i) for i in ids[:length]])
    return prompts


def tokenizer_files(tok: Any) -> dict[str, str]:
    """Text of tokenizer.json, tokenizer_config.json (file name -> content)."""
    ids = special_ids(tok)
    added = {
        str(ids[name]): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name in SPECIAL_TOKENS
    }
    cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"],
        "bos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _dumps(cfg),
    }


# --------------------------------------------------------------------------------------------
# Configs and model construction
# --------------------------------------------------------------------------------------------


# The YaRN rope of the DeepSeek-shaped oracles (original context 128 of 512: the ramp matters).
YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# The DSA indexer of the glm_moe_dsa and deepseek_v32 oracles. 8 heads, not 4: with 4 heads
# ~1/16 of the scores are exactly 0 (every relu(.) = 0), and such ties land on the top-k cut,
# making the selected set ambiguous.
DSA_INDEXER: dict[str, Any] = {"index_topk": 16, "index_head_dim": 64, "index_n_heads": 8}


def make_config(name: str, vocab_size: int, eos: list[int], bos: int) -> Any:
    """The tiny transformers config for model ``name`` (eager attention)."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=96,  # not a multiple of 64: exercises int4 group padding
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        hidden_act="silu",
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=list(eos),
        pad_token_id=None,
        attention_bias=False,
        num_nextn_predict_layers=1,
    )
    cfg: Any
    if name == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig

        cfg = GlmMoeDsaConfig(
            **common,
            v_head_dim=32,
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            **DSA_INDEXER,
            indexer_types=["full", "shared", "full", "shared"],
        )
    elif name == "deepseek_v3":
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(
            **common,
            v_head_dim=48,  # differs from qk_nope_head_dim on purpose
            n_group=4,
            topk_group=2,
            rms_norm_eps=1e-6,
            rope_interleave=True,
            rope_parameters=dict(YARN),
        )
    elif name == "deepseek_v32":
        from transformers import DeepseekV32Config

        cfg = DeepseekV32Config(
            **common,
            v_head_dim=32,
            n_group=4,
            topk_group=2,
            rms_norm_eps=1e-6,
            rope_parameters=dict(YARN),
            **DSA_INDEXER,
        )
    elif name in GQA_NAMES:
        cfg = _gqa_config(name, vocab_size, eos, bos)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES}")
    cfg._attn_implementation = "eager"
    return cfg


def _gqa_config(name: str, vocab_size: int, eos: list[int], bos: int) -> Any:
    """Tiny grouped-query configs: odd widths (int4 group padding), fewer KV heads than query
    heads, and each family's norm / bias / rotary / router options switched on."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=list(eos),
        pad_token_id=None,
        num_experts_per_tok=2,
    )
    if name == "olmoe":
        return transformers.OlmoeConfig(
            **common, num_hidden_layers=3, intermediate_size=96, num_experts=8,
            norm_topk_prob=False, clip_qkv=3.0, attention_bias=True, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **{**common, "num_experts_per_tok": 3}, num_hidden_layers=3, head_dim=48,
            intermediate_size=160, moe_intermediate_size=80, num_experts=8, norm_topk_prob=True,
            mlp_only_layers=[1], decoder_sparse_step=1, attention_bias=False, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )  # fmt: skip
    if name == "mixtral":
        return transformers.MixtralConfig(
            **{**common, "num_key_value_heads": 1}, num_hidden_layers=2, intermediate_size=96,
            num_local_experts=6, rms_norm_eps=1e-5, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )  # fmt: skip
    if name == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, num_hidden_layers=3, head_dim=32, intermediate_size=192,
            moe_intermediate_size=80, n_routed_experts=8, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
            attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5},
        )  # fmt: skip
    if name == "minimax_m2":
        return transformers.MiniMaxM2Config(
            **common, num_hidden_layers=2, head_dim=32, intermediate_size=96,
            num_local_experts=8, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                             "partial_rotary_factor": 0.5},
        )  # fmt: skip
    raise ValueError(f"unknown grouped-query model {name!r}")


def _model_classes(name: str) -> dict[str, Any]:
    if name in GQA_NAMES:
        import transformers

        prefix = {"olmoe": "Olmoe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
                  "glm4_moe": "Glm4Moe", "minimax_m2": "MiniMaxM2"}[name]  # fmt: skip
        return {"causal_lm": getattr(transformers, f"{prefix}ForCausalLM")}
    if name == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

        return {
            "causal_lm": v32.DeepseekV32ForCausalLM,
            "layer": v32.DeepseekV32DecoderLayer,
            "norm": v32.DeepseekV32RMSNorm,
        }
    if name == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

        return {
            "causal_lm": glm.GlmMoeDsaForCausalLM,
            "layer": glm.GlmMoeDsaDecoderLayer,
            "norm": glm.GlmMoeDsaRMSNorm,
        }
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3

    return {
        "causal_lm": getattr(dsv3, "DeepseekV3ForCausalLM"),  # noqa: B009
        "layer": getattr(dsv3, "DeepseekV3DecoderLayer"),  # noqa: B009
        "norm": getattr(dsv3, "DeepseekV3RMSNorm"),  # noqa: B009
    }


def mtp_layer_config(config: Any) -> Any:
    """Config copy whose per-layer lists cover index ``num_hidden_layers`` (the MTP layer)."""
    cfg = copy.deepcopy(config)
    if getattr(cfg, "mlp_layer_types", None) is not None:
        cfg.mlp_layer_types = [*cfg.mlp_layer_types, "sparse"]
    if getattr(cfg, "indexer_types", None) is not None:
        cfg.indexer_types = [*cfg.indexer_types, "full"]
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [*cfg.layer_types, cfg.layer_types[-1]]
    return cfg


def make_mtp_layer(name: str, config: Any) -> Any:
    """The MTP block: a MoE decoder layer with enorm/hnorm/eh_proj/shared_head attached."""
    cls = _model_classes(name)
    h, eps = config.hidden_size, config.rms_norm_eps
    layer = cls["layer"](mtp_layer_config(config), config.num_hidden_layers)
    layer.enorm = cls["norm"](h, eps=eps)
    layer.hnorm = cls["norm"](h, eps=eps)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = cls["norm"](h, eps=eps)
    layer.shared_head.head = nn.Linear(h, config.vocab_size, bias=False)
    return layer


def _normal(gen: torch.Generator, shape: Sequence[int], std: float) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std


@torch.no_grad()
def randomize_(module: nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter/buffer in place (module order) and round it to bf16.

    ``e_score_correction_bias`` is drawn as 0.05 N and kept in float32.
    """
    for mod_name, mod in module.named_modules():
        kind = type(mod).__name__
        is_head = mod_name == "lm_head" or mod_name.endswith("shared_head.head")
        for pname, p in mod.named_parameters(recurse=False):
            shape = p.shape
            if isinstance(mod, nn.LayerNorm) or kind.endswith("RMSNorm"):
                val = (
                    (1.0 + _normal(gen, shape, 0.1))
                    if pname == "weight"
                    else _normal(gen, shape, 0.1)
                )
            elif isinstance(mod, nn.Embedding):
                val = _normal(gen, shape, EMBED_STD)
            elif isinstance(mod, nn.Linear):
                if pname == "weight":
                    gain = LM_HEAD_GAIN if is_head else 1.0
                    val = _normal(gen, shape, gain / math.sqrt(mod.in_features))
                else:
                    val = _normal(gen, shape, 0.1)
            elif kind.lower().endswith("topkrouter") and pname == "weight":
                val = _normal(gen, shape, ROUTER_GAIN / math.sqrt(shape[-1]))
            elif kind.endswith("Experts") and pname in ("gate_up_proj", "down_proj"):
                val = _normal(gen, shape, 1.0 / math.sqrt(shape[-1]))
            elif pname.endswith("bias"):
                val = _normal(gen, shape, 0.1)
            else:
                raise RuntimeError(f"no init rule for {kind}.{pname} {tuple(shape)}")
            p.copy_(val.to(torch.bfloat16).to(torch.float32))
        for bname, b in mod.named_buffers(recurse=False):
            if bname == "e_score_correction_bias":
                b.copy_(_normal(gen, b.shape, 0.05))


def build(name: str, seed: int = 0, tok: Any = None) -> tuple[Any, Any, Any]:
    """Build the seeded random fp32 model (bf16-rounded values), its config and its MTP block.

    Returns ``(model, config, mtp)``; ``mtp`` is the decoder layer with ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.{norm,head}`` attached (see the module docstring).
    """
    if tok is None:
        tok = train_tokenizer()
    config = make_config(
        name, tok.get_vocab_size(), eos_ids(tok), special_ids(tok)["<|endoftext|>"]
    )
    cls = _model_classes(name)
    torch.manual_seed(seed)  # the default init is overwritten; this only pins it
    model = cls["causal_lm"](config)
    mtp = make_mtp_layer(name, config) if name in MLA_NAMES else None
    gen = torch.Generator().manual_seed(seed)
    randomize_(model, gen)
    model.eval()
    if mtp is not None:
        randomize_(mtp, gen)
        mtp.eval()
    return model, config, mtp


# --------------------------------------------------------------------------------------------
# Reference computations
# --------------------------------------------------------------------------------------------


def _causal_mask(model: Any, embeds: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The same causal mask object the main model builds for itself."""
    from transformers.masking_utils import create_causal_mask

    kwargs: dict[str, Any] = dict(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
    )
    if model.config.model_type in DSA_NAMES:
        kwargs["allow_is_causal_skip"] = False
    return create_causal_mask(**kwargs)


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" from a bool or additive float mask."""
    return mask if mask.dtype == torch.bool else mask == 0


def indexer_scores(
    indexer: Any,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """DSA lightning-indexer scores [B, S, T] as in ``GlmMoeDsaIndexer.forward``, -inf if masked.

    Index head layout is [rope | nope]; GLM applies *interleaved* RoPE to the rope slice,
    DeepSeek-V3.2 half-split RoPE (``DeepseekV32Indexer.forward``, otherwise the same).
    score[s, t] = sum_h w_h(s) * n_heads^-1/2 * relu(q_h(s) . k(t) * head_dim^-1/2).
    """
    if indexer.config.model_type == "deepseek_v32":
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            apply_rotary_pos_emb as rope_fn,
        )
    else:
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            apply_rotary_pos_emb_interleave as rope_fn,
        )

    b, s, _ = hidden_states.shape
    rope = indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = rope_fn(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(
        torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale
    )
    weights = indexer.weights_proj(hidden_states).float() * (indexer.n_heads**-0.5)
    out = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    allowed = _allowed(attention_mask)
    if allowed.dim() == 4:
        allowed = allowed[:, 0]
    return out.masked_fill(~allowed, float("-inf"))


class IndexerRecorder:
    """Forward hooks on DSA indexers capturing (scores with -inf mask, selected top-k)."""

    def __init__(self, modules: dict[str, Any]) -> None:
        self.records: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.active = False
        self.min_margin = math.inf  # over every call, recorded or not
        self._handles = [
            mod.register_forward_hook(self._hook(key), with_kwargs=True)
            for key, mod in modules.items()
        ]

    def _hook(self, key: str) -> Callable[..., None]:
        def hook(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            hidden, q_resid, pos_emb, mask = args[:4]
            scores = indexer_scores(mod, hidden, q_resid, pos_emb, mask)[0]
            k = output.shape[-1]
            self.min_margin = min(self.min_margin, topk_boundary_margin(scores.numpy(), k))
            if not self.active:
                return
            allowed = torch.isfinite(scores)
            rows = []
            for srow, sel in enumerate(output[0].long()):
                members = sorted(int(t) for t in sel if bool(allowed[srow, t]))
                rows.append(members + [-1] * (sel.numel() - len(members)))
            self.records[key] = (
                scores.numpy().astype(np.float32),
                np.asarray(rows, dtype=np.int64),
            )

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def topk_boundary_margin(scores: np.ndarray, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th finite score over rows with > k candidates."""
    margin = math.inf
    for row in scores:
        finite = np.sort(row[np.isfinite(row)])[::-1]
        if finite.size > k:
            margin = min(margin, float(finite[k - 1] - finite[k]))
    return margin


@torch.no_grad()
def forward_full(model: Any, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], final normed hidden [T, H]) of a full no-cache fp32 forward."""
    x = torch.tensor([list(ids)], dtype=torch.long)
    out = model.model(input_ids=x, use_cache=False)
    hidden = out.last_hidden_state
    return model.lm_head(hidden)[0], hidden[0]


@torch.no_grad()
def greedy(model: Any, ids: Sequence[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation, re-running the full forward each step; (tokens, top1-top2 margins)."""
    seq = list(ids)
    toks: list[int] = []
    margins: list[float] = []
    for _ in range(steps):
        logits, _ = forward_full(model, seq)
        last = logits[-1]
        top2 = torch.topk(last, 2)
        tok = int(torch.argmax(last))
        toks.append(tok)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(tok)
    return toks, margins


@torch.no_grad()
def mtp_forward(model: Any, mtp: Any, ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
    """MTP logits [T-1, V] per the module-docstring definition (``hidden`` is after model.norm)."""
    t = len(ids)
    if t < 2:
        return torch.zeros((0, model.config.vocab_size))
    nxt = torch.tensor([list(ids[1:])], dtype=torch.long)
    e = model.model.embed_tokens(nxt)
    h = hidden[None, :-1]
    u = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))
    pos = torch.arange(t - 1)[None]
    pos_emb = model.model.rotary_emb(u, pos)
    mask = _causal_mask(model, u, pos)
    out = mtp(u, attention_mask=mask, position_ids=pos, position_embeddings=pos_emb)
    if isinstance(out, tuple):  # GLM layers also return their top-k indices
        out = out[0]
    logits: torch.Tensor = mtp.shared_head.head(mtp.shared_head.norm(out))[0]
    return logits


def compute_reference(
    name: str, model: Any, mtp: Any, prompts: list[list[int]]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """All reference arrays for ``prompts`` plus summary statistics."""
    arrays: dict[str, np.ndarray] = {}
    stats: dict[str, Any] = {"greedy_min_margin": [], "dsa_min_boundary_margin": {}}
    recorder = None
    topk = getattr(model.config, "index_topk", None)
    if name in DSA_NAMES:
        mods = {
            f"layer_{i}": layer.self_attn.indexer
            for i, layer in enumerate(model.model.layers)
            if layer.self_attn.indexer is not None
        }
        mods["mtp"] = mtp.self_attn.indexer
        recorder = IndexerRecorder(mods)
    try:
        for i, ids in enumerate(prompts):
            if recorder is not None:
                recorder.records.clear()
                recorder.active = True
            logits, hidden = forward_full(model, ids)
            mtp_logits = mtp_forward(model, mtp, ids, hidden) if mtp is not None else None
            if recorder is not None:
                recorder.active = False
            toks, margins = greedy(model, ids, GREEDY_STEPS)
            arrays[f"prompt_{i}"] = np.asarray(ids, dtype=np.int64)
            arrays[f"logits_{i}"] = logits.numpy().astype(np.float32)
            arrays[f"greedy_{i}"] = np.asarray(toks, dtype=np.int64)
            arrays[f"greedy_margin_{i}"] = np.asarray(margins, dtype=np.float32)
            arrays[f"hidden_{i}"] = hidden.numpy().astype(np.float32)
            if mtp_logits is not None:
                arrays[f"mtp_logits_{i}"] = mtp_logits.numpy().astype(np.float32)
            stats["greedy_min_margin"].append(float(min(margins)))
            if recorder is not None and topk is not None:
                for key, (scores, sel) in sorted(recorder.records.items()):
                    if scores.shape[-1] <= topk:
                        continue
                    arrays[f"dsa_scores_{i}_{key}"] = scores
                    arrays[f"dsa_topk_{i}_{key}"] = sel
                    stats["dsa_min_boundary_margin"][f"{i}_{key}"] = topk_boundary_margin(
                        scores, topk
                    )
        if recorder is not None:
            stats["dsa_min_boundary_margin_all"] = recorder.min_margin
            if not recorder.min_margin > 0.0:
                raise RuntimeError(
                    f"{name}: exact score tie at the DSA top-k cut; the oracle would be ambiguous"
                )
    finally:
        if recorder is not None:
            recorder.close()
    return arrays, stats


# --------------------------------------------------------------------------------------------
# Writing files (byte-deterministic)
# --------------------------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _write_text(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8"))


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez`` (uncompressed) but with fixed zip timestamps and sorted member order."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, member.getvalue())
    path.write_bytes(buf.getvalue())


def checkpoint_tensors(model: Any, mtp: Any) -> dict[str, torch.Tensor]:
    """HF-named checkpoint tensors (bf16; ``e_score_correction_bias`` F32) including the MTP layer.

    The names come from ``save_pretrained`` itself (per-expert ``experts.E.*_proj.weight``), with
    the MTP block temporarily appended as ``model.layers[num_hidden_layers]``.
    """
    from safetensors.torch import load_file

    layers = model.model.layers
    if mtp is not None:
        layers.append(mtp)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            files = sorted(Path(tmp).glob("*.safetensors"))
            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(str(f)))
    finally:
        if mtp is not None:
            del layers[len(layers) - 1]
    out = {}
    for key in sorted(state):
        val = state[key]
        if not key.endswith("e_score_correction_bias"):
            val = val.to(torch.bfloat16)
        out[key] = val.contiguous()
    return out


def config_dict(name: str, config: Any) -> dict[str, Any]:
    """config.json content: the transformers config plus fields GGUF tools expect."""
    d = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    d["architectures"] = [_model_classes(name)["causal_lm"].__name__]
    d["dtype"] = "bfloat16"
    if name in MLA_NAMES:
        d["num_nextn_predict_layers"] = 1
        d["scoring_func"] = "sigmoid"
        d["topk_method"] = "noaux_tc"
    return d


def write_model(name: str, out_dir: Path, seed: int, tok: Any) -> dict[str, Any]:
    """Build, save and reference one model; returns the summary dict written to NAME.ref.json."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model, config, mtp = build(name, seed, tok)
    ckpt = out_dir / name
    ckpt.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, mtp)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(ckpt / "model.safetensors", 0o644)
    _write_text(ckpt / "config.json", _dumps(config_dict(name, config)))
    gen_cfg = {
        "bos_token_id": config.bos_token_id,
        "do_sample": False,
        "eos_token_id": list(config.eos_token_id),
        "transformers_version": _version("transformers"),
    }
    _write_text(ckpt / "generation_config.json", _dumps(gen_cfg))
    for fname, text in tokenizer_files(tok).items():
        _write_text(ckpt / fname, text)

    prompts = make_prompts(tok)
    arrays, stats = compute_reference(name, model, mtp, prompts)
    save_npz(out_dir / f"{name}.ref.npz", arrays)

    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters()) if mtp is not None else 0
    highlights = {
        k: getattr(config, k, None) for k in HIGHLIGHT_KEYS if getattr(config, k, None) is not None
    }
    summary = {
        "tool": "tools/make_oracle.py",
        "tool_version": TOOL_VERSION,
        "model": name,
        "seed": seed,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
            "numpy": np.__version__,
        },
        "config": highlights,
        "params": {"main": n_main, "mtp": n_mtp},
        "mtp_prefix": f"model.layers.{config.num_hidden_layers}." if mtp is not None else None,
        "prompts": [
            {"source_text": src, "text": tok.decode(ids), "length": len(ids), "ids": ids}
            for (src, _), ids in zip(PROMPT_SOURCES, prompts, strict=True)
        ],
        "greedy_steps": GREEDY_STEPS,
        "greedy_min_margin": stats["greedy_min_margin"],
        "dsa_min_boundary_margin": stats["dsa_min_boundary_margin"],
        "dsa_min_boundary_margin_all_forwards": stats.get("dsa_min_boundary_margin_all"),
        "npz_keys": sorted(arrays),
        "sha256": {
            "model.safetensors": hashlib.sha256(
                (ckpt / "model.safetensors").read_bytes()
            ).hexdigest()
        },
    }
    _write_text(out_dir / f"{name}.ref.json", _dumps(summary))
    dsa = stats["dsa_min_boundary_margin"]
    dsa_txt = f", min DSA top-k margin {min(dsa.values()):.3g}" if dsa else ""
    print(
        f"{name}: {n_main / 1e6:.2f}M params + {n_mtp / 1e6:.2f}M MTP, vocab {config.vocab_size}, "
        f"prompts {[len(p) for p in prompts]}, min greedy margin "
        f"{min(stats['greedy_min_margin']):.3g}{dsa_txt}, "
        f"{time.perf_counter() - t0:.1f} s -> {ckpt}",
        flush=True,
    )
    return summary


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument(
        "--only", nargs="+", choices=MODEL_NAMES, help="models to make (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) if argv is not None else None)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    for name in args.only or MODEL_NAMES:
        write_model(name, args.out, args.seed, tok)
    return 0


if __name__ == "__main__":
    sys.exit(main())

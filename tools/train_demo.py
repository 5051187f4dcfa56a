#!/usr/bin/env python3
"""Train the bundled demo model: a small GLM-5 (``glm_moe_dsa``) with real trained weights.

Architecture: transformers' ``GlmMoeDsaForCausalLM`` (MLA attention, DSA lightning indexer, a
dense first layer then MoE layers with a sigmoid router, one shared expert and
``e_score_correction_bias``) plus ONE multi-token-prediction (MTP) layer built by hand exactly as
``tools/make_oracle.py`` defines it (``enorm``, ``hnorm``, ``eh_proj``, a full MoE decoder layer,
``shared_head.norm``, ``shared_head.head``; stored as ``model.layers.{num_hidden_layers}.*``).
For position t the MTP layer sees ``u_t = eh_proj(cat(enorm(embed(x[t+1])), hnorm(h_t)))`` with
``h_t`` the main model's final normed hidden state, runs its decoder layer causally over
positions 0.., and ``shared_head.head(shared_head.norm(.))`` predicts x[t+2].

Training (fp32 on CPU, seeded, resumable):

* loss = CE(main, x[t+1]) + ``mtp_weight`` * CE(MTP, x[t+2]) (DeepSeek-V3 style, MTP gradients
  flow into the trunk) + the DSA indexer loss below;
* routing balance without an auxiliary loss (DeepSeek-V3 / GLM): after every step each router's
  ``e_score_correction_bias`` moves by ``bias_speed * sign(mean_load - load)`` (it only changes
  which experts are chosen; gate weights stay the unbiased sigmoid scores);
* DSA indexer (DeepSeek-V3.2 recipe): transformers runs the indexer under ``no_grad``, so it is
  trained by a KL loss between the main attention distribution (summed over heads and over the
  layers that use the indexer's selection, detached) and ``softmax`` of the indexer scores
  (computed on detached inputs). For the first ``dense_frac`` of the steps attention is dense
  (``index_topk`` lifted) and the KL runs over all causal keys (the "dense warm-up"); afterwards
  attention is sparse (top ``index_topk`` keys) and the KL runs over the selected keys only;
* AdamW (weight decay on matrices), linear warm-up then cosine decay to ``min_lr_ratio``;
  gradient clipping at 1.0;
* data: ``tools/demo_corpus.py`` (CPython docs, Q/A dialogs derived from them, chatterbot
  dialogs) tokenized with a byte-level BPE trained here; each batch holds ``batch - chat_per_batch``
  windows of prose and ``chat_per_batch`` windows of chat text; the order is a function of
  (seed, step) alone, so the data position resumes with the step counter.

Stages (one command runs them all; a rerun reuses the data and the finished or partial training
and redoes the rest): data -> train (checkpoint every
``--ckpt-minutes``; ``--max-minutes`` stops cleanly, a rerun with the same arguments resumes) ->
evaluate (held-out perplexity vs a unigram baseline, MTP accuracy, routing skew) -> export a HF
checkpoint (``OUT/hf``: BF16 safetensors, F32 correction biases, tokenizer, chat template,
generation config) -> ``storage.convert`` it (``OUT/container``) -> check the container with
colibri's own runtime (perplexity and MTP agreement of the quantized model, greedy samples) ->
``OUT/report.json`` and ``OUT/report.md``.

Usage::

    python tools/train_demo.py --out /var/tmp/colibri-demo --threads 1 --max-minutes 55
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import demo_corpus  # noqa: E402

DATA_VERSION = "1"
CKPT_NAME = "state.pt"
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SAMPLE_PROMPTS: tuple[str, ...] = (
    "What is a list in Python?",
    "What does os.path.join() do?",
    "Hello, how are you?",
    "What is a decorator?",
)
RAW_PROMPT = "The for statement is used to"

# Model/data shapes by preset; training hyper-parameters are the RunSpec defaults below.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": dict(
        vocab=4096,
        hidden=256,
        intermediate=768,
        moe_intermediate=128,
        layers=6,
        dense_layers=1,
        heads=4,
        experts=32,
        top_k=4,
        q_lora=128,
        kv_lora=96,
        rope=32,
        nope=48,
        v=48,
        index_topk=64,
        index_heads=8,
        index_dim=64,
        seq=256,
        batch=8,
        chat_per_batch=2,
        steps=750,
        warmup=40,
    ),
    # For tests: every code path (dense + MoE layers, shared DSA layer, sparse top-k) in seconds.
    "tiny": dict(
        vocab=384,
        hidden=64,
        intermediate=128,
        moe_intermediate=32,
        layers=3,
        dense_layers=1,
        heads=2,
        experts=8,
        top_k=2,
        q_lora=32,
        kv_lora=32,
        rope=16,
        nope=16,
        v=16,
        index_topk=8,
        index_heads=4,
        index_dim=64,
        seq=32,
        batch=4,
        chat_per_batch=1,
        steps=8,
        warmup=2,
    ),
}


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines a run (a resume must match it exactly)."""

    preset: str
    vocab: int
    hidden: int
    intermediate: int
    moe_intermediate: int
    layers: int
    dense_layers: int
    heads: int
    experts: int
    top_k: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v: int
    index_topk: int
    index_heads: int
    index_dim: int
    seq: int
    batch: int
    chat_per_batch: int
    steps: int
    warmup: int
    seed: int = 0
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3
    indexer_weight: float = 1.0
    bias_speed: float = 1e-3
    dense_frac: float = 0.2
    held_out: float = 0.02
    docs_root: str = "auto"
    chatterbot: bool = True
    max_pages: int | None = None

    @property
    def dense_steps(self) -> int:
        return round(self.dense_frac * self.steps)

    def data_key(self) -> dict[str, Any]:
        return {
            "version": DATA_VERSION,
            "vocab": self.vocab,
            "seed": self.seed,
            "held_out": self.held_out,
            "docs_root": self.docs_root,
            "chatterbot": self.chatterbot,
            "max_pages": self.max_pages,
        }


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ============================================================================ data


@dataclass
class Data:
    """Token streams (uint16) and the tokenizer."""

    tok: Any
    train_docs: np.ndarray
    train_chat: np.ndarray
    held_docs: np.ndarray
    held_chat: np.ndarray
    meta: dict[str, Any]

    def special(self, name: str) -> int:
        return int(self.tok.token_to_id(name))


_SPECIAL_RE = re.compile(r"<\|(?:endoftext|system|user|assistant)\|>\n?")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE with the four special tokens at ids 0..3 (specials stripped from text)."""
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
    tok.train_from_iterator((_SPECIAL_RE.sub("\n", t) for t in texts), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, not {i}")
    return tok


def _encode_stream(tok: Any, docs: Sequence[demo_corpus.Document], order: np.ndarray) -> np.ndarray:
    eos = int(tok.token_to_id("<|endoftext|>"))
    parts: list[np.ndarray] = []
    texts = [docs[int(i)].text for i in order]
    for start in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[start : start + 256], add_special_tokens=False):
            parts.append(np.asarray([*enc.ids, eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def prepare_data(out: Path, spec: RunSpec) -> Data:
    """Build (or reuse) ``OUT/data``: corpus split, tokenizer, token streams, meta.json."""
    from tokenizers import Tokenizer

    ddir = out / "data"
    meta_path = ddir / "meta.json"
    key = spec.data_key()
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            cached = {n: np.load(ddir / f"{n}.npy") for n in _STREAMS}
            tok = Tokenizer.from_file(str(ddir / "tokenizer.json"))
            _log(f"data: reusing {ddir} ({_stream_summary(cached)})")
            return Data(tok=tok, meta=meta, **cached)
    t0 = time.perf_counter()
    ddir.mkdir(parents=True, exist_ok=True)
    docs_root: str | None = None if spec.docs_root == "none" else spec.docs_root
    corpus = demo_corpus.build_corpus(
        docs_root=docs_root,
        use_chatterbot=spec.chatterbot,
        held_out_fraction=spec.held_out,
        max_pages=spec.max_pages,
    )
    _log(f"data: corpus {json.dumps(corpus.stats)} ({time.perf_counter() - t0:.1f} s)")
    tok = train_tokenizer((d.text for d in corpus.train), spec.vocab)
    _log(f"data: tokenizer vocab {tok.get_vocab_size()} ({time.perf_counter() - t0:.1f} s)")
    arrays: dict[str, np.ndarray] = {}
    for split, docs in (("train", corpus.train), ("held", corpus.held_out)):
        for kind, chat in (("docs", False), ("chat", True)):
            sel = [d for d in docs if d.chat == chat]
            # Training order is shuffled (seeded); held-out keeps corpus order.
            order = (
                np.random.default_rng([spec.seed, 7, int(chat)]).permutation(len(sel))
                if split == "train"
                else np.arange(len(sel))
            )
            arrays[f"{split}_{kind}"] = _encode_stream(tok, sel, order)
    for name, arr in arrays.items():
        np.save(ddir / f"{name}.npy", arr)
    tok.save(str(ddir / "tokenizer.json"))
    meta = {
        "key": key,
        "sources": {s: demo_corpus.SOURCES[s] for s in corpus.sources()},
        "stats": corpus.stats,
        "tokens": {n: int(a.size) for n, a in arrays.items()},
        "docs_root": str(demo_corpus.find_python_docs()) if docs_root == "auto" else docs_root,
        "held_out_units": sorted({d.unit for d in corpus.held_out}),
    }
    _atomic_write(meta_path, _dumps(meta).encode())
    _log(f"data: {_stream_summary(arrays)} ({time.perf_counter() - t0:.1f} s)")
    return Data(tok=tok, meta=meta, **arrays)


_STREAMS = ("train_docs", "train_chat", "held_docs", "held_chat")


def _stream_summary(arrays: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{n} {a.size:,} tokens" for n, a in arrays.items())


class Batcher:
    """Batch for step s = a pure function of (seed, s): per-epoch seeded window permutations."""

    def __init__(self, data: Data, spec: RunSpec) -> None:
        self.seq = spec.seq
        self.seed = spec.seed
        self.n_chat = spec.chat_per_batch if data.train_chat.size >= spec.seq else 0
        self.n_docs = spec.batch - self.n_chat
        self.streams = {"docs": data.train_docs, "chat": data.train_chat}
        self.windows = {k: int(v.size // spec.seq) for k, v in self.streams.items()}
        if self.windows["docs"] < 1:
            raise RuntimeError("not enough training text for one window")
        self._perms: dict[tuple[str, int], np.ndarray] = {}

    def _window(self, kind: str, index: int) -> np.ndarray:
        n = self.windows[kind]
        epoch, pos = divmod(index, n)
        key = (kind, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:
                self._perms.clear()
            salt = 0 if kind == "docs" else 1
            self._perms[key] = np.random.default_rng([self.seed, 11, salt, epoch]).permutation(n)
        w = int(self._perms[key][pos])
        return self.streams[kind][w * self.seq : (w + 1) * self.seq]

    def batch(self, step: int) -> np.ndarray:
        rows = [self._window("docs", step * self.n_docs + i) for i in range(self.n_docs)]
        rows += [self._window("chat", step * self.n_chat + i) for i in range(self.n_chat)]
        return np.stack(rows).astype(np.int64)

    def epochs(self, steps: int) -> dict[str, float]:
        return {
            "docs": steps * self.n_docs / self.windows["docs"],
            "chat": steps * self.n_chat / max(self.windows["chat"], 1),
        }


def held_out_windows(data: Data, seq: int, max_seqs: int) -> dict[str, np.ndarray]:
    """Non-overlapping held-out windows per stream (docs first), at most ``max_seqs`` in all."""
    out: dict[str, np.ndarray] = {}
    budget = max_seqs
    for kind, arr in (("docs", data.held_docs), ("chat", data.held_chat)):
        n = min(int(arr.size // seq), budget if kind == "chat" else max(budget * 3 // 4, 1))
        if n > 0:
            out[kind] = arr[: n * seq].reshape(n, seq).astype(np.int64)
        budget -= n
    return out


# ============================================================================ model


def build_config(spec: RunSpec, data: Data) -> Any:
    """The transformers ``GlmMoeDsaConfig`` of this run (eager attention)."""
    from transformers import GlmMoeDsaConfig

    n = spec.layers
    eos = [data.special("<|endoftext|>"), data.special("<|user|>")]
    cfg = GlmMoeDsaConfig(  # type: ignore[call-arg]  # MTP count: a legacy/GGUF field
        vocab_size=int(data.tok.get_vocab_size()),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.moe_intermediate,
        num_hidden_layers=n,
        first_k_dense_replace=spec.dense_layers,
        mlp_layer_types=["dense"] * spec.dense_layers + ["sparse"] * (n - spec.dense_layers),
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        n_shared_experts=1,
        n_routed_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        q_lora_rank=spec.q_lora,
        kv_lora_rank=spec.kv_lora,
        qk_rope_head_dim=spec.rope,
        qk_nope_head_dim=spec.nope,
        v_head_dim=spec.v,
        hidden_act="silu",
        max_position_embeddings=max(1024, 4 * spec.seq),
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        index_topk=spec.index_topk,
        index_head_dim=spec.index_dim,
        index_n_heads=spec.index_heads,
        indexer_types=["full" if i % 2 == 0 else "shared" for i in range(n)],
        tie_word_embeddings=False,
        bos_token_id=eos[0],
        eos_token_id=eos,
        pad_token_id=None,
        attention_bias=False,
        num_nextn_predict_layers=1,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "grouped_mm"  # same math as the eager loop, ~1.5x faster here
    return cfg


def build_models(spec: RunSpec, config: Any) -> tuple[Any, Any]:
    """Seeded fresh (model, mtp); the MTP block gets transformers' own init rules."""
    import torch
    from make_oracle import make_mtp_layer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaForCausalLM

    torch.manual_seed(spec.seed)
    model = GlmMoeDsaForCausalLM(config)
    mtp = make_mtp_layer("glm_moe_dsa", config)
    init: Callable[[Any], None] = model._init_weights
    with torch.no_grad():
        for mod in mtp.modules():
            init(mod)
    return model, mtp


class Probe:
    """Forward hooks: router choices (load counts), indexer inputs/selection, attention maps.

    Indexer inputs and attention maps are kept for the first ``rows`` sequences of a batch only:
    the indexer is tiny and 2 x ``seq`` queries per step train it well, at a quarter of the cost.
    """

    def __init__(self, model: Any, mtp: Any) -> None:
        self.n_layers = int(model.config.num_hidden_layers)
        self.capture = False  # indexer inputs + attention maps (training only)
        self.rows = 2  # batch rows whose attention trains the indexers (keeps the KL cheap)
        self.counts: dict[int, Any] = {}
        self.keep_choices = False  # evaluation: keep each forward's expert choices
        self.choices: dict[int, Any] = {}
        self.routers: dict[int, Any] = {}
        self.indexers: dict[int, Any] = {}
        self.index_in: dict[int, tuple[Any, ...]] = {}
        self.index_sel: dict[int, Any] = {}
        self.attn: dict[int, Any] = {}
        self.users: dict[int, list[int]] = {}  # indexer layer -> layers attending with its top-k
        self._handles: list[Any] = []
        layers = [*model.model.layers, mtp]
        owner = -1
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if attn.indexer is not None:
                owner = i
                self.indexers[i] = attn.indexer
                self.users[i] = []
                self._handles.append(
                    attn.indexer.register_forward_hook(self._index_hook(i), with_kwargs=True)
                )
            self.users[owner].append(i)
            self._handles.append(attn.register_forward_hook(self._attn_hook(i)))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                self.routers[i] = gate
                self._handles.append(gate.register_forward_hook(self._router_hook(i)))

    def _router_hook(self, i: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any, output: Any) -> None:
            import torch

            idx = output[2].detach()
            c = torch.bincount(idx.reshape(-1), minlength=mod.num_experts)
            self.counts[i] = c if i not in self.counts else self.counts[i] + c
            if self.keep_choices:
                self.choices[i] = idx  # [tokens, top_k] of the latest forward

        return hook

    def _index_hook(self, i: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any, kwargs: Any, output: Any) -> None:
            if self.capture:
                r = self.rows
                hs, q_resid, pos_emb, mask = args[:4]
                self.index_in[i] = (
                    hs[:r].detach(),
                    q_resid[:r].detach(),
                    (pos_emb[0][:r].detach(), pos_emb[1][:r].detach()),
                    mask[:r],
                )
                self.index_sel[i] = output[:r].detach()

        return hook

    def _attn_hook(self, i: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any, output: Any) -> None:
            if self.capture and output[1] is not None:
                self.attn[i] = output[1][: self.rows].detach()

        return hook

    def set_dense(self, dense: bool, topk: int) -> None:
        """Dense attention (indexer selects every key) or sparse top-``topk``."""
        for ix in self.indexers.values():
            ix.index_topk = 1 << 30 if dense else topk

    def clear(self) -> None:
        self.counts = {}
        self.index_in = {}
        self.index_sel = {}
        self.attn = {}

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def mtp_logits(model: Any, mtp: Any, ids: Any, hidden: Any) -> Any:
    """MTP logits [B, T-1, V] (row t predicts ids[:, t+2]); ``hidden`` is after ``model.norm``."""
    import torch
    from make_oracle import _causal_mask

    t = ids.shape[1]
    e = model.model.embed_tokens(ids[:, 1:])
    u = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden[:, :-1])], dim=-1))
    pos = torch.arange(t - 1)[None]
    pos_emb = model.model.rotary_emb(u, pos)
    mask = _causal_mask(model, u, pos)
    out = mtp(u, attention_mask=mask, position_ids=pos, position_embeddings=pos_emb)
    if isinstance(out, tuple):
        out = out[0]
    return mtp.shared_head.head(mtp.shared_head.norm(out))


def indexer_kl(probe: Probe, dense: bool) -> Any:
    """Mean KL(attention || indexer) over the indexers of this forward (DeepSeek-V3.2 style)."""
    import torch
    from make_oracle import indexer_scores

    losses = []
    for i, indexer in probe.indexers.items():
        if i not in probe.index_in:
            continue
        hs, q_resid, pos_emb, mask = probe.index_in[i]
        maps = [probe.attn[u] for u in probe.users[i] if u in probe.attn]
        if not maps:
            continue
        target = torch.stack(maps).sum(dim=(0, 2))  # [B, S, T]
        allowed = mask if mask.dtype == torch.bool else mask == 0
        if allowed.dim() == 4:
            allowed = allowed[:, 0]
        allowed = allowed.expand_as(target)
        if not dense:
            sel = torch.zeros_like(allowed).scatter(-1, probe.index_sel[i].long(), True)
            allowed = allowed & sel
        target = target * allowed
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
        scores = indexer_scores(indexer, hs, q_resid, pos_emb, mask)
        logq = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        logq = torch.where(allowed, logq, torch.zeros_like(logq))
        kl = (torch.xlogy(target, target) - target * logq).sum(-1)
        losses.append(kl.mean())
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).mean()


def update_bias(probe: Probe, speed: float) -> None:
    """Aux-loss-free balancing: bias += speed * sign(mean load - load), per router."""
    import torch

    with torch.no_grad():
        for i, gate in probe.routers.items():
            if i in probe.counts:
                load = probe.counts[i].float()
                gate.e_score_correction_bias.add_(speed * torch.sign(load.mean() - load))


def param_groups(modules: Sequence[Any], weight_decay: float) -> list[dict[str, Any]]:
    decay: list[Any] = []
    no_decay: list[Any] = []
    for mod in modules:
        for p in mod.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_lambda(spec: RunSpec) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        frac = min(1.0, (step - spec.warmup) / max(1, spec.steps - spec.warmup))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


# ============================================================================ train


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)


def _rng_state() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(
    path: Path, spec: RunSpec, model: Any, mtp: Any, opt: Any, sched: Any, st: TrainState
) -> None:
    """Atomically write model, MTP, optimizer, scheduler, RNG and progress to ``path``."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "spec": dataclasses.asdict(spec),
        "model": model.state_dict(),
        "mtp": mtp.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": _rng_state(),
        "state": dataclasses.asdict(st),
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(
    path: Path, spec: RunSpec, model: Any, mtp: Any, opt: Any, sched: Any
) -> TrainState:
    import torch

    payload = torch.load(path, map_location="cpu", weights_only=False)
    saved = payload["spec"]
    mine = dataclasses.asdict(spec)
    if saved != mine:
        diff = {k: (saved.get(k), mine.get(k)) for k in mine if saved.get(k) != mine.get(k)}
        raise SystemExit(
            f"{path}: checkpoint was made with other settings {diff} (saved, now); "
            "use the same arguments to resume or --restart to start over"
        )
    model.load_state_dict(payload["model"])
    mtp.load_state_dict(payload["mtp"])
    opt.load_state_dict(payload["optimizer"])
    sched.load_state_dict(payload["scheduler"])
    _set_rng_state(payload["rng"])
    return TrainState(**payload["state"])


def train(
    out: Path,
    spec: RunSpec,
    data: Data,
    model: Any,
    mtp: Any,
    *,
    deadline: float,
    ckpt_seconds: float,
    stop_after: int | None,
    log_every: int,
) -> tuple[TrainState, bool]:
    """Train to ``spec.steps`` (resuming from ``OUT/ckpt``); returns (state, finished)."""
    import torch
    import torch.nn.functional as F

    ckpt = out / "ckpt" / CKPT_NAME
    opt = torch.optim.AdamW(
        param_groups([model, mtp], spec.weight_decay), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))
    st = TrainState()
    if ckpt.is_file():
        st = load_checkpoint(ckpt, spec, model, mtp, opt, sched)
        _log(f"train: resumed from {ckpt} at step {st.step}/{spec.steps}")
    if st.step >= spec.steps:
        return st, True
    batcher = Batcher(data, spec)
    held = held_out_windows(data, spec.seq, 16)
    probe = Probe(model, mtp)
    vocab = model.config.vocab_size
    last_ckpt = time.monotonic()
    t_run = time.monotonic()
    tok_rate = 0.0
    acc: dict[str, float] = {"loss": 0.0, "mtp": 0.0, "idx": 0.0, "n": 0.0}
    model.train()
    mtp.train()
    finished = False
    try:
        while st.step < spec.steps:
            t0 = time.monotonic()
            dense = st.step < spec.dense_steps
            probe.set_dense(dense, spec.index_topk)
            probe.clear()
            probe.capture = True
            x = torch.from_numpy(batcher.batch(st.step))
            hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
            logits = model.lm_head(hidden)
            loss_main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
            m_logits = mtp_logits(model, mtp, x, hidden)
            loss_mtp = F.cross_entropy(m_logits[:, :-1].reshape(-1, vocab), x[:, 2:].reshape(-1))
            loss_idx = indexer_kl(probe, dense)
            probe.capture = False
            loss = loss_main + spec.mtp_weight * loss_mtp + spec.indexer_weight * loss_idx
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([*model.parameters(), *mtp.parameters()], spec.clip)
            opt.step()
            sched.step()
            update_bias(probe, spec.bias_speed)
            probe.attn = {}
            probe.index_in = {}
            st.step += 1
            st.tokens += int(x.numel())
            dt = time.monotonic() - t0
            st.train_seconds += dt
            rate = x.numel() / dt
            tok_rate = rate if tok_rate == 0.0 else 0.9 * tok_rate + 0.1 * rate
            acc["loss"] += loss_main.item()
            acc["mtp"] += loss_mtp.item()
            acc["idx"] += loss_idx.item()
            acc["n"] += 1
            if st.step % log_every == 0 or st.step == spec.steps:
                n = acc["n"]
                eta = (spec.steps - st.step) * x.numel() / max(tok_rate, 1e-9)
                rec = {
                    "step": st.step,
                    "loss": acc["loss"] / n,
                    "mtp_loss": acc["mtp"] / n,
                    "indexer_kl": acc["idx"] / n,
                    "lr": float(sched.get_last_lr()[0]),
                    "tok_s": tok_rate,
                    "train_min": st.train_seconds / 60,
                }
                st.history.append(rec)
                _log(
                    f"step {st.step}/{spec.steps} loss {rec['loss']:.3f} "
                    f"(ppl {math.exp(min(rec['loss'], 50)):.1f}) mtp {rec['mtp_loss']:.3f} "
                    f"idx-kl {rec['indexer_kl']:.3f} lr {rec['lr']:.2e} "
                    f"{'dense' if dense else 'sparse'} {tok_rate:.0f} tok/s "
                    f"elapsed {st.train_seconds / 60:.1f} min ETA {eta / 60:.1f} min"
                )
                acc = {"loss": 0.0, "mtp": 0.0, "idx": 0.0, "n": 0.0}
            stop = stop_after is not None and st.step >= stop_after
            out_of_time = time.monotonic() >= deadline
            due = time.monotonic() - last_ckpt >= ckpt_seconds
            if due or stop or out_of_time or st.step == spec.steps:
                probe.set_dense(False, spec.index_topk)
                ev = quick_eval(model, held, spec)
                st.history.append({"step": st.step, "held_out_loss": ev})
                save_checkpoint(ckpt, spec, model, mtp, opt, sched, st)
                last_ckpt = time.monotonic()
                _log(
                    f"checkpoint step {st.step}: held-out loss {ev:.3f} "
                    f"(ppl {math.exp(min(ev, 50)):.1f}) -> {ckpt}"
                )
                model.train()
                mtp.train()
            if stop or out_of_time:
                why = "--stop-after-steps" if stop else "--max-minutes"
                _log(
                    f"train: stopped by {why} at step {st.step}/{spec.steps} after "
                    f"{(time.monotonic() - t_run) / 60:.1f} min; rerun the same command to resume"
                )
                break
        finished = st.step >= spec.steps
    finally:
        probe.set_dense(False, spec.index_topk)
        probe.close()
    model.eval()
    mtp.eval()
    return st, finished


def quick_eval(model: Any, windows: dict[str, np.ndarray], spec: RunSpec) -> float:
    """Mean held-out next-token loss over a few windows (for progress lines)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for arr in windows.values():
            for s in range(0, arr.shape[0], spec.batch):
                x = torch.from_numpy(arr[s : s + spec.batch])
                logits = model(input_ids=x, use_cache=False).logits
                nll = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    x[:, 1:].reshape(-1),
                    reduction="sum",
                )
                total += float(nll)
                n += int(x[:, 1:].numel())
    return total / max(n, 1)


# ============================================================================ evaluate


def unigram_logprobs(data: Data, vocab: int) -> np.ndarray:
    """log p(token) from training-token counts with add-one smoothing."""
    counts = np.bincount(
        np.concatenate([data.train_docs, data.train_chat]).astype(np.int64), minlength=vocab
    ).astype(np.float64)
    logp: np.ndarray = np.log((counts + 1.0) / (counts.sum() + vocab))
    return logp


def _entropy(p: np.ndarray) -> float:
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def routing_stats(
    counts: dict[int, np.ndarray],
    n_layers: int,
    windows: dict[int, list[np.ndarray]] | None = None,
    streams: dict[str, dict[int, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Per-layer expert usage over the held-out set.

    Aggregate: normalized entropy (1 = uniform), effective experts exp(H), max/min share, share
    of the busiest quarter of experts, unused experts. ``windows`` (per layer, one [E] count
    vector per 256-token window) adds the same skew measures within a window, averaged: what a
    per-conversation expert cache sees. ``streams`` (prose vs chat) adds each stream's entropy
    and the Jensen-Shannon divergence between the streams (bits; 0 = same experts)."""
    per_layer: dict[str, Any] = {}
    for i in sorted(counts):
        c = counts[i].astype(np.float64)
        p = c / max(c.sum(), 1.0)
        ent = _entropy(p)
        e = c.size
        quarter = max(1, e // 4)
        top = np.sort(p)[::-1]
        rec: dict[str, Any] = {
            "entropy_norm": ent / math.log(e),
            "effective_experts": math.exp(ent),
            "max_share": float(top[0]),
            "min_share": float(top[-1]),
            "top_quarter_share": float(top[:quarter].sum()),
            "unused": int((c == 0).sum()),
        }
        if windows and windows.get(i):
            w = np.stack(windows[i]).astype(np.float64)  # [W, E]
            pw = w / np.maximum(w.sum(-1, keepdims=True), 1.0)
            rec["window_entropy_norm"] = float(np.mean([_entropy(row) for row in pw]) / math.log(e))
            rec["window_top_quarter_share"] = float(
                np.sort(pw, axis=-1)[:, ::-1][:, :quarter].sum(-1).mean()
            )
            rec["window_distinct_experts"] = float((w > 0).sum(-1).mean())
        if streams and len(streams) == 2 and all(i in v for v in streams.values()):
            ps = [v[i].astype(np.float64) / max(v[i].sum(), 1) for v in streams.values()]
            mix = 0.5 * (ps[0] + ps[1])
            rec["stream_js_bits"] = (_entropy(mix) - 0.5 * (_entropy(ps[0]) + _entropy(ps[1]))) / (
                math.log(2)
            )
            for name, q in zip(streams, ps, strict=True):
                rec[f"{name}_entropy_norm"] = _entropy(q) / math.log(e)
        per_layer["mtp" if i == n_layers else str(i)] = rec
    return per_layer


def evaluate(model: Any, mtp: Any, data: Data, spec: RunSpec, max_seqs: int) -> dict[str, Any]:
    """Held-out metrics of the fp32 model (sparse DSA as configured)."""
    import torch
    import torch.nn.functional as F

    windows = held_out_windows(data, spec.seq, max_seqs)
    uni = torch.from_numpy(unigram_logprobs(data, model.config.vocab_size))
    probe = Probe(model, mtp)
    probe.keep_choices = True
    win_counts: dict[int, list[np.ndarray]] = {}
    stream_counts: dict[str, dict[int, np.ndarray]] = {}
    model.eval()
    mtp.eval()
    res: dict[str, Any] = {"per_stream": {}}
    tot = {
        "nll": 0.0,
        "uni": 0.0,
        "n": 0,
        "mtp_nll": 0.0,
        "mtp_ok": 0,
        "agree": 0,
        "main_ok": 0,
        "m": 0,
    }
    try:
        with torch.no_grad():
            for kind, arr in windows.items():
                s = {k: 0.0 for k in tot}
                for b in range(0, arr.shape[0], spec.batch):
                    x = torch.from_numpy(arr[b : b + spec.batch])
                    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
                    logits = model.lm_head(hidden)
                    tgt = x[:, 1:]
                    s["nll"] += float(
                        F.cross_entropy(
                            logits[:, :-1].reshape(-1, logits.shape[-1]),
                            tgt.reshape(-1),
                            reduction="sum",
                        )
                    )
                    s["uni"] += float(-uni[tgt].sum())
                    s["n"] += int(tgt.numel())
                    main_top = logits.argmax(-1)  # [B, T]
                    s["main_ok"] += int((main_top[:, :-1] == tgt).sum())
                    ml = mtp_logits(model, mtp, x, hidden)[:, :-1]  # rows predicting x[t+2]
                    t2 = x[:, 2:]
                    s["mtp_nll"] += float(
                        F.cross_entropy(
                            ml.reshape(-1, ml.shape[-1]), t2.reshape(-1), reduction="sum"
                        )
                    )
                    draft = ml.argmax(-1)
                    s["mtp_ok"] += int((draft == t2).sum())
                    # greedy speculative acceptance: the draft for t+2 equals the main model's
                    # own argmax at t+1 (teacher-forced on the held-out text)
                    s["agree"] += int((draft == main_top[:, 1:-1]).sum())
                    s["m"] += int(t2.numel())
                    for i, idx in probe.choices.items():
                        n_e = probe.routers[i].num_experts
                        per_w = torch.zeros(x.shape[0], n_e, dtype=torch.long)
                        flat = idx.reshape(x.shape[0], -1)
                        per_w.scatter_add_(1, flat, torch.ones_like(flat))
                        win_counts.setdefault(i, []).extend(per_w.numpy())
                        sc = stream_counts.setdefault(kind, {})
                        sc[i] = sc.get(i, 0) + per_w.sum(0).numpy()
                    probe.choices = {}
                res["per_stream"][kind] = _metrics(s)
                for k in tot:
                    tot[k] += s[k]
        res.update(_metrics(tot))
        res["held_out_sequences"] = {k: int(v.shape[0]) for k, v in windows.items()}
        counts = {i: c.numpy() for i, c in probe.counts.items()}
        res["routing"] = routing_stats(
            counts, model.config.num_hidden_layers, win_counts, stream_counts
        )
    finally:
        probe.close()
    return res


def _metrics(s: dict[str, Any]) -> dict[str, Any]:
    n, m = max(s["n"], 1), max(s["m"], 1)
    ppl = math.exp(s["nll"] / n)
    uni = math.exp(s["uni"] / n)
    return {
        "tokens": int(s["n"]),
        "ppl": ppl,
        "unigram_ppl": uni,
        "ppl_ratio_unigram_over_model": uni / ppl,
        "main_top1": s["main_ok"] / n,
        "mtp_ppl": math.exp(s["mtp_nll"] / m),
        "mtp_top1": s["mtp_ok"] / m,
        "mtp_agrees_with_main": s["agree"] / m,
    }


# ============================================================================ export


def tokenizer_config(data: Data, max_len: int) -> dict[str, Any]:
    added = {
        str(data.special(name)): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"],
        "bos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def export_hf(model: Any, mtp: Any, data: Data, hf_dir: Path) -> dict[str, Any]:
    """Write a standard HF checkpoint dir (BF16 weights, F32 correction bias, MTP layer)."""
    import torch
    from make_oracle import checkpoint_tensors, config_dict
    from safetensors.torch import save_file

    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)
    config = model.config
    tensors = checkpoint_tensors(model, mtp)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = config_dict("glm_moe_dsa", config)
    (hf_dir / "config.json").write_text(_dumps(cfg))
    gen = {
        "bos_token_id": config.bos_token_id,
        "do_sample": False,
        "eos_token_id": list(config.eos_token_id),
        "transformers_version": _version("transformers"),
    }
    (hf_dir / "generation_config.json").write_text(_dumps(gen))
    (hf_dir / "tokenizer.json").write_text(data.tok.to_str(pretty=True) + "\n")
    tcfg = tokenizer_config(data, int(config.max_position_embeddings))
    (hf_dir / "tokenizer_config.json").write_text(_dumps(tcfg))
    n_mtp = sum(
        v.numel()
        for k, v in tensors.items()
        if k.startswith(f"model.layers.{config.num_hidden_layers}.")
    )
    dtypes = sorted({str(v.dtype) for v in tensors.values()})
    bias_f32 = all(
        v.dtype == torch.float32
        for k, v in tensors.items()
        if k.endswith("e_score_correction_bias")
    )
    return {
        "dir": str(hf_dir),
        "bytes": _dir_bytes(hf_dir),
        "params_total": int(sum(v.numel() for v in tensors.values())),
        "params_mtp": int(n_mtp),
        "dtypes": dtypes,
        "correction_bias_f32": bias_f32,
    }


def check_hf(hf_dir: Path, data: Data, spec: RunSpec, model: Any) -> dict[str, Any]:
    """Reload the export with ``AutoModelForCausalLM`` and compare it with the trained model."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    loaded.eval()
    x = torch.from_numpy(held_out_windows(data, spec.seq, 2)["docs"][:2])
    with torch.no_grad():
        a = model(input_ids=x, use_cache=False).logits
        b = loaded(input_ids=x, use_cache=False).logits
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return {"loads": True, "class": type(loaded).__name__, "top1_agreement_vs_fp32": agree}


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def convert_container(hf_dir: Path, dst: Path) -> dict[str, Any]:
    """``storage.convert`` the export (experts/dense int4-g64, embed/head int8, MTP int8)."""
    from storage.container import Container
    from storage.convert import ConvertOptions, convert

    opts = ConvertOptions(experts="int4-g64", dense="int4-g64", io="int8", mtp="int8")
    result = convert(hf_dir, dst, opts, force=True)
    Container.open(dst)  # must open cleanly
    return {
        "dir": str(dst),
        "bytes": _dir_bytes(dst),
        "summary": str(result),
        "options": opts.recorded(),
    }


def container_eval(
    dst: Path, data: Data, spec: RunSpec, max_seqs: int, reference: Any
) -> dict[str, Any]:
    """Perplexity and MTP draft agreement of the quantized container, via colibri's runtime.

    ``reference`` (the trained fp32 transformers model) is scored on the same windows, with the
    top-1 agreement between the two, to show what quantization costs."""
    import torch
    import torch.nn.functional as F

    from runtime.models import load_model
    from storage.container import Container

    model = load_model(Container.open(dst))
    windows = held_out_windows(data, spec.seq, max_seqs)
    uni = unigram_logprobs(data, int(model.config.vocab_size))
    nll = uni_nll = ref_nll = 0.0
    n = agree = mtp_ok = m = same_top = 0
    for arr in windows.values():
        for ids in arr:
            out = model.forward(ids, model.new_cache())
            logits = np.asarray(out.logits, dtype=np.float64)
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            tgt = ids[1:]
            nll += float((lse[:-1] - logits[np.arange(len(tgt)), tgt]).sum())
            uni_nll += float(-uni[tgt].sum())
            n += len(tgt)
            with torch.no_grad():
                x = torch.from_numpy(ids[None])
                ref = reference(input_ids=x, use_cache=False).logits[0]
                ref_nll += float(F.cross_entropy(ref[:-1], x[0, 1:], reduction="sum"))
            same_top += int((ref.argmax(-1).numpy()[:-1] == logits.argmax(-1)[:-1]).sum())
            if model.has_mtp:
                ml = model.mtp_forward(np.asarray(out.hidden[:-1]), ids[1:], model.new_mtp_cache())
                draft = np.asarray(ml).argmax(-1)[:-1]
                main_top = logits.argmax(-1)
                agree += int((draft == main_top[1:-1]).sum())
                mtp_ok += int((draft == ids[2:]).sum())
                m += len(draft)
    ppl = math.exp(nll / max(n, 1))
    return {
        "tokens": n,
        "ppl": ppl,
        "fp32_ppl_same_windows": math.exp(ref_nll / max(n, 1)),
        "top1_agreement_vs_fp32": same_top / max(n, 1),
        "unigram_ppl": math.exp(uni_nll / max(n, 1)),
        "mtp_top1": mtp_ok / max(m, 1),
        "mtp_agrees_with_main": agree / max(m, 1),
    }


def _greedy_reference(model: Any, ids: list[int], max_new: int, stops: set[int]) -> list[int]:
    """Greedy continuation with the fp32 transformers model (full forward per step)."""
    import torch

    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            if tok in stops:
                break
            seq.append(tok)
    return out


def samples(dst: Path, state_dir: Path, reference: Any, max_new: int = 60) -> list[dict[str, Any]]:
    """Greedy generations from the container through ``colibri.open_model``, next to the fp32
    transformers model's (``reference``) greedy tokens for the same prompt.

    Routing statistics are not learned and runtime state goes to ``state_dir``, so the container
    directory stays exactly as the converter wrote it."""
    import colibri
    from colibri.tokenizer import ChatTokenizer
    from storage.container import Container

    c = Container.open(dst)
    tok_path = c.tokenizer_path()
    if tok_path is None:
        raise RuntimeError(f"{dst}: the container has no tokenizer.json")
    tok = ChatTokenizer(tok_path, c.tokenizer_config())
    stops = {int(t) for t in c.eos_token_ids}
    prompts = [(p, tok.encode_chat([{"role": "user", "content": p}])) for p in SAMPLE_PROMPTS]
    prompts.append((RAW_PROMPT, tok.encode(RAW_PROMPT)))
    out: list[dict[str, Any]] = []
    with colibri.open_model(dst, learn=False, state_dir=state_dir) as m:
        for i, (prompt, ids) in enumerate(prompts):
            gen = m.generate(ids, max_new_tokens=max_new, temperature=0.0)
            ref = _greedy_reference(reference, ids, max_new, stops)
            pairs = enumerate(zip(gen, ref, strict=False))
            same = next((j for j, (a, b) in pairs if a != b), min(len(gen), len(ref)))
            out.append(
                {
                    "prompt": prompt,
                    "chat": i < len(SAMPLE_PROMPTS),
                    "completion": tok.decode(gen),
                    "fp32_completion": tok.decode(ref),
                    "tokens": len(gen),
                    "same_tokens_as_fp32": same,
                }
            )
    return out


# ============================================================================ report


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``OUT/report.json`` (everything) and a short human ``OUT/report.md``."""
    _atomic_write(out / "report.json", _dumps(report).encode())
    ev = report.get("eval", {})
    ce = report.get("container_eval", {})
    lines = [
        "# colibri demo model: training report",
        "",
        f"- steps {report['train']['steps']}, tokens {report['train']['tokens']:,}, "
        f"train time {report['train']['train_minutes']:.1f} min, "
        f"threads {report['threads']}",
    ]
    if ev:
        lines.append(
            f"- held-out ppl {ev['ppl']:.2f} vs unigram {ev['unigram_ppl']:.2f} "
            f"(x{ev['ppl_ratio_unigram_over_model']:.2f}); MTP top-1 {ev['mtp_top1']:.3f}, "
            f"MTP agrees with main {ev['mtp_agrees_with_main']:.3f}"
        )
        for kind, s in ev["per_stream"].items():
            lines.append(
                f"  - {kind}: ppl {s['ppl']:.2f} vs unigram {s['unigram_ppl']:.2f}, "
                f"{s['tokens']:,} tokens"
            )
        lines.append("- routing (held-out; per layer):")
        for name, r in ev["routing"].items():
            win = (
                f"; per window: entropy {r['window_entropy_norm']:.3f}, top quarter "
                f"{r['window_top_quarter_share']:.3f}, distinct {r['window_distinct_experts']:.1f}"
                if "window_entropy_norm" in r
                else ""
            )
            lines.append(
                f"  - {name}: entropy {r['entropy_norm']:.3f}, top quarter "
                f"{r['top_quarter_share']:.3f}, max {r['max_share']:.3f}, "
                f"min {r['min_share']:.4f}{win}"
            )
    if ce:
        lines.append(
            f"- container (int4-g64/int8) ppl {ce['ppl']:.2f} vs fp32 "
            f"{ce['fp32_ppl_same_windows']:.2f} on the same {ce['tokens']:,} tokens "
            f"(top-1 agreement {ce['top1_agreement_vs_fp32']:.3f}; unigram "
            f"{ce['unigram_ppl']:.2f}); MTP agrees with main {ce['mtp_agrees_with_main']:.3f}"
        )
    if "container" in report:
        lines.append(f"- container {report['container']['bytes'] / 1e6:.1f} MB")
    for s in report.get("samples", []):
        lines += [
            "",
            f"**{s['prompt']}** (colibri, int4 container; first {s['same_tokens_as_fp32']} of "
            f"{s['tokens']} tokens equal to fp32 transformers)",
            "",
            "    " + s["completion"].replace("\n", "\n    "),
        ]
    _atomic_write(out / "report.md", ("\n".join(lines) + "\n").encode())


# ============================================================================ main


def make_spec(args: argparse.Namespace) -> RunSpec:
    shapes = dict(PRESETS[args.preset])
    for key in ("steps", "batch", "seq", "warmup"):
        val = getattr(args, key)
        if val is not None:
            shapes[key] = val
    extra: dict[str, Any] = {
        "seed": args.seed,
        "docs_root": args.docs_root,
        "chatterbot": not args.no_chatterbot,
        "max_pages": args.max_pages,
    }
    if args.lr is not None:
        extra["lr"] = args.lr
    return RunSpec(preset=args.preset, **shapes, **extra)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="work dir (data, ckpt, hf, container)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=55.0,
        help="stop training cleanly (checkpoint) after this much wall time",
    )
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--docs-root",
        default="auto",
        help="CPython HTML docs dir, 'auto' (search) or 'none' (pydoc topics only)",
    )
    p.add_argument("--no-chatterbot", action="store_true", help="skip chatterbot-corpus")
    p.add_argument("--max-pages", type=int, default=None, help="read only N docs pages")
    p.add_argument("--eval-seqs", type=int, default=384, help="held-out windows to evaluate")
    p.add_argument("--container-eval-seqs", type=int, default=24)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="stop (with a checkpoint) after this step, as if out of time",
    )
    p.add_argument("--no-export", action="store_true", help="train only")
    p.add_argument("--restart", action="store_true", help="discard an existing checkpoint")
    return p.parse_args(list(argv) if argv is not None else None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    spec = make_spec(args)
    if args.restart and (out / "ckpt").exists():
        shutil.rmtree(out / "ckpt")
    _log(f"spec: {json.dumps(dataclasses.asdict(spec), sort_keys=True)}")
    data = prepare_data(out, spec)
    config = build_config(spec, data)
    model, mtp = build_models(spec, config)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    _log(f"model: {n_main / 1e6:.2f}M params + MTP {n_mtp / 1e6:.2f}M, vocab {config.vocab_size}")
    deadline = start + args.max_minutes * 60
    st, finished = train(
        out,
        spec,
        data,
        model,
        mtp,
        deadline=deadline,
        ckpt_seconds=args.ckpt_minutes * 60,
        stop_after=args.stop_after_steps,
        log_every=args.log_every,
    )
    if not finished or args.no_export:
        return 0
    torch.manual_seed(spec.seed)
    report: dict[str, Any] = {
        "spec": dataclasses.asdict(spec),
        "threads": args.threads,
        "versions": {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
            "python": sys.version.split()[0],
        },
        "params": {"main": n_main, "mtp": n_mtp},
        "data": {k: data.meta[k] for k in ("sources", "stats", "tokens", "docs_root")},
        "train": {
            "steps": st.step,
            "tokens": st.tokens,
            "train_minutes": st.train_seconds / 60,
            "epochs": Batcher(data, spec).epochs(st.step),
            "history": st.history,
        },
    }
    t0 = time.monotonic()
    report["eval"] = evaluate(model, mtp, data, spec, args.eval_seqs)
    ev = report["eval"]
    _log(
        f"eval: held-out ppl {ev['ppl']:.2f} vs unigram {ev['unigram_ppl']:.2f} "
        f"(x{ev['ppl_ratio_unigram_over_model']:.2f}), MTP top-1 {ev['mtp_top1']:.3f}, "
        f"MTP agrees with main {ev['mtp_agrees_with_main']:.3f} "
        f"({time.monotonic() - t0:.0f} s)"
    )
    for name, r in ev["routing"].items():
        _log(
            f"routing layer {name}: entropy {r['entropy_norm']:.3f} "
            f"(effective {r['effective_experts']:.1f}/{spec.experts}), "
            f"max {r['max_share']:.3f}, min {r['min_share']:.4f}, unused {r['unused']}"
        )
    hf_dir, cont_dir = out / "hf", out / "container"
    report["hf"] = export_hf(model, mtp, data, hf_dir)
    report["hf"].update(check_hf(hf_dir, data, spec, model))
    _log(f"export: {json.dumps(report['hf'])}")
    report["container"] = convert_container(hf_dir, cont_dir)
    _log(f"container: {report['container']['summary']}")
    t0 = time.monotonic()
    report["container_eval"] = container_eval(cont_dir, data, spec, args.container_eval_seqs, model)
    _log(f"container eval: {json.dumps(report['container_eval'])} ({time.monotonic() - t0:.0f} s)")
    report["samples"] = samples(cont_dir, out / "runtime-state", model)
    for s in report["samples"]:
        _log(
            f"sample {s['prompt']!r} -> {s['completion']!r} (first {s['same_tokens_as_fp32']} "
            f"of {s['tokens']} tokens as fp32: {s['fp32_completion']!r})"
        )
    write_report(out, report)
    _log(f"done: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

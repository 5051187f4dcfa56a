"""``coli plan``: how a RAM budget splits for a model, decided from the headers alone.

The plan makes exactly the decisions ``Engine.open`` makes (same formulas, same functions:
:func:`runtime.experts.plan_layout`, :func:`runtime.policies.choose_pinned`) but reads no
weights: the dense size is computed from the container's tensor entries instead of measured on
the loaded arrays.

Dense estimate. Every non-expert tensor the model loads is kept as stored (int4/int8 packed bytes
plus f32 scales, f32 matrices as is) except 1-D tensors and the fp32 router, which are read as
float32 (BF16 ones double); on top of that the MLA absorption keeps ``W_UK[h]^T`` of every
attention layer as float32 (``4 * heads * kv_lora * qk_nope`` bytes per layer, see
``runtime/weights._mla``) unless ``kv_b_proj`` is int4 in a form the absorption kernel reads as
it is stored (``HeadsMatmul.int4_axpy_fits``). On the bundled demo model and on the synthetic
GLM-5-geometry containers this equals ``runtime.budget.resident_nbytes`` of the loaded weights
to the byte (tests/test_plan.py checks it).

Projection. With uniform routing an expert is resident with probability
``(pinned + lru_slots * layers) / (experts * layers)``: that is the projected hit rate. Per
decoded token the plan estimates the bytes read from disk (the misses) and the weight bytes
multiplied (dense + top-k experts per MoE layer) and names the bottleneck:

* ``memory``: the cache holds fewer experts per layer than one token routes to, so nearly every
  expert is read again for every token; only more RAM helps;
* ``disk misses``: reading the missed experts takes longer than the matmuls;
* ``compute``: the matmuls take longer than the reads (or nothing is read).

Speeds are assumptions unless given (:data:`ASSUMED_DISK_GBPS`, :data:`ASSUMED_COMPUTE_GBPS`);
``coli bench storage`` and ``coli bench kernels`` measure them on the machine at hand.

Shape legend: L MoE layers, E routed experts per layer, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from runtime.budget import kv_bytes_per_token, mem_available
from runtime.experts import StoreLayout, plan_layout
from runtime.kernels.heads import HeadsMatmul
from runtime.policies import choose_pinned
from storage.arch import classify
from storage.container import Container
from storage.errors import ColibriError
from storage.units import format_bytes as _size  # one size format

__all__ = [
    "ASSUMED_COMPUTE_GBPS",
    "ASSUMED_DISK_GBPS",
    "AUTO_FRACTION",
    "Plan",
    "dense_estimate",
    "make_plan",
]

AUTO_FRACTION = 0.88  # share of MemAvailable an automatic budget takes (as Engine.open)
ASSUMED_DISK_GBPS = 1.5  # cold 19 MiB random reads on one NVMe / virtio disk (benchmarks.md)
ASSUMED_COMPUTE_GBPS = 9.0  # int4-g64 GEMV weight bytes per second on one core (benchmarks.md)

Bottleneck = Literal["disk misses", "memory", "compute"]


def _ms(seconds: float) -> str:
    ms = 1000 * seconds
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def dense_estimate(c: Container) -> tuple[int, int]:
    """(stored bytes, derived float32 bytes) the engine keeps resident for ``c``'s dense part.

    Stored: every tensor that is not a routed expert, as the loader keeps it. Derived: the
    float32 ``W_UK^T`` absorption copies of the attention layers whose ``kv_b_proj`` the
    absorption kernel does not read as stored."""
    arch = c.arch
    stored = 0
    derived = 0
    for name in c.names():
        role = classify(name, arch)
        if role is None or role.expert is not None:
            continue  # unknown names are not loaded; routed experts are not dense
        ent = c.entry(name)
        n = math.prod(ent.shape)
        if ent.fmt is None or name.endswith(".mlp.gate.weight"):
            stored += 4 * n  # read with load_f32: float32 whatever the stored dtype
        elif ent.fmt.kind in ("bf16", "f16"):
            stored += ent.weight.nbytes  # kept as raw 16-bit words
        else:
            stored += ent.nbytes
        if name.endswith(".self_attn.kv_b_proj.weight") and not (
            ent.fmt is not None
            and ent.fmt.kind == "int4"
            and HeadsMatmul.int4_axpy_fits(arch.kv_lora_rank, ent.fmt.group_size)
        ):  # (an int4 W_UK is read as it is stored: no copy)
            derived += 4 * arch.num_attention_heads * arch.kv_lora_rank * arch.qk_nope_head_dim
    return stored, derived


@dataclass(frozen=True)
class Plan:
    """What ``Engine.open`` would allocate for a budget, and what to expect from it."""

    model: str
    mode: Literal["resident", "streaming"]
    ram_budget_bytes: int | None  # None: automatic and everything resident
    budget_source: Literal["given", "auto"]
    mem_available_bytes: int | None
    dense_bytes: int
    dense_stored_bytes: int
    dense_derived_bytes: int
    kv_reserve_tokens: int
    kv_bytes_per_token: int
    kv_reserve_bytes: int
    expert_budget_bytes: int | None
    moe_layers: int  # layers with routed experts, MTP layers included (each gets cache slots)
    mtp_layers: int
    experts_per_layer: int
    top_k: int
    expert_bytes: int  # one expert as read: blob + scales
    slot_bytes: int  # one pinned or cache slot of a main layer (aligned blob + scales buffers)
    transient_slots: int
    lru_slots_per_layer: int
    pinned: int
    experts_slots_bytes: int
    projected_hit_rate: float
    min_ram_bytes: int  # dense + KV reserve + the transient slots: the smallest working budget
    full_residency_ram_bytes: int  # a budget that gives every expert a slot
    per_token: dict[str, float]
    bottleneck: Bottleneck
    why: str
    suggested: dict[str, Any]
    # outside the budget: a prefill chunk's activations (the engine's default chunk)
    prefill_chunk: int = 0
    prefill_activation_bytes: int = 0
    # a transient slot (any layer's largest expert) and an MTP layer's cache slot: larger
    # than ``slot_bytes`` where the MTP experts are int8 (0: no MTP layer)
    transient_slot_bytes: int = 0
    mtp_slot_bytes: int = 0
    assumptions: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # e.g. a budget past MemAvailable
    layout: StoreLayout | None = field(default=None, repr=False)  # what the engine allocates

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the slot layout itself excepted)."""
        d = asdict(self)
        d.pop("layout", None)
        return d

    def render_lines(self) -> list[str]:
        """The plan for people, one fact per line."""
        budget = (
            "auto: every expert fits, all resident"
            if self.ram_budget_bytes is None
            else f"{_size(self.ram_budget_bytes)} ({self.budget_source})"
        )
        lines = [
            f"model          {self.model}",
            f"RAM budget     {budget}"
            + (
                f"; MemAvailable {_size(self.mem_available_bytes)}"
                if self.mem_available_bytes is not None
                else ""
            ),
            f"dense          {_size(self.dense_bytes)} ({_size(self.dense_stored_bytes)} stored"
            f" + {_size(self.dense_derived_bytes)} f32 derived)",
            f"KV reserve     {_size(self.kv_reserve_bytes)} ({self.kv_reserve_tokens} tokens x "
            f"{self.kv_bytes_per_token:,} B)",
            f"experts        {self.moe_layers} layers"
            + (f" ({self.mtp_layers} MTP)" if self.mtp_layers else "")
            + f" x {self.experts_per_layer}, top-"
            f"{self.top_k}, {_size(self.expert_bytes)} each ({_size(self.slot_bytes)} per slot"
            + (
                f"; {_size(self.mtp_slot_bytes)} in the MTP layer"
                if self.mtp_slot_bytes and self.mtp_slot_bytes != self.slot_bytes
                else ""
            )
            + (
                f"; {_size(self.transient_slot_bytes)} per transient slot"
                if self.transient_slot_bytes != self.slot_bytes and self.mode == "streaming"
                else ""
            )
            + ")",
        ]
        if self.mode == "resident":
            lines.append("tiers          every expert resident in RAM (no streaming)")
        else:
            lines.append(
                f"tiers          {self.pinned} pinned + {self.lru_slots_per_layer} cache slots "
                f"per layer + {self.transient_slots} transient = {_size(self.experts_slots_bytes)}"
            )
        lines += [
            f"hit rate       {100 * self.projected_hit_rate:.1f} % projected (uniform routing)",
            f"per token      {_size(self.per_token['disk_bytes'])} from disk "
            f"(~{_ms(self.per_token['disk_s'])}), "
            f"{_size(self.per_token['compute_bytes'])} multiplied "
            f"(~{_ms(self.per_token['compute_s'])})",
            f"bottleneck     {self.bottleneck}: {self.why}",
            f"minimum RAM    {_size(self.min_ram_bytes)}; every expert cached at "
            f"{_size(self.full_residency_ram_bytes)}",
            f"outside budget prefill activations of about "
            f"{_size(self.prefill_activation_bytes)} ({self.prefill_chunk}-token chunks; "
            f"--prefill-chunk lowers it); KV at {self.kv_bytes_per_token:,} B a token for "
            f"contexts beyond the reserved one (concurrent sequences, server KV slots, past "
            f"{self.kv_reserve_tokens} tokens); the interpreter",
            "suggested      "
            + " ".join(
                f"{k}={('on' if v else 'off') if isinstance(v, bool) else v}"
                for k, v in self.suggested.items()
            ),
        ]
        lines += [f"warning        {w}" for w in self.warnings]
        return lines


def make_plan(
    c: Container,
    ram_budget: int | None = None,
    *,
    kv_reserve_tokens: int = 4096,
    pin: bool = True,
    pin_fraction: float = 0.5,
    pin_min_selections: int = 5000,
    usage_counts: npt.NDArray[np.int64] | None = None,
    available: int | None = None,
    disk_gbps: float = ASSUMED_DISK_GBPS,
    compute_gbps: float = ASSUMED_COMPUTE_GBPS,
) -> Plan:
    """The plan ``Engine.open`` would follow for ``c`` under ``ram_budget`` (None = automatic).

    ``usage_counts`` [layers, E]: the `.coli_usage` history (pinned experts, as the engine
    chooses them); ``available``: MemAvailable (default: read from /proc/meminfo). Raises
    :class:`ColibriError` when the budget cannot hold the dense part, the KV reserve and the
    transient slots, naming the minimum."""
    arch = c.arch
    stored, derived = dense_estimate(c)
    dense = stored + derived
    ctx = int(c.config.get("max_position_embeddings") or kv_reserve_tokens)
    kv_tokens = min(kv_reserve_tokens, ctx)
    kv_per_token = kv_bytes_per_token(arch)
    kv_reserve = kv_per_token * kv_tokens
    layers = c.expert_layers()
    n_layers = len(layers)
    n_e = int(arch.n_routed_experts)
    top_k = c.arch.top_k
    all_experts = c.expert_nbytes * n_e * n_layers  # Engine.open's residency test
    avail = mem_available() if available is None else available
    full = plan_layout(c, None, top_k=top_k)  # slot sizes, transient count; nothing allocated
    slot = full.slot_bytes  # a transient slot: any layer's largest expert
    transient = full.transient_slots
    floor = dense + kv_reserve + transient * slot
    full_ram = floor + n_e * sum(full.layer_slot_bytes(la) for la in layers)
    main_layers = [la for la in layers if la < arch.num_hidden_layers]
    main_slot = max((full.layer_slot_bytes(la) for la in main_layers), default=slot)
    mtp_slot = max((full.layer_slot_bytes(la) for la in layers if la not in main_layers), default=0)
    ext = c.expert_extents()
    expert_bytes = (
        ext[0].nbytes + sum(s.nbytes for s in ext[0].scales.values() if s is not None) if ext else 0
    )

    source: Literal["given", "auto"] = "given" if ram_budget is not None else "auto"
    budget = ram_budget
    resident = False
    if budget is None:
        if avail is None or dense + kv_reserve + all_experts <= AUTO_FRACTION * avail:
            resident = True
        else:
            budget = int(AUTO_FRACTION * avail)

    pinned = 0
    lru = n_e
    expert_budget: int | None = None
    slots_bytes = all_experts
    layout: StoreLayout | None = None
    if not resident:
        assert budget is not None
        expert_budget = budget - dense - kv_reserve
        if expert_budget <= 0 or expert_budget < transient * slot:
            have, need = _size(budget), _size(floor)
            if have == need:  # rounded alike: say it in bytes rather than "11.6 < 11.6"
                have, need = f"{budget:,} bytes", f"{floor:,} bytes"
            raise ColibriError(
                f"a RAM budget of {have} is too small for {c.path.name}: the dense part "
                f"needs {_size(dense)}, the KV reserve {_size(kv_reserve)} and streaming "
                f"{transient} transient slots of {_size(slot)}; the minimum is "
                f"{need} (--ram {math.ceil(floor / 2**20)}MiB)"
            )
        chosen: list[tuple[int, int]] = []
        if pin and usage_counts is not None:
            max_pin = int(pin_fraction * (expert_budget - transient * slot))
            chosen = choose_pinned(
                usage_counts, layers, max(0, max_pin // main_slot), min_total=pin_min_selections
            )
            # (a pin costs its layer's slot: keep the ones that fit in the pinned share)
            spent = 0
            for i, key in enumerate(chosen):
                spent += full.layer_slot_bytes(key[0])
                if spent > max_pin:
                    chosen = chosen[:i]
                    break
        layout = plan_layout(c, expert_budget, top_k=top_k, pinned=chosen)
        assert layout is not None
        pinned = len(layout.pinned)
        lru = layout.lru_slots_per_layer
        slots_bytes = layout.nbytes

    total = n_e * n_layers
    hit = 1.0 if resident or total == 0 else min(1.0, (pinned + lru * n_layers) / total)
    decode_layers = [la for la in layers if la < arch.num_hidden_layers]  # MTP runs no decode
    routed = top_k * len(decode_layers)
    disk_bytes = (1.0 - hit) * routed * expert_bytes
    active_dense = dense - _embed_bytes(c)  # a token reads one embedding row, all else once
    compute_bytes = float(active_dense + routed * expert_bytes)
    disk_s = disk_bytes / (disk_gbps * 1e9)
    compute_s = compute_bytes / (compute_gbps * 1e9)
    per_token = {
        "disk_bytes": disk_bytes,
        "disk_s": disk_s,
        "compute_bytes": compute_bytes,
        "compute_s": compute_s,
        "tokens_per_s": 1.0 / max(disk_s, compute_s) if max(disk_s, compute_s) > 0 else 0.0,
    }
    per_layer = lru + pinned / max(n_layers, 1)
    bottleneck: Bottleneck
    if not resident and per_layer < top_k and hit < 1.0:
        bottleneck = "memory"
        why = (
            f"the budget leaves {per_layer:.1f} cache slots per layer, fewer than the {top_k} "
            f"experts each token routes to, so almost every expert is read again for every "
            f"token ({_size(disk_bytes)}, ~{_ms(disk_s)}); more RAM is the lever "
            f"(every expert cached at {_size(full_ram)})"
        )
    elif disk_s > compute_s:
        bottleneck = "disk misses"
        why = (
            f"with {100 * hit:.0f} % of experts resident a token misses "
            f"~{(1 - hit) * routed:.1f} of its {routed} experts: {_size(disk_bytes)} from disk "
            f"take ~{_ms(disk_s)} at {disk_gbps:g} GB/s against ~{_ms(compute_s)} "
            f"of matmuls"
        )
    else:
        bottleneck = "compute"
        why = (
            f"a token multiplies {_size(compute_bytes)} of weights, ~{_ms(compute_s)} "
            f"at {compute_gbps:g} GB/s per core, "
            + (
                "and no expert is read from disk"
                if disk_bytes == 0
                else f"more than the ~{_ms(disk_s)} of expert reads"
            )
        )
    warnings: list[str] = []
    takes = dense + kv_reserve + slots_bytes  # what the plan allocates
    if source == "given" and avail is not None and takes > avail:
        warnings.append(
            f"this plan takes {_size(takes)}, more than the {_size(avail)} this machine has "
            f"available (MemAvailable): it may swap or be killed for memory; use --ram "
            f"{math.floor(AUTO_FRACTION * avail / 2**20)}MiB or less (or --ram auto)"
        )
    suggested: dict[str, Any] = {
        "ram": "auto" if resident else f"{math.ceil((min(budget or 0, full_ram)) / 2**20)}MiB",
        "prefetch": "off" if resident else "auto",
        "pin": not resident,
        "reader": "auto",
    }
    if bottleneck != "compute" and avail is not None:
        # More RAM than the budget is there: suggest what fits, up to every expert cached.
        more = min(int(AUTO_FRACTION * avail), full_ram)
        if budget is not None and more > budget:
            suggested["ram"] = f"{math.ceil(more / 2**20)}MiB"
    chunk = choose_prefill_chunk(
        c.arch.hidden_size, top_k, streaming=not resident, ram_budget=ram_budget, context=ctx
    )
    return Plan(
        model=str(c.path),
        mode="resident" if resident else "streaming",
        ram_budget_bytes=budget,
        budget_source=source,
        mem_available_bytes=avail,
        dense_bytes=dense,
        dense_stored_bytes=stored,
        dense_derived_bytes=derived,
        kv_reserve_tokens=kv_tokens,
        kv_bytes_per_token=kv_per_token,
        kv_reserve_bytes=kv_reserve,
        expert_budget_bytes=expert_budget,
        moe_layers=n_layers,
        mtp_layers=n_layers - len(decode_layers),
        experts_per_layer=n_e,
        top_k=top_k,
        expert_bytes=expert_bytes,
        slot_bytes=main_slot,
        transient_slot_bytes=slot,
        mtp_slot_bytes=mtp_slot,
        transient_slots=0 if resident else transient,
        lru_slots_per_layer=lru,
        pinned=pinned,
        experts_slots_bytes=slots_bytes,
        projected_hit_rate=hit,
        min_ram_bytes=floor,
        full_residency_ram_bytes=full_ram,
        per_token=per_token,
        bottleneck=bottleneck,
        why=why,
        suggested=suggested,
        assumptions={
            "disk_gbps": disk_gbps,
            "compute_gbps": compute_gbps,
            "auto_fraction": AUTO_FRACTION,
            "routing": "uniform",
            "dense": "stored non-expert tensors + f32 copies (1-D, router, W_UK^T absorption)",
        },
        prefill_chunk=chunk,
        prefill_activation_bytes=chunk * activation_bytes_per_token(c.arch.hidden_size, top_k),
        warnings=warnings,
        layout=layout,
    )


def _embed_bytes(c: Container) -> int:
    name = "model.embed_tokens.weight"
    return c.entry(name).nbytes if c.has(name) else 0


#: Prefill chunk when every expert is resident (no reads to save: larger chunks only cost memory).
PREFILL_CHUNK_RESIDENT = 512
#: Largest automatic prefill chunk.
PREFILL_CHUNK_MAX = 4096


def activation_bytes_per_token(hidden_size: int, top_k: int) -> int:
    """Float32 bytes a prefill chunk holds per token at its widest point (the MoE step): the
    residual, normed input and attention output rows plus one [K, D] row of routed-expert
    outputs awaiting their fixed-order sum, with headroom for temporaries (x 2)."""
    return 4 * hidden_size * (4 + top_k) * 2


def choose_prefill_chunk(
    hidden_size: int,
    top_k: int,
    *,
    streaming: bool,
    ram_budget: int | None,
    context: int | None = None,
) -> int:
    """Tokens per prefill chunk (the engine's default; ``prefill_chunk`` overrides it).

    Streaming, a chunk reads every expert it routes to once, so a bigger chunk reads less per
    prompt token and gives each expert more rows per matmul: take the largest power of two up to
    :data:`PREFILL_CHUNK_MAX` whose activations fit an allowance of 1/8 of the RAM budget (at
    least 256 MiB). Resident, :data:`PREFILL_CHUNK_RESIDENT`. Never more than the model's
    ``context`` (no prompt is longer: a bigger chunk only overstated its activations)."""
    chunk = PREFILL_CHUNK_RESIDENT
    if streaming:
        allowance = max(256 << 20, (ram_budget or 0) // 8)
        per_token = activation_bytes_per_token(hidden_size, top_k)
        while chunk * 2 <= PREFILL_CHUNK_MAX and chunk * 2 * per_token <= allowance:
            chunk *= 2
    return min(chunk, context) if context else chunk

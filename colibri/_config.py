"""Engine options and the one place environment variables are read.

Every environment variable maps to a CLI flag and an :class:`EngineOptions` field:

=================  ==================  ======================
variable           flag                field
=================  ==================  ======================
COLI_MODEL         --model             model
COLI_RAM           --ram               ram_budget
COLI_READER        --reader            reader
COLI_PREFETCH      --prefetch MODE     prefetch (auto | on | off; --no-prefetch = off)
COLI_STATE_DIR     --state-dir         state_dir
COLI_MIRROR        --mirror (repeat)   mirror (os.pathsep-separated in the variable)
COLI_MODEL_DIRS    --model-dir (rep.)  model_dirs (os.pathsep-separated in the variable)
COLI_DISK_WEIGHTS  --disk-weights      disk_weights
COLI_DRAFT         --draft             draft (auto | off | N | mtp[:N] | lookup[:N])
COLI_THREADS       --threads           threads (compute threads for routed experts)
COLI_KERNELS       --kernels           kernels (exact | fast-int8, the labelled lossy mode)
COLI_VERIFY_READS  --verify-reads      verify_reads (CRC-32 of every expert read)
COLI_RAY           --ray               ray (local | a Ray cluster address)
COLI_LOG_FORMAT    --log-format        (logging: console|json)
=================  ==================  ======================
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from storage.errors import ColibriError, OptionsError

__all__ = ["ENV_VARS", "EngineOptions", "default_model_path", "env_defaults", "parse_bytes"]

ENV_VARS = {
    "COLI_MODEL": "model",
    "COLI_RAM": "ram_budget",
    "COLI_READER": "reader",
    "COLI_PREFETCH": "prefetch",
    "COLI_STATE_DIR": "state_dir",
    "COLI_MIRROR": "mirror",
    "COLI_MODEL_DIRS": "model_dirs",
    "COLI_DISK_WEIGHTS": "disk_weights",
    "COLI_DRAFT": "draft",
    "COLI_THREADS": "threads",
    "COLI_KERNELS": "kernels",
    "COLI_VERIFY_READS": "verify_reads",
    "COLI_RAY": "ray",
    "COLI_LOG_FORMAT": "log_format",
}

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip


def parse_bytes(text: str | int | None) -> int | None:
    """``"6GiB"`` -> 6442450944; ``None``/``"auto"`` -> None; plain ints are bytes."""
    if text is None or isinstance(text, int):
        return text
    t = text.strip().lower().replace(" ", "")
    if t in ("", "auto", "none"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", t)
    if not m or m.group(2) not in _UNITS or len(m.group(1)) > 30:
        raise ColibriError(f"cannot read {text!r} as a size; write e.g. 6GiB, 512MiB, 2000000000")
    # exact decimal arithmetic: "1.5GiB" is 1610612736 bytes; "1.9" (bytes) is no whole number
    # of bytes, rather than 1 byte
    n = Decimal(m.group(1)) * _UNITS[m.group(2)]
    if n != n.to_integral_value():
        raise ColibriError(f"{text!r} is not a whole number of bytes; write e.g. 6GiB, 512MiB")
    return int(n)


def default_model_path() -> Path:
    """The model bundled inside the package (used when no --model / COLI_MODEL is given)."""
    return Path(__file__).resolve().parent / "demo" / "model"


class EngineOptions(BaseModel):
    """How to open a model. All fields have CLI flags; see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, /, **data: Any) -> None:
        """A bad value is an :class:`~storage.errors.OptionsError` (a ``ColibriError`` and a
        ``ValueError``) in one line naming each option, not pydantic's ``ValidationError``."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise OptionsError(
                "; ".join(
                    f"{'.'.join(str(x) for x in e.get('loc', ())) or 'options'}: {e.get('msg', '')}"
                    for e in exc.errors()
                )
            ) from None

    model: Path | None = None
    ram_budget: int | None = None
    reader: Literal["auto", "uring", "threads", "buffered"] = "auto"
    # Lookahead reads of the next layer's predicted experts: "auto" keeps them per layer only
    # while they save more read time than they cost (runtime.policies.tiers); "on" / "off".
    prefetch: Literal["auto", "on", "off"] = "auto"
    kv_reserve_tokens: int = Field(default=4096, ge=1)
    # Prompt tokens per prefill step; None: runtime.planner.choose_prefill_chunk (512 when
    # resident, up to 4096 when streaming, within 1/8 of the RAM budget).
    prefill_chunk: int | None = None
    max_batch: int = Field(default=8, ge=1)
    # Faster, not bit-exact prefill: attention form chosen per step and, for experts receiving
    # at least fast_prefill_rows rows of a chunk, dequantized tiles + BLAS.
    fast_prefill: bool = False
    fast_prefill_rows: int = Field(default=40, ge=1)
    # Worker threads computing routed experts in parallel (None: one per CPU this process may
    # use). Results are bit-identical for every count.
    threads: int | None = None
    # Matmul kernels: "exact" (bit-exact, batch-invariant) or "fast-int8", the opt-in lossy mode
    # that rounds activations to two int8 digits for int4 weights (VNNI where the CPU has it).
    # Lossy: greedy tokens may differ from exact; stats(), /health and `coli info` say so.
    kernels: Literal["exact", "fast-int8"] = "exact"
    state_dir: Path | None = None
    pin: bool = True
    pin_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    pin_min_selections: int = Field(default=5000, ge=0)
    repin: bool = False
    learn: bool = True
    # Several SSDs (storage/multidisk/): read copies, primary-first weights (None: probed),
    # run-time adaptation of the weights, and striping of reads at least this large (0: off).
    mirror: tuple[Path, ...] = ()
    # Shards spread over several directories (storage/container.py): searched after `model`.
    model_dirs: tuple[Path, ...] = ()
    disk_weights: tuple[float, ...] | None = None
    disk_adapt: bool = True
    stripe_min_bytes: int = Field(default=0, ge=0)
    # Speculative decoding (runtime/speculative/): "auto" lets the cost model decide.
    draft: str = "auto"
    # Every expert read checked against the manifest's CRC-32s (storage/integrity.py); resident
    # experts are checked once as they load.
    verify_reads: bool = False
    # Scale-out (runtime/cluster/): routed experts sharded over Ray actors. "local" starts Ray
    # on this machine, an address ("ray://host:10001", "host:6379", "auto") joins a cluster.
    ray: str | None = None
    expert_workers: int = 2
    worker_ram: int | None = None  # each worker's RAM budget (None: its host's share of 88%)
    worker_threads: int | None = None  # each worker's compute threads (None: its host's share)
    worker_model: Path | None = None  # the model directory on the workers' hosts (default: model)
    expert_timeout: float = 10.0  # seconds a step waits for a worker before computing it here

    @field_validator("prefetch", mode="before")
    @classmethod
    def _prefetch(cls, v: object) -> object:
        """True / False (the old boolean field) and the usual words mean on / off."""
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, str):
            word = v.strip().lower()
            if word in ("1", "true", "yes"):
                return "on"
            if word in ("0", "false", "no"):
                return "off"
            return word
        return v

    @field_validator("draft", mode="before")
    @classmethod
    def _draft(cls, v: object) -> str:
        from runtime.speculative import DraftPolicy

        return str(DraftPolicy.parse(v))  # type: ignore[arg-type]

    @field_validator(
        "threads", "prefill_chunk", "worker_threads", "max_batch", "expert_workers",
        "expert_timeout", mode="before",
    )  # fmt: skip
    @classmethod
    def _no_bool(cls, v: object) -> object:
        # pydantic's lax mode reads True as 1: `threads=True` would mean one thread
        if isinstance(v, bool):
            raise ValueError(f"expected a number, got {v}")
        return v

    @field_validator("threads", "prefill_chunk", "worker_threads", mode="before")
    @classmethod
    def _positive(cls, v: object) -> object:
        if isinstance(v, str):
            v = None if v.strip().lower() in ("", "auto") else int(v)
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be >= 1 (or auto), got {v}")
        return v

    def resolved_threads(self) -> int:
        if self.threads is not None:
            return self.threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)

    @field_validator("expert_workers", mode="before")
    @classmethod
    def _workers(cls, v: object) -> object:
        if isinstance(v, str):
            v = int(v)
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("expert_timeout", mode="before")
    @classmethod
    def _timeout(cls, v: object) -> object:
        if isinstance(v, str):
            v = float(v)
        if isinstance(v, (int, float)) and not (v > 0 and math.isfinite(v)):
            # inf passed and crashed Ray's first wait (cannot convert float infinity)
            raise ValueError(f"must be a finite number > 0 of seconds, got {v}")
        return v

    @field_validator("ray", mode="before")
    @classmethod
    def _ray(cls, v: object) -> object:
        if isinstance(v, str) and v.strip().lower() in ("", "off", "none"):
            return None
        return v.strip() if isinstance(v, str) else v

    @field_validator("ram_budget", "worker_ram", mode="before")
    @classmethod
    def _budget(cls, v: object) -> int | None:
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # 2e9: a whole number of bytes written as a float
        if isinstance(v, float):
            raise ColibriError(f"a RAM budget is a whole number of bytes or a size, got {v!r}")
        n = v if v is None or isinstance(v, int) else parse_bytes(str(v))
        if isinstance(n, bool) or (n is not None and n <= 0):
            # a ColibriError, as parse_bytes raises: one line in the CLI, not pydantic's dump
            raise ColibriError(
                f"a RAM budget must be a positive size (or auto), got {v!r} (--ram, --worker-ram)"
            )
        return n

    @field_validator("mirror", "model_dirs", mode="before")
    @classmethod
    def _mirror(cls, v: object) -> object:
        if isinstance(v, (str, os.PathLike)):  # COLI_MIRROR: dirs joined by os.pathsep
            return tuple(p for p in os.fspath(v).split(os.pathsep) if p)
        return v

    @field_validator("disk_weights", mode="before")
    @classmethod
    def _disk_weights(cls, v: object) -> object:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "auto")):
            return None
        from storage.multidisk.placement import parse_weights

        if not isinstance(v, str) and not isinstance(v, Iterable):
            raise ColibriError(
                f"disk_weights is a list of weights or text like '2,1' (--disk-weights), got {v!r}"
            )
        return parse_weights(v if isinstance(v, str) else list(v))

    @field_validator("stripe_min_bytes", mode="before")
    @classmethod
    def _stripe(cls, v: object) -> int:
        if isinstance(v, int):
            return v
        return parse_bytes(str(v)) or 0

    def resolved_model(self) -> Path:
        """``model``; else the first of ``model_dirs`` holding config.json; else the demo."""
        if self.model is not None:
            return self.model
        if self.model_dirs:
            from storage.container import model_home

            return model_home(self.model_dirs)
        return default_model_path()

    def resolved_state_dir(self) -> Path:
        """Where `.coli_usage` / `.coli_kv*` live: ``state_dir``, else
        ``~/.cache/colibri/<model dir name>-<hash of its path>``. The model directory itself is
        never written by default: it may be read-only, shared, or one of several mirrors."""
        if self.state_dir is not None:
            return self.state_dir
        model = self.resolved_model().resolve()
        tag = hashlib.sha256(str(model).encode()).hexdigest()[:8]
        return Path.home() / ".cache" / "colibri" / f"{model.name}-{tag}"


def env_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Option values taken from ``COLI_*`` variables (field name -> raw text)."""
    env = os.environ if environ is None else environ
    return {field: env[var] for var, field in ENV_VARS.items() if env.get(var)}

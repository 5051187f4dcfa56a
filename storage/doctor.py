"""``coli doctor``: read-only checks of a model directory, one line per check.

Each check is ``pass``, ``warn`` or ``fail`` with a one-line message that names the file or
tensor and says what to do. A broken model never makes :func:`run_doctor` raise: every problem
becomes a ``fail`` line, so one run lists them all (the container is opened with
``strict=False``). Only headers are read, never tensor data, so it takes seconds even for a
400 GB model.

Checks, in order: ``config``, ``tokenizer``, ``shards``, ``tensors``, ``experts``, ``mtp``,
``names``. When config.json itself is unusable only ``config``, ``tokenizer`` and ``shards``
run (the others need the architecture).

``verify=True`` (``coli doctor --verify``) adds a ``verify`` check that reads every byte: each
shard against its sha256 in ``colibri-manifest.json``; a container without a manifest (the
public C-engine one) gets every float tensor and every scale array scanned for NaN / inf.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from storage import jsontext
from storage.arch import (
    expected_tensors,
    math_keys,
    optional_tensors,
    rope_keys,
    rotary_keys,
)
from storage.chat_template import chat_template_source, compile_chat_template
from storage.container import (
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    Container,
    shard_paths,
)
from storage.errors import (
    ColibriError,
    ConfigError,
    ContainerError,
    ExpertLayoutError,
    FormatError,
    SafetensorsError,
    TensorNotFoundError,
)
from storage.manifest import MANIFEST_NAME, Manifest, read_manifest, sha256_file
from storage.safetensors import read_header, read_tensor
from storage.units import format_bytes as _size  # one size format

__all__ = ["Check", "DoctorReport", "Status", "run_doctor"]

Status = Literal["pass", "warn", "fail"]

_SHOW = 5  # names / problems quoted in one line before "... and N more"
_ALIGN = 4096  # O_DIRECT-friendly boundary the aligned converter guarantees


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    status: Status
    name: str
    message: str


@dataclass
class DoctorReport:
    """Every check of one model directory, in order."""

    path: Path
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed)."""
        return all(c.status != "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 when only pass/warn lines, 1 when any check failed."""
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"model", "ok", "exit_code", "checks": [{status, name,
        message}]}``."""
        return {
            "model": str(self.path),
            "ok": self.ok,
            "exit_code": self.exit_code,
            "checks": [
                {"status": c.status, "name": c.name, "message": c.message} for c in self.checks
            ],
        }

    def render_lines(self) -> list[str]:
        """Human lines such as ``PASS config     glm_moe_dsa, 78 layers ...``."""
        width = max((len(c.name) for c in self.checks), default=0) + 1
        return [f"{c.status.upper():<4} {c.name:<{width}} {c.message}" for c in self.checks]


# (bytes done, bytes in all, what is being read) while ``verify`` reads the data
Progress = Callable[[int, int, str], None]


def run_doctor(
    path: str | Path,
    *,
    verify: bool = False,
    progress: Progress | None = None,
    shard_dirs: Sequence[Path] = (),
) -> DoctorReport:
    """Check the model directory ``path``; never raises for a broken model. ``verify`` also
    reads all data (checksums, or a NaN/inf scan without a manifest), reporting to
    ``progress``. ``shard_dirs``: more directories holding some of its shards (--model-dir)."""
    d = Path(path)
    report = DoctorReport(d)
    add = report.checks.append
    container: Container | None = None
    try:
        container = Container.open(d, strict=False, shard_dirs=shard_dirs)
    except ColibriError as exc:
        add(Check("fail", "config", str(exc)))
    except OSError as exc:  # permission problems and the like, outside the error tree
        add(Check("fail", "config", f"{d}: {exc}"))
    if container is not None:
        add(_guard("config", container, _check_config))
    if not d.is_dir():
        return report  # nothing else to look at
    try:
        add(_check_tokenizer(d))
    except OSError as exc:  # e.g. a directory that can be listed but not searched
        add(Check("fail", "tokenizer", f"{d / TOKENIZER_NAME}: {exc.strerror or exc}"))
    if container is None:
        add(_check_shards_raw(d))
        return report
    add(_guard("shards", container, _check_shards))
    add(_guard("tensors", container, _check_tensors))
    add(_guard("experts", container, _check_experts))
    add(_guard("mtp", container, _check_mtp))
    add(_guard("names", container, _check_names))
    if verify:
        add(_guard("verify", container, lambda c: _check_verify(c, progress)))
    return report


def _guard(name: str, c: Container, fn: Callable[[Container], Check]) -> Check:
    """Run one check; an error escaping it becomes that check's fail line."""
    try:
        return fn(c)
    except (ColibriError, OSError) as exc:
        return Check("fail", name, str(exc))


# ----------------------------------------------------------------------------- helpers


def _listed(items: list[str], show: int = _SHOW) -> str:
    head = ", ".join(items[:show])
    return head + (f", ... and {len(items) - show} more" if len(items) > show else "")


def _kind(err: ColibriError) -> str:
    """Which check reports a problem recorded while opening the container."""
    if isinstance(err, ConfigError):
        return "config"
    if isinstance(err, ExpertLayoutError):
        return "experts"
    if isinstance(err, (FormatError, TensorNotFoundError)):
        return "tensors"
    return "shards"  # SafetensorsError, duplicates, orphan scales, no shards


def _problems(c: Container, kind: str) -> list[str]:
    return [str(e) for e in c.problems if _kind(e) == kind]


# ----------------------------------------------------------------------------- checks


def _check_config(c: Container) -> Check:
    a = c.arch
    n_moe = sum(1 for i in range(a.num_hidden_layers) if a.is_moe_layer(i))
    top_k = a.num_experts_per_tok
    msg = (
        f"{a.model_type}, {a.num_hidden_layers} layers ({a.num_hidden_layers - n_moe} dense, "
        f"{n_moe} MoE) + {a.num_mtp_layers} MTP, hidden {a.hidden_size}, "
        f"{a.n_routed_experts} experts" + (f" top-{top_k}" if top_k else "")
        + f" + {a.n_shared_experts} shared, vocab {a.vocab_size}, eos {c.eos_token_ids}"
    )  # fmt: skip
    bad = _problems(c, "config")
    if a.n_routed_experts and top_k is None:
        bad.append("config.json lacks num_experts_per_tok (the runtime needs it)")
    for keys in (math_keys, rope_keys, rotary_keys):  # what the runtime's model config reads
        try:
            keys(c.config)
        except ConfigError as exc:
            bad.append(str(exc))
    if bad:
        return Check("fail", "config", f"{msg}; but {_listed(bad, 2)}")
    return Check("pass", "config", msg)


def _check_tokenizer(d: Path) -> Check:
    tok_path = d / TOKENIZER_NAME
    if not tok_path.is_file():
        return Check(
            "warn",
            "tokenizer",
            f"{tok_path} not found: text in/out needs it (copy tokenizer.json from the "
            "original model repository)",
        )
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        n = tok.get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        return Check("fail", "tokenizer", f"{tok_path}: does not load ({exc}); re-download it")
    cfg_note = ""
    tc = d / TOKENIZER_CONFIG_NAME
    if tc.is_file():
        try:
            doc = jsontext.loads(tc.read_text(encoding="utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            return Check("fail", "tokenizer", f"{tc}: not valid ({exc}); re-download it")
        cfg_note = f", {TOKENIZER_CONFIG_NAME} ok"
        try:
            src, where = chat_template_source(d, doc)
            if src is None:
                cfg_note += " (no chat template)"
            else:
                compile_chat_template(src, where)  # what `coli chat` and the server will run
                cfg_note += ", chat template compiles"
        except ConfigError as exc:
            return Check("fail", "tokenizer", f"{exc}; fix the template or remove it")
    else:
        cfg_note = f", no {TOKENIZER_CONFIG_NAME}"
    return Check("pass", "tokenizer", f"{TOKENIZER_NAME}: {n} tokens{cfg_note}")


def _shard_summary(names: list[str], n_tensors: int, nbytes: int) -> str:
    mtp = sum(1 for n in names if n.startswith("out-mtp-"))
    idx = sum(1 for n in names if n.startswith("out-idx-"))
    main = sum(1 for n in names if n.startswith("out-")) - mtp - idx
    other = len(names) - main - mtp - idx
    kinds = f"{main} main, {mtp} mtp, " + (f"{idx} indexer, " if idx else "") + f"{other} other"
    return f"{len(names)} shards ({kinds}), {n_tensors} tensors, {_size(nbytes)}"


def _check_shards(c: Container) -> Check:
    bad = _problems(c, "shards")
    if c.manifest is not None and not bad:
        # the sizes the converter recorded against the files' (from the open, no I/O here);
        # the sha256s are what --verify compares
        try:
            manifest = Manifest.from_json(c.manifest, str(c.path / MANIFEST_NAME))
        except ConfigError as exc:
            bad.append(str(exc))
        else:
            found = {sh.path.name: sh for sh in c.shards}  # shards may sit in several dirs
            for s in manifest.shards:
                sh = found.get(s.file)
                if sh is not None and sh.file_size != s.size:
                    bad.append(f"{sh.path}: {sh.file_size} bytes, manifest says {s.size}")
    if bad:
        return Check("fail", "shards", f"{len(bad)} problem(s): {_listed(bad, 3)}")
    names = [sh.path.name for sh in c.shards]
    n = sum(len(sh.tensors) for sh in c.shards)
    size = sum(sh.file_size for sh in c.shards)
    return Check("pass", "shards", _shard_summary(names, n, size))


def _check_shards_raw(d: Path) -> Check:
    """Header check alone, for a directory whose config.json is unusable."""
    try:
        paths = shard_paths(d)
    except ContainerError as exc:
        return Check("fail", "shards", str(exc))
    if not paths:
        return Check("fail", "shards", f"{d}: no *.safetensors shards found")
    bad: list[str] = []
    n = size = 0
    for p in paths:
        try:
            sh = read_header(p)
        except SafetensorsError as exc:
            bad.append(str(exc))
            continue
        n += len(sh.tensors)
        size += sh.file_size
    if bad:
        return Check("fail", "shards", f"{len(bad)} problem(s): {_listed(bad, 3)}")
    return Check("pass", "shards", _shard_summary([p.name for p in paths], n, size))


def _absent_optional(c: Container) -> frozenset[str]:
    """The optional tensors this container lacks altogether: the MTP indexer, or the whole
    MTP layer (its shards not copied: the model runs, drafting falls back to prompt lookup).
    A partial MTP layer or indexer is no optional absence: its missing pieces are reported
    like any other."""
    optional = optional_tensors(c.arch)
    absent = frozenset(n for n in optional if not c.has(n) and n not in c.unusable)
    out = absent if absent == optional else frozenset()
    if _mtp_absent(c):
        out |= frozenset(n for n in expected_tensors(c.arch) if _is_mtp_name(n, c))
    return out


def _is_mtp_name(name: str, c: Container) -> bool:
    a = c.arch
    return any(
        name.startswith(f"model.layers.{k}.") for k in range(a.num_hidden_layers, a.total_layers)
    )


def _mtp_absent(c: Container) -> bool:
    """The config declares MTP layers and no tensor of any of them is in the container (with
    every shard readable: an unreadable one may hold them)."""
    if c.arch.num_mtp_layers == 0 or _problems(c, "shards"):
        return False
    return not any(_is_mtp_name(n, c) for n in (*c.names(), *c.unusable))


def _check_tensors(c: Container) -> Check:
    expected = [n for n in expected_tensors(c.arch) if n not in _absent_optional(c)]
    bad = [n for n in expected if n in c.unusable]
    missing = [n for n in expected if not c.has(n) and n not in c.unusable]
    if missing or bad:
        parts: list[str] = []
        if missing:
            parts.append(f"{len(missing)} of {len(expected)} expected tensors missing: "
                         f"{_listed(missing)}")  # fmt: skip
            if _problems(c, "shards"):
                parts[-1] += " (some shards are unreadable: see shards)"
        if bad:
            parts.append(f"{len(bad)} unusable: {_listed([str(c.unusable[n]) for n in bad], 2)}")
        other = [p for p in _problems(c, "tensors") if not any(n in p for n in bad)]
        if other and not missing:
            parts.append(_listed(other, 2))
        return Check("fail", "tensors", "; ".join(parts))
    formats: dict[str, Counter[str]] = {}
    per_row: list[str] = []
    for n in c.names():
        e = c.entry(n)
        if e.fmt is None or e.role is None:
            continue
        formats.setdefault(e.role, Counter())[e.fmt.name] += 1
        # int4 with one scale per row over a long row: measurably worse than grouped int4.
        if e.fmt.kind == "int4" and e.fmt.group_size is None and e.shape[-1] > 64:
            per_row.append(n)
    summary = ", ".join(
        f"{role}={'/'.join(f for f, _ in cnt.most_common())}" for role, cnt in formats.items()
    )
    msg = f"all {len(expected)} expected tensors present; {summary}"
    if per_row:
        return Check(
            "warn",
            "tensors",
            f"{msg}; {len(per_row)} matrices are per-row int4 (-8 to -9 pp accuracy vs "
            f"grouped): reconvert with int4-g64 ({_listed(per_row, 2)})",
        )
    return Check("pass", "tensors", msg)


def _check_experts(c: Container) -> Check:
    bad = _problems(c, "experts")
    if bad:
        return Check(
            "fail", "experts", f"{len(bad)} expert(s) cannot be fetched in one read: {bad[0]}"
        )
    ext = c.expert_extents()
    if not ext:
        return Check("fail" if c.arch.n_routed_experts else "pass", "experts", "no routed experts")
    layers = c.expert_layers()
    a = c.arch
    n_moe = sum(1 for i in range(a.total_layers) if a.is_moe_layer(i))
    aligned = sum(1 for x in ext if x.start % _ALIGN == 0)
    sizes = {x.nbytes for x in ext}
    per = _size(max(sizes)) if len(sizes) == 1 else f"{_size(min(sizes))}..{_size(max(sizes))}"
    # every routed expert of the main layers must be there (the MTP layers' are the mtp
    # check's: a model may be used without its MTP head)
    main = sum(1 for i in range(a.num_hidden_layers) if a.is_moe_layer(i)) * a.n_routed_experts
    found = sum(1 for x in ext if x.layer < a.num_hidden_layers)
    if found < main:
        return Check(
            "fail",
            "experts",
            f"only {found} of the {main} routed experts of the model's layers are in the "
            "shards (see the shards and tensors checks for what is missing)",
        )
    return Check(
        "pass",
        "experts",
        f"{len(ext)} of {n_moe * a.n_routed_experts} experts in {len(layers)} layers "
        f"({layers[0]}..{layers[-1]}), contiguous, "
        f"{per} per expert, {aligned} of {len(ext)} start 4 KiB-aligned",
    )


def _check_mtp(c: Container) -> Check:
    a = c.arch
    if a.num_mtp_layers == 0:
        return Check(
            "pass", "mtp", "no MTP layer declared (speculative drafts from prompt lookup only)"
        )
    fmts: Counter[str] = Counter()
    int4: list[str] = []
    for n in c.names():
        e = c.entry(n)
        if e.role == "mtp" and e.fmt is not None:
            fmts[e.fmt.name] += 1
            if e.fmt.kind == "int4":
                int4.append(n)
    if not fmts and _mtp_absent(c):
        return Check(
            "warn",
            "mtp",
            f"MTP layer {a.num_hidden_layers} declared but none of its tensors is here (its "
            "out-mtp-* shards not copied?): the model runs; drafting uses prompt lookup only",
        )
    if not fmts:
        return Check("warn", "mtp", "MTP layer declared but no MTP matrices found (see tensors)")
    layers = f"layer {a.num_hidden_layers}" + (
        f"..{a.total_layers - 1}" if a.num_mtp_layers > 1 else ""
    )
    kinds = "/".join(f for f, _ in fmts.most_common())
    note = ""
    if optional_tensors(a) and _absent_optional(c):
        # The public converter writes no MTP indexer; the C engine runs that layer dense too.
        note = "; indexer absent: MTP attention dense (changes drafts only, never the output)"
    if int4:
        return Check(
            "warn",
            "mtp",
            f"MTP {layers}: {len(int4)} of {sum(fmts.values())} matrices are int4: int4 MTP "
            f"head gives 0-4% draft acceptance; convert with --mtp int8{note}",
        )
    return Check("pass", "mtp", f"MTP {layers}: {kinds}{note}")


def _check_names(c: Container) -> Check:
    unknown = [n for n in c.names() if c.entry(n).role is None]
    if unknown:
        return Check(
            "warn",
            "names",
            f"{len(unknown)} tensor name(s) colibri does not know (ignored): {_listed(unknown)}",
        )
    return Check("pass", "names", "every tensor name is known")


def _check_verify(c: Container, progress: Progress | None) -> Check:
    report = progress or (lambda done, total, what: None)
    manifest = read_manifest(c.path)
    if manifest is not None:
        total = sum(s.size for s in manifest.shards)
        done = 0
        bad: list[str] = []
        unreadable: list[str] = []  # not damage: permissions, a missing file, an I/O error
        where = {sh.path.name: sh.path for sh in c.shards}  # shards may sit in several dirs
        for s in manifest.shards:
            p = where.get(s.file, c.path / s.file)
            report(done, total, s.file)
            try:
                got = sha256_file(p)
            except OSError as exc:
                unreadable.append(f"{p}: {exc.strerror or exc}")
                continue
            finally:
                done += s.size
            if got != s.sha256:
                bad.append(f"{s.file}: sha256 {got[:12]}..., manifest says {s.sha256[:12]}...")
        report(total, total, "done")
        problems = []
        if bad:
            problems.append(
                f"{len(bad)} of {len(manifest.shards)} shards are damaged (their tensors cannot "
                "be trusted; re-copy them, or delete them and rerun the same `coli convert SRC "
                f"DST`, which writes only the missing shards): {_listed(bad, 3)}"
            )
        if unreadable:
            problems.append(
                f"{len(unreadable)} of {len(manifest.shards)} shards could not be read (fix "
                f"the file's permissions or presence and verify again): {_listed(unreadable, 3)}"
            )
        if problems:
            return Check("fail", "verify", "; ".join(problems))
        return Check(
            "pass",
            "verify",
            f"{len(manifest.shards)} shards match the manifest's sha256 ({_size(total)} read)",
        )
    # No manifest (a public container): no checksums to compare, but damage that turns a float
    # into NaN / inf (most bit flips in an exponent) shows in the float tensors and the scales.
    infos = [
        i
        for n in c.names()
        for i in (c.entry(n).weight, c.entry(n).scales)
        if i is not None and i.dtype in ("F32", "F16", "BF16")
    ]
    total = sum(i.nbytes for i in infos)
    done = 0
    bad = []
    for i in infos:
        report(done, total, i.name)
        a = read_tensor(i)
        if i.dtype == "BF16":
            a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(a).all():
            bad.append(f"{i.name} ({i.path.name})")
        done += i.nbytes
    report(total, total, "done")
    if bad:
        return Check(
            "fail", "verify", f"{len(bad)} tensors hold NaN or inf (damaged): {_listed(bad, 3)}"
        )
    return Check(
        "warn",
        "verify",
        f"no {MANIFEST_NAME}: no checksums to compare; {len(infos)} float tensors and scale "
        f"arrays ({_size(total)}) scanned, all finite (quantized bytes cannot be checked)",
    )

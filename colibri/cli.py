"""The ``coli`` command.

Every command takes ``--model DIR`` (default: ``COLI_MODEL``, else the bundled demo model).
Errors a user can cause print one line with a hint and exit non-zero; ``--debug`` shows the
traceback.
"""

# ruff: noqa: E402  (the start-up signal handlers go in before the slower imports)
from __future__ import annotations

import os
import sys


def _exit_now(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM while the command starts (imports, option parsing): nothing to clean
    up yet, so leave at once with the shell's status, without a traceback."""
    os._exit(128 + signum)


# Only when this process is the `coli` program, never in one that merely imports this module.
_PROGRAM = __name__ == "__main__" or os.path.basename(sys.argv[0]) == "coli"
if _PROGRAM:  # until the command runs (main() installs the real handlers)
    # through the built-in `_signal` (loaded with the interpreter): `import signal` builds its
    # enums first, milliseconds in which a Ctrl-C would still end in a traceback
    _sig = __import__("_signal")
    _sig.signal(_sig.SIGINT, _exit_now)
    _sig.signal(_sig.SIGTERM, _exit_now)
    # A standard stream the shell closed (`coli chat <&-`, `coli run >&-`) is None to Python:
    # it reads as empty and writes go nowhere, instead of a traceback at its first use.
    for _name, _mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, _name) is None:
            setattr(sys, _name, open(os.devnull, _mode, encoding="utf-8"))

import signal


def _finished_exit() -> None:
    """The command succeeded: flush what it wrote and leave with status 0 at once (everything
    it opened is closed by now; nothing is left for interpreter teardown to do)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    logging.shutdown()
    os._exit(0)


def _interrupted_exit(code: int) -> None:
    """Leave after Ctrl-C / SIGTERM once the command has cleaned up: the program exits at once
    with ``code`` (interpreter teardown could meet the interrupt again and turn the status into
    a signal death); in a host process it is an ordinary SystemExit."""
    if _PROGRAM:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


import asyncio
import concurrent.futures
import contextlib
import http
import importlib.util
import json
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from colibri._config import EngineOptions, default_model_path, env_defaults, parse_bytes
from storage.errors import ColibriError
from storage.units import format_bytes as _binary  # one size format

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["main"]


def _fail(message: str, hint: str | None = None) -> None:
    """The error line (and its hint) on stderr; one JSON object with ``--log-format json``,
    as every other stderr line is then."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and (ctx.find_root().obj or {}).get("log_format") == "json":
        doc = {"event": "error", "level": "error", "error": message}
        if hint:
            doc["hint"] = hint
        click.echo(json.dumps(doc), err=True)
        return
    click.secho(f"error: {message}", fg="red", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)


def _model_option(fn: F) -> F:
    env = env_defaults()
    return click.option(
        "--model",
        "model",
        type=click.Path(path_type=Path),
        default=env.get("model"),
        help="Model directory (env COLI_MODEL; default: the bundled demo model).",
    )(fn)


def _prefetch_default(value: str | None) -> str:
    """COLI_PREFETCH as a --prefetch value (1/0/true/false are accepted as on/off)."""
    if value is None:
        return "auto"
    word = value.strip().lower()
    return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
        word, word
    )


class _EnvOption(click.Option):
    """An option whose default may come from a ``COLI_*`` variable: a bad value from there is
    an error naming the variable (click named only the flag, which the user never typed)."""

    def __init__(self, *args: Any, env_var_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_var_name = env_var_name

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        try:
            return super().process_value(ctx, value)
        except click.BadParameter as exc:
            raw = os.environ.get(self.env_var_name)
            source = ctx.get_parameter_source(self.name) if self.name else None
            if raw and source is click.core.ParameterSource.DEFAULT:
                raise click.BadParameter(
                    f"{exc.message} (the value comes from {self.env_var_name}={raw!r})",
                    ctx=ctx,
                    param=self,
                ) from exc
            raise


class _Checked(click.ParamType[Any]):
    """Text passed on as written, checked when it is read: a bad value is a usage error
    (exit 2) naming the option, or the ``COLI_*`` variable it came from (:class:`_EnvOption`),
    instead of an error after the model has started to load."""

    def __init__(self, name: str, check: Callable[[str], object]) -> None:
        self.name = name
        self._check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            try:
                self._check(value)
            except (ColibriError, ValueError) as exc:
                self.fail(str(exc), param, ctx)
        return value


def _check_draft(value: str) -> object:
    from runtime.speculative.policy import DraftPolicy

    return DraftPolicy.parse(value)


def _check_disk_weights(value: str) -> object:
    from storage.multidisk.placement import parse_weights

    return parse_weights(value)


def _positive_size(what: str) -> Callable[[str], object]:
    """A check of a size > 0 (or auto) for ``what`` (0 passed the size parser and failed
    later, as an error that named neither the option nor its variable)."""

    def check(value: str) -> object:
        n = parse_bytes(value)
        if n is not None and n <= 0:
            raise ColibriError(f"{what} must be a positive size, got {value!r}")
        return n

    return check


#: sizes checked when the command line is read: a usage error naming the option (they failed
#: later, as "cannot read '-1' as a size" naming no option)
_SIZE = _Checked("size", _positive_size("a RAM budget"))
_ANY_SIZE = _Checked("size", parse_bytes)
_POSITIVE_SIZE = _Checked("size", _positive_size("a size"))


def _engine_options(fn: F) -> F:
    env = env_defaults()
    fn = click.option(
        "--ram",
        "ram",
        cls=_EnvOption,
        env_var_name="COLI_RAM",
        type=_SIZE,
        default=env.get("ram_budget"),
        help="RAM budget for the whole engine, e.g. 6GiB (env COLI_RAM; default: auto).",
    )(fn)
    fn = click.option(
        "--reader",
        cls=_EnvOption,
        env_var_name="COLI_READER",
        type=click.Choice(["auto", "uring", "threads", "buffered"]),
        default=env.get("reader", "auto"),
        show_default=True,
        help="Expert read backend (env COLI_READER).",
    )(fn)
    # The options below reach EngineOptions through the context (no command signature needs
    # them): see _options.
    fn = click.option(
        "--no-prefetch",
        "no_prefetch",
        is_flag=True,
        expose_value=False,
        callback=_keep_prefetch,
        help="Same as --prefetch off.",
    )(fn)
    fn = click.option(
        "--prefetch",
        "prefetch",
        cls=_EnvOption,
        env_var_name="COLI_PREFETCH",
        type=click.Choice(["auto", "on", "off"]),
        default=_prefetch_default(env.get("prefetch")),
        show_default=True,
        expose_value=False,
        callback=_keep_prefetch,
        help="Lookahead reads of the next layer's predicted experts: auto keeps them per layer "
        "only while they save more read time than they cost (env COLI_PREFETCH).",
    )(fn)
    fn = click.option(
        "--state-dir",
        cls=_EnvOption,
        env_var_name="COLI_STATE_DIR",
        type=click.Path(path_type=Path, file_okay=False),
        default=env.get("state_dir"),
        expose_value=False,
        callback=_keep,
        help="Where .coli_usage and KV files live (env COLI_STATE_DIR; default: "
        "~/.cache/colibri/<model dir name>-<hash>).",
    )(fn)
    # Several SSDs (storage/multidisk/, docs/tuning.md "Several SSDs").
    fn = _dirs_option(
        "--mirror",
        "mirror",
        env,
        "A full or partial copy of the model dir on another drive; repeat for more "
        f"(env COLI_MIRROR, dirs joined by {os.pathsep!r}).",
    )(fn)
    fn = _dirs_option("--model-dir", "model_dirs", env, _MODEL_DIR_HELP)(fn)
    fn = click.option(
        "--disk-weights",
        cls=_EnvOption,
        env_var_name="COLI_DISK_WEIGHTS",
        type=_Checked("weights", _check_disk_weights),
        default=env.get("disk_weights"),
        expose_value=False,
        callback=_keep,
        help="Read shares per copy, primary first, e.g. 2,1 (env COLI_DISK_WEIGHTS; default: "
        "probed read bandwidth).",
    )(fn)
    fn = click.option(
        "--disk-adapt/--no-disk-adapt",
        default=True,
        show_default=True,
        expose_value=False,
        callback=_keep,
        help="Adapt the disk weights to the read throughput each copy delivers.",
    )(fn)
    fn = click.option(
        "--stripe-min",
        "stripe_min_bytes",
        type=_ANY_SIZE,
        default=None,
        expose_value=False,
        callback=_keep,
        help="Split reads at least this large (e.g. 8MiB) over the copies (default: off).",
    )(fn)
    fn = click.option(
        "--draft",
        cls=_EnvOption,
        env_var_name="COLI_DRAFT",
        type=_Checked("draft", _check_draft),
        default=env.get("draft", "auto"),
        show_default=True,
        expose_value=False,
        callback=_keep,
        help="Speculative decoding: auto (drafts only when the cost model says they pay), off, "
        "N drafts per step, or one source: mtp[:N] / lookup[:N] (env COLI_DRAFT).",
    )(fn)
    fn = click.option(
        "--threads",
        cls=_EnvOption,
        env_var_name="COLI_THREADS",
        type=click.IntRange(min=1),
        default=env.get("threads"),
        expose_value=False,
        callback=_keep,
        help="Threads computing routed experts in parallel; output is identical for every "
        "count (env COLI_THREADS; default: one per usable CPU).",
    )(fn)
    fn = click.option(
        "--prefill-chunk",
        type=click.IntRange(min=1),
        default=None,
        expose_value=False,
        callback=_keep,
        help="Prompt tokens per prefill step (default: planned; 512 resident, up to 4096 "
        "streaming). Output is identical for every size.",
    )(fn)
    fn = click.option(
        "--fast-prefill",
        is_flag=True,
        default=None,
        expose_value=False,
        callback=_keep,
        help="Faster long prompts: dequantized tiles + BLAS for experts with many rows of a "
        "chunk. Logits then match the exact path to float rounding, not bit for bit.",
    )(fn)
    fn = click.option(
        "--kernels",
        cls=_EnvOption,
        env_var_name="COLI_KERNELS",
        type=click.Choice(["exact", "fast-int8"]),
        default=env.get("kernels", "exact"),
        show_default=True,
        expose_value=False,
        callback=_keep,
        help="Matmul kernels. 'exact': bit-exact and batch-invariant. 'fast-int8': LOSSY, "
        "opt-in: activations rounded to int8 for int4 weights (VNNI where the CPU has it); "
        "greedy tokens may differ from exact; faster than exact only where measured so: "
        "see docs/benchmarks.md (env COLI_KERNELS).",
    )(fn)
    fn = click.option(
        "--verify-reads/--no-verify-reads",
        cls=_EnvOption,
        env_var_name="COLI_VERIFY_READS",
        # click's boolean words (1/0, true/false, yes/no, on/off); another is an error. Off
        # without the variable: a "0" default read as the word "verify-reads" in --help.
        default=env.get("verify_reads", False),
        show_default=True,
        expose_value=False,
        callback=_keep,
        help="Check every expert read against the manifest's CRC-32: a damaged copy is an "
        "error naming the expert and file (or, with --mirror, is demoted and another copy "
        "serves the read) instead of a wrong token (env COLI_VERIFY_READS).",
    )(fn)
    fn = _cluster_options(fn, env)
    return _model_option(fn)


def _cluster_options(fn: F, env: Mapping[str, str]) -> F:
    """Scale-out over Ray (runtime/cluster/, docs/cluster.md)."""
    fn = click.option(
        "--ray",
        default=env.get("ray"),
        metavar="ADDRESS|local",
        expose_value=False,
        callback=_keep,
        help="Shard the routed experts over Ray actors: 'local' starts Ray on this machine, "
        "an address joins a running cluster (env COLI_RAY; needs pip install -e '.[ray]'). "
        "Output is identical to one process.",
    )(fn)
    fn = click.option(
        "--expert-workers",
        type=click.IntRange(min=1),
        default=None,
        expose_value=False,
        callback=_keep,
        help="Expert workers (Ray actors) with --ray (default: 2).",
    )(fn)
    fn = click.option(
        "--worker-ram",
        type=_POSITIVE_SIZE,
        default=None,
        expose_value=False,
        callback=_keep,
        help="Each expert worker's RAM budget, e.g. 32GiB (default: its host's share of 88% "
        "of the available memory); a share that does not fit streams from the worker's disks.",
    )(fn)
    fn = click.option(
        "--worker-threads",
        type=click.IntRange(min=1),
        default=None,
        expose_value=False,
        callback=_keep,
        help="Compute threads per expert worker (default: its host's CPUs / its workers).",
    )(fn)
    fn = click.option(
        "--worker-model",
        type=click.Path(path_type=Path),
        default=None,
        expose_value=False,
        callback=_keep,
        help="The model directory on the workers' hosts (default: --model's path).",
    )(fn)
    fn = click.option(
        "--expert-timeout",
        type=_Finite(min=0, min_open=True),
        default=None,
        expose_value=False,
        callback=_keep,
        help="Seconds a step waits for an expert worker before computing its experts here "
        "(default: 10).",
    )(fn)
    return fn


def _one_line(exc: ValueError) -> str:
    """A pydantic ``ValidationError`` as ``field: message; ...`` (its ``str`` spans lines and
    links to the pydantic docs); any other ValueError as it is."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    return "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ())) or 'value'}: {e.get('msg', '')}"
        for e in errors()
    )


class _Finite(click.FloatRange):
    """A ``click.FloatRange`` that also refuses NaN and the infinities (a range check alone
    lets NaN through: every comparison with it is false)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        got = super().convert(value, param, ctx)
        if not math.isfinite(got):
            self.fail(f"{got} is not a finite number.", param, ctx)
        return got


#: the sampling options of run and chat, checked before the model loads (click's usage error,
#: exit 2, naming the flag) rather than by the engine after the weights are read
_TOKENS = click.IntRange(min=0)
_TEMPERATURE = _Finite(min=0.0)
_TOP_P = _Finite(min=0.0, max=1.0, min_open=True)
_TOP_K = click.IntRange(min=0)
_SEED = click.IntRange(min=0)
_GBPS = _Finite(min=0.0, min_open=True)


_MODEL_DIR_HELP = (
    "Another directory holding some of the model's shard files, searched after "
    f"--model; repeat for more (env COLI_MODEL_DIRS, dirs joined by {os.pathsep!r})."
)


def _dirs_option(
    flag: str, field: str, env: Mapping[str, str], help: str, *, keep: bool = True
) -> Callable[[F], F]:
    """A repeatable directory option for EngineOptions ``field``, its default from the field's
    variable (directories joined by os.pathsep). ``keep``: collected for the engine options
    (see _options) rather than passed to the command."""
    return click.option(
        flag,
        field,
        type=click.Path(path_type=Path),
        multiple=True,
        default=tuple(p for p in env.get(field, "").split(os.pathsep) if p),
        expose_value=not keep,
        callback=_keep if keep else None,
        help=help,
    )


# --model-dir as for the engine, for the commands that open the model themselves (plan, info,
# doctor, mirror): the model's shards may be spread over directories.
_shard_dirs_option = _dirs_option(
    "--model-dir", "model_dirs", env_defaults(), _MODEL_DIR_HELP, keep=False
)


def _keep(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if param.name is not None and value is not None:
        ctx.meta.setdefault("colibri.engine", {})[param.name] = value
    return value


def _keep_prefetch(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """--prefetch MODE and --no-prefetch set one field; a flag given on the command line wins
    over the other's default (click processes given options first)."""
    meta = ctx.meta.setdefault("colibri.engine", {})
    given = ctx.get_parameter_source(param.name or "") is not click.core.ParameterSource.DEFAULT
    if param.name == "no_prefetch":
        if value:
            meta["prefetch"] = "off"
            meta["_prefetch_given"] = True
    elif given or not meta.get("_prefetch_given"):
        meta["prefetch"] = value
        meta["_prefetch_given"] = meta.get("_prefetch_given") or given
    return value


def _options(model: Path | None, ram: str | None, reader: str) -> EngineOptions:
    extra: dict[str, Any] = {}
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        extra = {k: v for k, v in ctx.meta.get("colibri.engine", {}).items() if k[0] != "_"}
    try:
        return EngineOptions(model=model, ram_budget=ram, reader=reader, **extra)
    except ValueError as exc:  # pydantic's ValidationError: one line, naming the option
        raise ColibriError(f"bad option: {_one_line(exc)}") from exc


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same clean-up runs (exit status 143)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    if not _can_raise_here(frame):
        _signal_again(signum)
        return
    raise Terminated()


def _on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C: KeyboardInterrupt, as Python's default handler raises it, but only where it
    stays one: in colibri's own code, a thread wait or an event loop. Raised anywhere else it
    can be lost or turned into another error, each seen for a Ctrl-C during start-up: inside a
    finalizer (an import lock's weakref callback: printed as "ignored", the command ran on to
    its end), inside an import (a C extension's init reported an ImportError), inside a
    library's callback (pydantic's serializer reported its own error). There the signal is
    sent again a moment later, to be taken once the program is back where raising is safe."""
    if not _can_raise_here(frame):
        _signal_again(signum)
        return
    raise KeyboardInterrupt


def _package_dirs(*names: str) -> list[str]:
    """The directories of the installed packages among ``names`` (found, not imported)."""
    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out += [str(Path(d)) + os.sep for d in spec.submodule_search_locations]
    return out


_HERE = Path(__file__).resolve().parent.parent
_SAFE_FILES = (
    *(str(_HERE / pkg) + os.sep for pkg in ("colibri", "runtime", "storage")),
    threading.__file__,
    os.path.dirname(concurrent.futures.__file__) + os.sep,
    # an event loop waiting (coli serve while the engine loads): asyncio unwinds from there
    selectors.__file__,
    os.path.dirname(asyncio.__file__) + os.sep,
    # a network wait (coli pull listing a repository, coli ps asking a server that does not
    # answer): Python's own handler raises there too, and the clients unwind cleanly
    socket.__file__,
    ssl.__file__,
    os.path.dirname(http.__file__) + os.sep,
    *_package_dirs(
        "httpx", "httpcore", "httpx2", "httpcore2", "h11", "urllib3", "requests", "huggingface_hub"
    ),
)


def _can_raise_here(frame: Any, depth: int = 64) -> bool:
    """Whether ``frame`` runs colibri's code or a thread wait, outside any import or
    finalizer (its callers are looked at too, ``depth`` frames up)."""
    code = getattr(frame, "f_code", None)
    if code is None or not str(code.co_filename).startswith(_SAFE_FILES):
        return False
    f = frame
    for _ in range(depth):
        code = getattr(f, "f_code", None)
        if code is None:
            return True
        if code.co_name == "__del__" or str(code.co_filename).startswith("<frozen importlib"):
            return False
        f = f.f_back
    return True


def _signal_again(signum: int) -> None:
    timer = threading.Timer(0.02, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


class _Group(click.Group):
    """Maps ColibriError (and a few OS errors) to one clear line unless --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            out = super().invoke(ctx)
            if _PROGRAM and threading.current_thread() is threading.main_thread():
                # The work is done: a signal from now on exits at once with the shell's status,
                # and the program leaves without interpreter teardown, where a late signal
                # would meet Python's handlers already removed and become a signal death (a
                # `coli convert` interrupted just as it finished died of SIGINT that way).
                signal.signal(signal.SIGINT, _exit_now)
                signal.signal(signal.SIGTERM, _exit_now)
                _finished_exit()
            return out
        except ColibriError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            _fail(str(exc), _hint_for(exc))
            sys.exit(1)
        except click.UsageError as exc:
            fmt = (ctx.obj or {}).get("log_format") or ctx.params.get("log_format")
            if fmt != "json" or isinstance(exc, click.exceptions.NoArgsIsHelpError):
                raise  # click prints it, with the usage line (or the group's help)
            # with JSON logs every stderr line parses: a usage error too (exit 2, as click's)
            doc = {"event": "usage_error", "level": "error", "error": exc.format_message()}
            if exc.ctx is not None:
                doc["command"] = exc.ctx.command_path
            click.echo(json.dumps(doc), err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            # Ctrl-C (SIGINT) exits 130, SIGTERM 143, as shells report them; the work was
            # cancelled and cleaned up on the way out (SyncModel.call), with no traceback.
            click.echo("", err=True)
            _interrupted_exit(143 if isinstance(exc, Terminated) else 130)
        except BrokenPipeError:
            # the reader went away (`coli run ... | head`): quietly, as a Unix tool killed by
            # SIGPIPE (status 141); what is still buffered for stdout goes nowhere
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            _interrupted_exit(128 + signal.SIGPIPE)
        except OSError as exc:  # outside the error tree: permissions, a vanished file, ...
            if ctx.obj and ctx.obj.get("debug"):
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            hint = None
            if isinstance(exc, PermissionError):
                hint = "make the model directory searchable and its files readable (chmod a+rX)"
            _fail(f"{where}{exc.strerror or exc}", hint)
            sys.exit(1)


def _key_file(path: Path) -> list[str]:
    """The API keys in ``path`` (--api-key-file): one per line, blank lines and ``#`` comments
    skipped."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # (an editor's BOM is not the key's)
    except (OSError, UnicodeDecodeError) as exc:
        raise ColibriError(f"cannot read --api-key-file {path}: {exc}") from exc
    keys = [k for line in text.splitlines() if (k := line.strip()) and k[0] != "#"]
    bad = next((k for k in keys if not (k.isascii() and k.isprintable())), None)
    if bad is not None:
        raise ColibriError(
            f"--api-key-file {path}: a key holds characters other than printable ASCII "
            "(keys are one per line)"
        )
    return keys


def _summary(line: str, **fields: Any) -> None:
    """A command's closing summary on stderr: ``line`` for a reader, or with
    ``--log-format json`` one JSON object (``fields``), so that every line of the log stream
    parses."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and (ctx.find_root().obj or {}).get("log_format") == "json":
        click.echo(json.dumps(fields, default=str), err=True)
    else:
        click.echo(line, err=True)


def _hint_for(exc: ColibriError) -> str | None:
    from storage.errors import ConfigError, ContainerError, ConversionError, FormatError

    if isinstance(exc, FormatError):
        return "run `coli doctor --model DIR` for a full report"
    if isinstance(exc, ConfigError) and "file not found" not in str(exc):
        # a model directory whose config, manifest or side files are damaged, not a wrong path
        return "run `coli doctor --model DIR` for a full report"
    if isinstance(exc, ConversionError):
        return "see `coli convert --help`"
    if isinstance(exc, ContainerError):
        if "missing" in str(exc) and "listed in" in str(exc):
            # the directory is a container, one of its files is gone: not a wrong path
            return "run `coli doctor --model DIR` for a full report"
        env_model = os.environ.get("COLI_MODEL")
        if env_model and "--model" not in sys.argv and env_model in str(exc):
            return (
                f"the model directory comes from COLI_MODEL={env_model!r}: point it at a "
                "converted model, or unset it for the demo model"
            )
        return "pass --model DIR pointing at a converted model, or omit it for the demo model"
    if str(exc).startswith("no colibri server answers"):
        return "start one with `coli serve`, or point --url at it"
    if "RAM budget" in str(exc) and "too small" in str(exc):
        return "`coli plan --ram SIZE` shows how a budget splits and the smallest that works"
    return None


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option(
    "--log-format",
    cls=_EnvOption,
    env_var_name="COLI_LOG_FORMAT",
    type=click.Choice(["console", "json"]),
    default=env_defaults().get("log_format", "console"),
    help="Structured log output (env COLI_LOG_FORMAT).",
)
@click.option(
    "-v", "--verbose", count=True, help="More log lines: -v info, -vv debug (default: warnings)."
)
@click.version_option(package_name="colibri")
@click.pass_context
def main(ctx: click.Context, debug: bool, log_format: str, verbose: int) -> None:
    """colibri: run giant Mixture-of-Experts models on ordinary machines."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)  # KeyboardInterrupt: exit 130
        signal.signal(signal.SIGTERM, _on_sigterm)
    from colibri._logging import configure_logging

    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    ctx.obj["log_format"] = log_format
    ctx.obj["log_level"] = _LEVELS[min(verbose, 2)]
    configure_logging(log_format, ctx.obj["log_level"])


_LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)


# ---------------------------------------------------------------------------- run


@main.command()
@_engine_options
@click.argument("prompt", required=False)
@click.option(
    "--file",
    "prompt_file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="Read the prompt from this file ('-': standard input); PROMPT '-' does the same.",
)
@click.option(
    "--quiet", "-q", is_flag=True, help="No summary line (tokens, tok/s, TTFT) on stderr."
)
@click.option(
    "--max-tokens", "-n", type=_TOKENS, default=64, show_default=True, help="Tokens to generate."
)
@click.option(
    "--temperature", "-t", type=_TEMPERATURE, default=0.0, show_default=True, help="0 = greedy."
)
@click.option("--top-p", type=_TOP_P, default=1.0, show_default=True)
@click.option("--top-k", type=_TOP_K, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=_SEED, default=None, help="Sampling seed (same seed, same output).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--stats", "show_stats", is_flag=True, help="Print counters as JSON at the end.")
def run(
    model: Path | None,
    ram: str | None,
    reader: str,
    prompt: str | None,
    prompt_file: Any,
    quiet: bool,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    raw: bool,
    show_stats: bool,
) -> None:
    """Generate a completion for PROMPT (or --file, or '-' for stdin) and print it as it
    streams; a summary line (tokens, tok/s, time to first token) follows on stderr."""
    from colibri._engine import TokenEvent
    from colibri.tokenizer import ChatTokenizer, not_utf8
    from storage.container import Container

    if prompt_file is not None and prompt is not None:
        raise click.UsageError("give PROMPT or --file, not both")
    try:
        if prompt_file is not None:
            prompt = prompt_file.read()
        elif prompt == "-":
            prompt = sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise click.UsageError(
            f"the prompt is not valid UTF-8 (byte {exc.object[exc.start : exc.start + 1]!r} at "
            f"offset {exc.start})"
        ) from None
    if prompt is None:
        raise click.UsageError("give a PROMPT (or --file PATH, or '-' to read standard input)")
    bad = not_utf8(prompt)
    if bad is not None:
        raise click.UsageError(f"the prompt cannot be used: {bad}")
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    opts = _options(model, ram, reader)
    # What can be checked without loading is checked first: the model directory and its
    # tokenizer (the RAM plan is checked before any weight is read, in open_model).
    c = Container.open(opts.resolved_model(), shard_dirs=opts.model_dirs)
    tok_path = c.tokenizer_path()
    if tok_path is None:
        raise ColibriError(f"{c.path}: no tokenizer.json, cannot turn text into tokens")
    tok = ChatTokenizer(tok_path, c.tokenizer_config())
    with _open_with_progress(opts) as m:
        if raw or not tok.has_chat_template:
            ids = tok.encode(prompt, raw=True)
        else:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
        t0 = time.perf_counter()
        toks: list[int] = []
        first: list[float] = []
        engine = m.engine
        text = tok.stream()  # holds back half-decoded multi-byte characters

        async def stream() -> list[int]:
            async for ev in engine.generate(
                ids,
                max_new_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
            ):
                if isinstance(ev, TokenEvent):
                    if not first:
                        first.append(time.perf_counter())
                    toks.append(ev.token_id)
                    click.echo(text.push(ev.token_id), nl=False)
            return toks

        m.call(stream)
        click.echo(text.flush())
        dt = time.perf_counter() - t0
        ctx_len = engine.context_length
        # the context ended the output before -n did (the engine stops there, reason "length")
        cut = len(toks) < max_tokens and len(ids) + len(toks) >= ctx_len
        if not quiet:
            ttft = first[0] - t0 if first else None
            rate = (
                (len(toks) - 1) / (dt - ttft)
                if ttft is not None and len(toks) > 1 and dt > ttft
                else None
            )
            line = f"{len(toks)} tokens"
            if rate is not None:
                line += f", {rate:.1f} tok/s"
            if ttft is not None:
                line += f", first after {ttft:.2f} s"
            line += f" ({len(ids)} prompt tokens)"
            if cut:
                line += f"; stopped at the end of the model's context ({ctx_len} tokens)"
            _summary(
                line,
                event="generated",
                tokens=len(toks),
                prompt_tokens=len(ids),
                tokens_per_s=rate,
                first_token_s=ttft,
                seconds=dt,
                stopped_at_context=cut,
            )
        if show_stats:
            click.echo(json.dumps({"tokens": len(toks), "seconds": dt, **m.stats()}, default=str))


# ---------------------------------------------------------------------------- serve


@main.command()
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port."
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="Require this key (Bearer or x-api-key); repeat for several clients, each its own tenant.",
)
@click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Read API keys from this file, one per line (keeps them out of `ps`).",
)
@click.option(
    "--prefix-reuse",
    type=click.Choice(["auto", "key", "all", "off"]),
    default="auto",
    show_default=True,
    help="Automatic prefix matching for requests without cache_slot: among requests with the "
    "same key, all clients, or never (auto: 'key' with several keys, else 'all').",
)
@click.option(
    "--kv-persist-auto/--no-kv-persist-auto",
    default=False,
    show_default=True,
    help="Also save to disk the slots that requests without cache_slot used.",
)
@click.option("--served-model-name", default=None, help="Model id clients pass as `model`.")
@click.option(
    "--queue",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests allowed to wait (429 past).",
)
@click.option(
    "--parallel",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Generations admitted at once (their decode steps are batched).",
)
@click.option(
    "--kv-slots",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="KV slots (`cache_slot` 0..N-1).",
)
@click.option(
    "--kv-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where slot files .coli_kv.N live (default: the state dir, see --state-dir).",
)
@click.option(
    "--kv-persist/--no-kv-persist", default=True, show_default=True, help="Save KV slots to disk."
)
@click.option("--cors-origin", "cors", multiple=True, help="Allow this browser origin (repeat).")
@click.option("--allowed-host", "hosts", multiple=True, help="Accept this Host header (repeat).")
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a connection has to send a request's headers, and the longest pause "
    "allowed inside its body (then 408).",
)
@click.option(
    "--keep-alive-timeout",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Seconds an idle keep-alive connection stays open.",
)
@click.option(
    "--stats-interval",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds between throughput log lines while requests run (0: none).",
)
@click.option(
    "--send-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a client has to take each response chunk; a client that stops reading "
    "loses its request (the generation is cancelled).",
)
def serve(
    model: Path | None,
    ram: str | None,
    reader: str,
    host: str,
    port: int,
    api_keys: tuple[str, ...],
    api_key_file: Path | None,
    prefix_reuse: str,
    kv_persist_auto: bool,
    served_model_name: str | None,
    queue: int,
    parallel: int,
    kv_slots: int,
    kv_dir: Path | None,
    kv_persist: bool,
    cors: tuple[str, ...],
    hosts: tuple[str, ...],
    header_timeout: float,
    keep_alive_timeout: int,
    stats_interval: float,
    send_timeout: float,
) -> None:
    """Serve the model over HTTP: OpenAI and Anthropic APIs, /metrics, /profile, /experts."""
    import anyio

    from colibri.server import ServerConfig
    from colibri.server import serve as run_server

    if any(not k.strip() for k in api_keys):
        raise click.BadParameter(
            "an empty key (an unset variable?) would leave the server open; give a key or "
            "leave the flag out",
            param_hint="'--api-key'",
        )
    if served_model_name is not None and not served_model_name.strip():
        raise click.BadParameter("the name is empty", param_hint="'--served-model-name'")
    keys = list(api_keys)
    if api_key_file is not None:
        keys += _key_file(api_key_file)
        if not keys:
            raise ColibriError(f"--api-key-file {api_key_file} holds no key")
    try:
        config = ServerConfig(
            host=host,
            port=port,
            api_key=keys[0] if keys else None,
            api_keys=tuple(keys[1:]),
            prefix_reuse=prefix_reuse,  # type: ignore[arg-type]  # click.Choice checked it
            kv_persist_auto=kv_persist_auto,
            served_model_name=served_model_name,
            queue=queue,
            parallel=parallel,
            kv_slots=kv_slots,
            kv_dir=kv_dir,
            kv_persist=kv_persist,
            cors_origins=cors,
            allowed_hosts=hosts,
            header_timeout=header_timeout,
            keep_alive_timeout=keep_alive_timeout,
            stats_interval=stats_interval,
            send_timeout=send_timeout,
        )
    except ValueError as exc:  # pydantic's ValidationError: one line per field, not its dump
        raise ColibriError(f"bad server option: {_one_line(exc)}") from exc
    opts = _options(model, ram, reader)
    ctx = click.get_current_context()
    web = bool(ctx.meta.get("colibri.web"))  # set by `coli web`
    obj = ctx.find_root().obj or {}
    if obj.get("log_level", logging.WARNING) > logging.INFO:  # a server talks: access lines
        from colibri._logging import configure_logging

        configure_logging(obj.get("log_format", "console"), logging.INFO)
    stopped_by = anyio.run(lambda: run_server(config, opts, web=web), backend="asyncio")
    if stopped_by is not None:  # closed cleanly after Ctrl-C / SIGTERM: say so in the status
        raise SystemExit(128 + stopped_by)


# ---------------------------------------------------------------------------- web


def _web(**kwargs: Any) -> None:
    """`coli serve` plus the dashboard (colibri/web) at /."""
    click.get_current_context().meta["colibri.web"] = True
    assert serve.callback is not None
    serve.callback(**kwargs)


main.add_command(
    click.Command(
        "web",
        callback=_web,
        params=list(serve.params),
        help="Serve the API and the web dashboard (Chat, Runtime, Brain, Atlas) at / on one "
        "port; the options are `coli serve`'s.",
        short_help="Serve the API and the web dashboard on one port.",
    )
)


# ---------------------------------------------------------------------------- atlas


@main.command()
@_engine_options
@click.option(
    "--server",
    "server_url",
    default=None,
    help="Measure through a running `coli serve`/`coli web` at this URL (its /experts counts) "
    "instead of loading the model here.",
)
@click.option("--api-key", default=None, help="API key of --server.")
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Output file (default: <state dir>/atlas.json, where GET /atlas finds it).",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Tokens to generate after each prompt.",
)
def atlas(
    model: Path | None,
    ram: str | None,
    reader: str,
    server_url: str | None,
    api_key: str | None,
    out: Path | None,
    tokens: int,
) -> None:
    """Map experts by topic: route bundled prompt sets, lay experts out in 3-D (PCA)."""
    from colibri.atlas import atlas_from_model, atlas_from_server, write_atlas

    opts = _options(model, ram, reader)
    target = out or opts.resolved_state_dir() / "atlas.json"

    import structlog

    progress = structlog.get_logger("colibri.atlas")

    def log(line: str) -> None:
        progress.info("atlas", step=line)  # -v, and JSON under --log-format json

    if server_url:
        data = atlas_from_server(server_url, api_key=api_key, tokens=tokens, log=log)
    else:
        data = atlas_from_model(opts, tokens=tokens, log=log)
    write_atlas(target, data)
    ctx = click.get_current_context()
    chose_dir = ctx.get_parameter_source("state_dir") is not click.core.ParameterSource.DEFAULT
    if server_url and out is None and not chose_dir and opts.state_dir is None:
        progress.warning(
            "the atlas is written on this machine; a server reads <its state dir>/atlas.json "
            "(its GET /atlas 404 names the path): pass --out that path, or copy it there",
            atlas=str(target),
        )
    click.echo(json.dumps({"atlas": str(target), **data["summary"]}))


# ---------------------------------------------------------------------------- convert


# The formats every --experts / --dense / --io / --mtp takes (storage.quant.QuantFormat).
FORMATS_HELP = "f32, bf16, f16, int8, int4-row or int4-gN (N a power of two, 16..256)"


def _format_options(fn: F) -> F:
    """The storage format flags `coli convert` and `coli pull` share."""
    flags = [
        (("--experts",), f"Routed experts format: {FORMATS_HELP} (default int4-g64)."),
        (("--dense",), "Dense matrices format (default int4-g64)."),
        (("--io", "io_fmt"), "embed_tokens/lm_head format (default int8)."),
        (("--mtp",), "MTP layer format (default int8)."),
        (("--shard-size",), "Target output shard size, e.g. 2GiB."),
    ]
    for names, text in reversed(flags):
        kind = _POSITIVE_SIZE if names[0] == "--shard-size" else None
        fn = click.option(*names, type=kind, default=None, help=text)(fn)
    return fn


def _print_conversion(report: Any) -> None:
    """A conversion's summary on stdout, its notes (warnings, resumes) on stderr, once: not
    again when a rerun finds the conversion complete."""
    click.echo(report.summary())
    for note in report.notes:  # (a complete one's: only what this run did, files rewritten)
        click.echo(f"note: {note}", err=True)


def _convert_options(
    experts: str | None, dense: str | None, io_fmt: str | None, mtp: str | None,
    shard_size: str | None,
) -> Any:  # fmt: skip
    from colibri._config import parse_bytes
    from storage.convert import DEFAULTS, ConvertOptions

    given = {"experts": experts, "dense": dense, "io": io_fmt, "mtp": mtp}
    for k, v in given.items():
        if v is not None and not v.strip():  # ("" used to mean the default, silently)
            flag = "--io" if k == "io" else f"--{k}"
            raise click.BadParameter(f"{flag} is empty; formats: {FORMATS_HELP}")
    fields: dict[str, object] = {k: v for k, v in given.items() if v}
    if shard_size:
        fields["shard_size"] = parse_bytes(shard_size)
    return ConvertOptions(**{**DEFAULTS.__dict__, **fields}) if fields else DEFAULTS


@contextlib.contextmanager
def _byte_bar(first: str) -> Iterator[Callable[[int, int | None, str], None]]:
    """A rich progress bar on a TTY, else one structured log line (info, `-v`) per new step:
    ``update(done, total, message)``."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    if not sys.stderr.isatty():
        import structlog

        log = structlog.get_logger("colibri.progress")
        last = [""]

        def log_step(done: int, total: int | None, message: str) -> None:
            step = message.split(":")[0]
            if step != last[0]:
                last[0] = step
                log.info("progress", step=message, done_bytes=done, total_bytes=total)

        yield log_step
        return

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        transient=not sys.stderr.isatty(),
        disable=not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task(first, total=None)

        def update(done: int, total: int | None, message: str) -> None:
            bar.update(task, completed=done, total=total, description=message[:40])

        yield update


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@_format_options
@click.option("--force", is_flag=True, help="Discard a partial conversion in DST and start over.")
def convert(
    src: Path,
    dst: Path,
    experts: str | None,
    dense: str | None,
    io_fmt: str | None,
    mtp: str | None,
    shard_size: str | None,
    force: bool,
) -> None:
    """Convert a Hugging Face checkpoint SRC into a colibri container DST (resumable)."""
    from storage.convert import convert as do_convert

    options = _convert_options(experts, dense, io_fmt, mtp, shard_size)
    with _byte_bar("converting") as update:
        result = do_convert(src, dst, options, force=force, progress=update)
    _print_conversion(result)


@main.command()
@click.argument("repo_id")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
@click.option(
    "--endpoint",
    default=None,
    help="Another hub (a mirror); default https://huggingface.co or HF_ENDPOINT.",
)
@_format_options
@click.option("--force", is_flag=True, help="Discard an interrupted pull into OUT and start over.")
def pull(
    repo_id: str,
    out: Path,
    revision: str | None,
    endpoint: str | None,
    experts: str | None,
    dense: str | None,
    io_fmt: str | None,
    mtp: str | None,
    shard_size: str | None,
    force: bool,
) -> None:
    """Download Hugging Face model REPO_ID into the colibri container OUT, converting each
    shard as it lands (the source is never on disk whole; resumable, pinned to the commit the
    first run saw). A repository that is a colibri container already is downloaded and
    verified. A token comes from HF_TOKEN."""
    from colibri.pull import pull as do_pull

    given = any(v is not None for v in (experts, dense, io_fmt, mtp, shard_size))
    options = _convert_options(experts, dense, io_fmt, mtp, shard_size) if given else None
    import structlog

    log = structlog.get_logger("colibri.pull")
    with _byte_bar("listing") as update:

        def report(done: int, total: int | None, message: str) -> None:
            update(done, total, message)
            if total is None:  # a step (a download, a header), not the byte counter
                log.info("pull", step=message)

        result = do_pull(repo_id, out, revision=revision, endpoint=endpoint, options=options,
                         progress=report, force=force)  # fmt: skip
    if result.convert is not None:
        _print_conversion(result.convert)
    click.echo(
        f"{result.out}: {repo_id}@{result.commit[:12]} {result.kind}; source "
        f"{_binary(result.source_bytes)}, at most {_binary(result.peak_source_bytes)} of it on "
        "disk at once"
    )


# ---------------------------------------------------------------------------- doctor


@main.command()
@_model_option
@_shard_dirs_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option(
    "--verify",
    is_flag=True,
    help="Also read every byte: shards against the manifest's sha256 (or, without a manifest, "
    "every float tensor and scale scanned for NaN/inf).",
)
def doctor(model: Path | None, model_dirs: tuple[Path, ...], as_json: bool, verify: bool) -> None:
    """Read-only health check of a model directory."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from storage.doctor import run_doctor

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not (verify and sys.stderr.isatty()),
    ) as bar:
        task = bar.add_task("verifying", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[-40:])

        opts = EngineOptions(model=model, model_dirs=model_dirs)
        report = run_doctor(
            opts.resolved_model(), verify=verify, progress=progress, shard_dirs=opts.model_dirs
        )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for line in report.render_lines():
            click.echo(line)
    sys.exit(report.exit_code)


# ---------------------------------------------------------------------------- chat


def _session_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from colibri._chat import SESSION_RE

    if not SESSION_RE.fullmatch(value):
        raise click.BadParameter(
            "use 1-64 letters, digits, '.', '_' or '-', beginning with a letter or a digit"
        )
    return value


@main.command()
@_engine_options
@click.option(
    "--max-tokens", "-n", type=_TOKENS, default=512, show_default=True,
    help="Most tokens per reply.",
)  # fmt: skip
@click.option(
    "--temperature", "-t", type=_TEMPERATURE, default=0.7, show_default=True, help="0 = greedy."
)
@click.option("--top-p", type=_TOP_P, default=1.0, show_default=True)
@click.option("--top-k", type=_TOP_K, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=_SEED, default=None, help="Sampling seed (turn k uses seed + k).")
@click.option("--system", default=None, help="System prompt of a new conversation.")
@click.option(
    "--session",
    default="default",
    show_default=True,
    callback=_session_name,
    help="Conversation name: its messages and KV cache are kept in the state dir.",
)
@click.option("--ignore-eos", is_flag=True, help="Do not stop a reply at end-of-sequence tokens.")
@click.option("--verbose", "-v", is_flag=True, help="Show prompt tokens reused vs computed.")
def chat(
    model: Path | None,
    ram: str | None,
    reader: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    system: str | None,
    session: str,
    ignore_eos: bool,
    verbose: bool,
) -> None:
    """Talk with the model: streamed replies, resumable sessions (:q quits, :reset clears)."""
    from colibri._chat import ChatSettings, run_chat

    settings = ChatSettings(
        session=session,
        system=system,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=ignore_eos,
        verbose=verbose,
    )
    run_chat(_options(model, ram, reader), settings, _open_with_progress)


# ---------------------------------------------------------------------------- plan


@main.command()
@_model_option
@click.option(
    "--ram",
    cls=_EnvOption,
    env_var_name="COLI_RAM",
    type=_SIZE,
    default=env_defaults().get("ram_budget", "auto"),
    show_default=True,
    help="RAM budget to plan for, e.g. 24GiB, or auto (env COLI_RAM).",
)
@click.option(
    "--state-dir",
    cls=_EnvOption,
    env_var_name="COLI_STATE_DIR",
    type=click.Path(path_type=Path, file_okay=False),
    default=env_defaults().get("state_dir"),
    help="Where .coli_usage lives (pinned experts); env COLI_STATE_DIR.",
)
@click.option("--disk-gbps", type=_GBPS, default=None, help="Disk read speed (default: assumed).")
@click.option(
    "--compute-gbps", type=_GBPS, default=None, help="Matmul weight GB/s (default: assumed)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_shard_dirs_option
def plan(
    model: Path | None,
    model_dirs: tuple[Path, ...],
    ram: str,
    state_dir: Path | None,
    disk_gbps: float | None,
    compute_gbps: float | None,
    as_json: bool,
) -> None:
    """How a RAM budget splits (dense, KV, expert tiers), projected hit rate, bottleneck."""
    from colibri._config import parse_bytes
    from colibri._engine import ENGINE_ID, USAGE_FILE
    from runtime import planner
    from storage.container import Container
    from storage.usage import parse_usage

    opts = EngineOptions(
        model=model, ram_budget=parse_bytes(ram), state_dir=state_dir, model_dirs=model_dirs
    )
    c = Container.open(opts.resolved_model(), shard_dirs=opts.model_dirs)
    counts = None
    try:  # read-only: a damaged history is ignored here (Engine.open sets it aside)
        text = (opts.resolved_state_dir() / USAGE_FILE).read_text(encoding="ascii")
        counts = parse_usage(text, c.arch.total_layers, c.arch.n_routed_experts, ENGINE_ID).counts
    except (OSError, UnicodeDecodeError, ColibriError, ValueError):
        pass
    p = planner.make_plan(
        c,
        opts.ram_budget,
        kv_reserve_tokens=opts.kv_reserve_tokens,
        pin=opts.pin,
        pin_fraction=opts.pin_fraction,
        pin_min_selections=opts.pin_min_selections,
        usage_counts=counts,
        disk_gbps=disk_gbps or planner.ASSUMED_DISK_GBPS,
        compute_gbps=compute_gbps or planner.ASSUMED_COMPUTE_GBPS,
    )
    if as_json:
        click.echo(json.dumps(p.to_json()))
    else:
        for line in p.render_lines():
            click.echo(line)


# ---------------------------------------------------------------------------- bench


@main.group()
def bench() -> None:
    """Benchmarks; each prints its result as one JSON object on the last line."""


class _LoadBar:
    """A progress display of the model load on a terminal (stderr): one bar per step (dense
    weights, experts read into RAM, pinned experts). Off a terminal it shows nothing; the
    engine logs each step at info level (``-v``)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("loading {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()

    def update(self, step: str, done: int, total: int) -> None:
        if self._bar is None:
            return
        task = self._tasks.get(step)
        if task is None:
            task = self._tasks[step] = self._bar.add_task(step, total=total)
        self._bar.update(task, completed=done, total=total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def _open_with_progress(opts: EngineOptions) -> Iterator[Any]:
    """``open_model`` with the load shown (:class:`_LoadBar`); the display ends once the model
    is open (or the load failed)."""
    from colibri._engine import open_model
    from runtime.kernels.cache import kernels_cached

    if sys.stderr.isatty() and not kernels_cached():
        click.echo(
            "first run here: compiling the kernels for this CPU (a minute or two; later runs "
            "start at once)",
            err=True,
        )
    with contextlib.ExitStack() as stack:
        bar = _LoadBar()
        try:
            m = stack.enter_context(open_model(progress=bar.update, **opts.model_dump()))
        finally:
            bar.close()
        yield m


def _bench_progress() -> Any:
    """A rich progress display on a terminal (stderr); a no-op elsewhere."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )


@bench.command("storage")
@click.option(
    "--model",
    "target",
    type=click.Path(path_type=Path, exists=True),
    default=env_defaults().get("model"),
    help="Model directory (its expert extents) or any big file (default: the demo model).",
)
@click.option(
    "--reads",
    type=click.IntRange(min=1),
    default=200,
    show_default=True,
    help="Random reads per pass, at least (more when a pass is shorter than --min-pass).",
)
@click.option(
    "--min-pass",
    type=click.FloatRange(min=0),
    default=0.2,
    show_default=True,
    help="Seconds a pass must last (fio times in whole ms): shorter, every pass, fio's too, "
    "reads more. 0: never extend.",
)
@click.option(
    "--qd", type=click.IntRange(1, 256), default=1, show_default=True, help="Reads in flight."
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Passes per backend.",
)
@click.option("--block", default=None, help="Bytes per read, e.g. 19MiB (default: one expert).")
@click.option(
    "--backends",
    default="uring,uring-fixed,threads,buffered",
    show_default=True,
    help="Comma-separated reader backends.",
)
@click.option("--no-fio", is_flag=True, help="Do not run fio (figure is then null).")
@click.option("--no-drop-caches", is_flag=True, help="Keep the page cache between passes.")
@click.option(
    "--warm-up/--no-warm-up",
    default=True,
    show_default=True,
    help="Read each round's extents once, untimed, before its timed passes (a virtual disk's "
    "host caches what the first pass read: without it, whoever goes first pays).",
)
@click.option(
    "--huge/--no-huge",
    default=True,
    show_default=True,
    help="Read into buffers advised for transparent huge pages, as the expert store does.",
)
def bench_storage_cmd(
    target: Path | None,
    reads: int,
    min_pass: float,
    qd: int,
    repeats: int,
    block: str | None,
    backends: str,
    no_fio: bool,
    no_drop_caches: bool,
    warm_up: bool,
    huge: bool,
) -> None:
    """Cold expert-shaped random reads through each reader backend, against fio."""
    import anyio

    from colibri._config import parse_bytes
    from storage.bench import bench_storage

    names = [b for b in backends.split(",") if b]
    unknown = sorted(set(names) - {"uring", "uring-fixed", "threads", "buffered"})
    if unknown or not names:
        what = f"unknown backend(s) {', '.join(unknown)}" if unknown else "no backend given"
        raise click.BadParameter(what, param_hint="--backends")
    block_bytes = parse_bytes(block)
    if block_bytes is not None and (block_bytes <= 0 or block_bytes % 4096):
        # O_DIRECT reads whole 4 KiB pages: another size would credit the backends fewer bytes
        # than they (and fio) moved
        raise click.BadParameter(
            f"{block!r} is not a positive multiple of 4 KiB", param_hint="--block"
        )
    path = target or default_model_path()
    with _bench_progress() as bar:
        per_round = len(names) + (0 if no_fio else 1) + (1 if warm_up else 0)
        task = bar.add_task("reading", total=repeats * per_round)

        def log(line: str) -> None:
            if bar.disable:
                click.echo(line, err=True)
            elif line.startswith("extending"):  # the round is read again, with more reads
                bar.reset(task, description=line.strip())
            else:
                passed = line.startswith(("pass ", "warm-up "))
                bar.update(task, advance=1 if passed else 0, description=line.strip())

        result = anyio.run(
            lambda: bench_storage(
                path,
                backends=names,
                reads=reads,
                block=block_bytes,
                queue_depth=qd,
                repeats=repeats,
                drop_caches=False if no_drop_caches else None,
                fio=not no_fio,
                log=log,
                huge=huge,
                min_pass_s=min_pass,
                warm_up=warm_up,
            )
        )
    click.echo(json.dumps(result))


def _bench_script(name: str, args: list[str], what: str) -> None:
    """Run tools/bench/NAME.py (source checkouts only), its lines shown as they come."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "tools" / "bench" / f"{name}.py"
    if not script.is_file():
        raise ColibriError(
            f"{script} not found: the benchmarks ship with the colibri source checkout"
        )
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    lines: list[str] = []
    with _bench_progress() as bar:
        bar.add_task(what, total=None)
        proc = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if bar.disable:
                click.echo(lines[-1])
            elif len(lines) > 1:  # one line behind: the last (the JSON) goes to stdout below
                bar.console.print(lines[-2], markup=False, highlight=False)
        rc = proc.wait()
    if not bar.disable and lines:
        click.echo(lines[-1])
    if rc != 0:
        raise ColibriError(f"{script.name} failed with exit status {rc}")


@bench.command("kernels")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=15,
    show_default=True,
    help="Interleaved rounds.",
)
def bench_kernels(rounds: int) -> None:
    """numba int4/int8 matmul kernels against DRAM read bandwidth (a minute or two, and up to
    ~16 GiB of RAM for the GLM-5-sized lm_head case)."""
    _bench_script("kernels", ["--rounds", str(rounds)], "kernel benchmark")


@bench.command("stream")
@click.option(
    "--model",
    type=click.Path(path_type=Path),
    default=None,
    help="Synthetic GLM-5-geometry model (built on first use; default /var/tmp/colibri-synth).",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=24,
    show_default=True,
    help="Decode steps per run (the turn generates one token more: its first comes from the "
    "prompt's prefill, and the JSON's tokens count it).",
)
@click.option(
    "--fraction",
    type=_Finite(min=0.0, max=1.0, min_open=True),
    default=0.2,
    show_default=True,
    help="Share of experts in RAM (0 < F <= 1).",
)
@click.option(
    "--reader",
    type=click.Choice(["auto", "uring", "threads", "buffered"]),
    default="auto",
    show_default=True,
)
@click.option(
    "--reads",
    type=click.IntRange(min=1),
    default=60,
    show_default=True,
    help="Reads of the storage probe.",
)
@click.option(
    "--prefetch",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="The mode measured (the others run too, for the comparison figures).",
)
def bench_stream(
    model: Path | None, tokens: int, fraction: float, reader: str, reads: int, prefetch: str
) -> None:
    """Streaming decode against its I/O bound (storage GB/s / bytes per token)."""
    args = ["--tokens", str(tokens), "--fraction", str(fraction), "--reader", reader]
    args += ["--reads", str(reads), "--prefetch", prefetch]
    if model is not None:
        args += ["--model", str(model)]
    _bench_script("stream", args, "streaming benchmark")


# ---------------------------------------------------------------------------- info


@main.command()
@_model_option
@_shard_dirs_option
@click.option("--json", "as_json", is_flag=True)
def info(model: Path | None, model_dirs: tuple[Path, ...], as_json: bool) -> None:
    """Model and machine summary."""
    from runtime.kernels.isa import kernel_info
    from storage.arch import math_keys, rope_keys, rotary_keys
    from storage.container import Container

    opts = EngineOptions(model=model, model_dirs=model_dirs)
    c = Container.open(opts.resolved_model(), shard_dirs=opts.model_dirs)
    a = c.arch
    where = str(c.path / "config.json")
    math = math_keys(c.config, where)  # a value the runtime refuses is an error here too
    rope_keys(c.config, where)
    rotary_keys(c.config, where)
    experts = c.expert_layers()
    moe_layers = len([layer for layer in experts if layer < a.num_hidden_layers])
    data: dict[str, Any] = {
        "model": str(c.path),
        "model_type": a.model_type,
        "layers": a.num_hidden_layers,
        "mtp_layers": a.num_mtp_layers,
        "hidden": a.hidden_size,
        "vocab": a.vocab_size,
        "context": math["max_position_embeddings"],
        "routed_experts_per_layer": a.n_routed_experts,
        "experts_per_token": a.num_experts_per_tok,
        "moe_layers": moe_layers,
        **_parameters(c, moe_layers),
        "quantization": _formats(c),
        # what one read of a routed expert transfers: its blob and its scales (as coli plan)
        "expert_bytes": max(
            (_read_bytes(x) for x in c.expert_extents() if x.layer < a.num_hidden_layers),
            default=0,
        ),
        "experts_total_bytes": sum(_read_bytes(x) for x in c.expert_extents()),
        "cpu_count": os.cpu_count(),
        "kernels": kernel_info().describe(),
        "fast_int8_kernels": f"{kernel_info().int8_dot}; opt-in, lossy (--kernels fast-int8)",
        "ram_total_bytes": _mem_total(),
        **_machine(c.path),
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            click.echo(f"{k:26} {_human(k, v)}")


@main.command(name="list")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def list_cmd(paths: tuple[Path, ...], as_json: bool) -> None:
    """Models on this machine: each PATH is a model dir or a directory of them (default: the
    bundled demo model and COLI_MODEL), with the state the engine keeps for each (learned
    routing, chat sessions, KV files) and the state dirs of models not listed."""
    from colibri._inventory import list_models, orphan_state_dirs
    from storage.units import format_bytes

    roots = list(paths)
    if not roots:
        env_model = env_defaults().get("model")
        roots = [default_model_path(), *([Path(env_model)] if env_model else [])]
    models = list_models(roots)
    orphans = orphan_state_dirs(models)
    if as_json:
        out = {
            "models": [m.as_dict() for m in models],
            "other_state_dirs": [
                {
                    "path": str(d.path),
                    "usage": d.usage,
                    "kv_files": d.kv_files,
                    "kv_bytes": d.kv_bytes,
                    "chat_sessions": d.chat_sessions,
                }
                for d in orphans
            ],
        }
        click.echo(json.dumps(out, indent=2))
        return
    if not models:
        click.echo("no model directories (a directory with config.json) under " +
                   ", ".join(str(r) for r in roots))  # fmt: skip
    for m in models:
        if m.problem is not None:
            click.echo(f"{m.path}\n    unusable: {m.problem}")
            continue
        kind = "container" if m.converted else "HF checkpoint"
        state = f"{m.state.describe()} in {m.state.path}" if m.state is not None else "never run"
        click.echo(
            f"{m.path}\n    {m.model_type}, {m.layers} layers x {m.experts} experts, "
            f"{format_bytes(m.shard_bytes)} ({kind}); state: {state}"
        )
    if orphans:
        click.echo("state dirs of models not listed:")
        for d in orphans:
            kv = f", {format_bytes(d.kv_bytes)}" if d.kv_files else ""
            click.echo(f"    {d.path}: {d.describe()}{kv}")


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The coli serve to ask.")  # fmt: skip
@click.option("--api-key", default=None, help="Its API key, if it was started with one.")
@click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Read the API key from this file's first key line (keeps it out of `ps`).",
)
@click.option("--json", "as_json", is_flag=True)
def ps(url: str, api_key: str | None, api_key_file: Path | None, as_json: bool) -> None:
    """What a running `coli serve` has loaded: model, queue, KV slots and expert tiers."""
    from colibri._inventory import server_status
    from storage.units import format_bytes

    if api_key is not None and api_key_file is not None:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        keys = _key_file(api_key_file)
        if not keys:
            raise ColibriError(f"--api-key-file {api_key_file} holds no key")
        api_key = keys[0]
    st = server_status(url, api_key)
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    q, ex, cl = st["queue"], st["engine"]["experts"], st["engine"].get("cluster")
    click.echo(f"server     {st['url']}  model {st['model']}, context {st['context_length']}")
    click.echo(
        f"queue      {q['running']} running, {q['waiting']} waiting "
        f"(parallel {q['parallel']}, queue limit {q['limit']})"
    )
    if isinstance(cl, dict) and cl.get("workers"):
        # --ray: the workers hold the experts (the store described below serves only a failed
        # worker's: it alone read as "streaming, hit rate 0 %")
        ws = cl["workers"]
        alive = sum(1 for w in ws if w.get("alive"))
        modes = "/".join(sorted({str(w.get("mode") or "?") for w in ws}))
        click.echo(
            f"experts    on {len(ws)} expert workers ({alive} alive, {modes}), "
            f"{sum(int(w.get('fallback_experts', 0)) for w in ws)} computed here instead"
        )
    elif ex.get("mode") == "streaming":
        hit = ex.get("hit_rate")
        click.echo(
            f"experts    streaming: {ex.get('pinned', 0)} pinned in all + "
            f"{ex.get('lru_slots_per_layer', 0)} cache slots per layer, hit rate "
            + ("-" if hit is None else f"{100 * hit:.1f} %")
            + f", {format_bytes(ex.get('bytes_read', 0))} read"
        )
    else:
        click.echo(f"experts    {ex.get('mode', '?')} (every expert in RAM)")
    eng = st["engine"]
    click.echo(
        f"tokens     {eng.get('prompt_tokens', 0)} prompt ({eng.get('prompt_tokens_reused', 0)} "
        f"reused from cache), {eng.get('generated_tokens', 0)} generated"
    )
    slots = st["slots"]
    if not slots:
        click.echo("slots      none (--kv-slots 0)")
    for s in slots:
        busy = ", busy" if s["busy"] else ""
        click.echo(
            f"slot {s['slot']:<5} {s['tokens']} tokens ({s['persisted_tokens']} persisted, "
            f"{s['turns']} turns{busy})"
        )


def _read_bytes(x: Any) -> int:
    """Bytes one read of expert extent ``x`` transfers: the blob and its scales."""
    return int(x.nbytes) + sum(int(s.nbytes) for s in x.scales.values() if s is not None)


def _parameters(c: Any, moe_layers: int) -> dict[str, int]:
    """Parameters of every tensor (MTP included), and those one token of the main model uses:
    everything but the routed experts, plus top-k experts in each MoE layer."""
    import math
    import re

    main_layers = c.arch.num_hidden_layers
    layer_of = re.compile(r"model\.layers\.(\d+)\.")
    total = expert = mtp = 0
    per_expert = 0
    for n in c.names():
        e = c.entry(n)
        k = math.prod(e.shape)
        total += k
        if e.role == "expert":
            expert += k
        elif e.role == "mtp":
            mtp += k
        elif (m := layer_of.match(n)) and int(m.group(1)) >= main_layers:
            mtp += k  # the MTP layer's norms, router and bias (kept in float32)
    # the main layers' experts (role "expert"; the MTP layer's count as "mtp")
    n_experts = sum(x.layer < c.arch.num_hidden_layers for x in c.expert_extents())
    if n_experts:
        per_expert = expert // n_experts
    top_k = c.arch.num_experts_per_tok or 0
    return {
        "parameters": total,
        "active_parameters": total - expert - mtp + top_k * per_expert * moe_layers,
    }


def _formats(c: Any) -> dict[str, str]:
    """Storage formats per role ("expert": "int4-g64", ...), the most common first."""
    from collections import Counter

    seen: dict[str, Counter[str]] = {}
    for n in c.names():
        e = c.entry(n)
        if e.fmt is not None and e.role is not None:
            seen.setdefault(e.role, Counter())[e.fmt.name] += 1
    return {role: "/".join(f for f, _ in cnt.most_common()) for role, cnt in seen.items()}


def _human(key: str, value: Any) -> str:
    """A value of `coli info` for people: binary units for bytes, B/M for parameter counts."""
    if value is None:
        return "-"
    if key.endswith("bytes") and isinstance(value, int):
        return _binary(value)
    if key.endswith("parameters") and isinstance(value, int):
        for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if value >= div:
                return f"{value / div:.2f}{unit} ({value})"
        return str(value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _machine(model_dir: Path) -> dict[str, Any]:
    """CPU model, available RAM, and the model directory's filesystem and free space."""
    from runtime.budget import mem_available
    from storage.reader import filesystem_type

    cpu = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
            cpu = next(names, None)
    except OSError:
        pass
    try:
        st = os.statvfs(model_dir)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return {
        "cpu_model": cpu,
        "ram_available_bytes": mem_available(),
        "model_fs_type": filesystem_type(model_dir),
        "model_fs_free_bytes": free,
    }


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- coli mirror


def _mirror_options(fn: F) -> F:
    fn = _shard_dirs_option(fn)
    fn = click.option(
        "--state-dir",
        cls=_EnvOption,
        env_var_name="COLI_STATE_DIR",
        type=click.Path(path_type=Path, file_okay=False),
        default=env_defaults().get("state_dir"),
        help="Where .coli_usage lives (default: as for `coli run`).",
    )(fn)
    fn = click.option(
        "--budget", default=None, help="Bytes the mirror may use, e.g. 50GiB (default: free space)."
    )(fn)
    fn = click.option(
        "--to",
        "to",
        type=click.Path(path_type=Path),
        required=True,
        help="The mirror directory (on the other drive).",
    )(fn)
    return _model_option(fn)


def _mirror_plan(
    model: Path | None,
    to: Path,
    budget: str | None,
    state_dir: Path | None,
    model_dirs: tuple[Path, ...] = (),
) -> Any:
    from colibri._config import parse_bytes
    from colibri._engine import ENGINE_ID, USAGE_FILE
    from storage.multidisk.staging import plan_mirror

    opts = EngineOptions(model=model, state_dir=state_dir, model_dirs=model_dirs)
    return plan_mirror(
        opts.resolved_model(),
        to,
        budget=parse_bytes(budget),
        usage_path=opts.resolved_state_dir() / USAGE_FILE,
        engine_id=ENGINE_ID,
        model_dirs=opts.model_dirs,
    )


@main.group()
def mirror() -> None:
    """Put the hottest experts' shard files on a second drive (use it with --mirror DIR)."""


@mirror.command("plan")
@_mirror_options
def mirror_plan(**options: Any) -> None:
    """Rank experts by .coli_usage and print (JSON) the shard files that fit the budget."""
    plan = _mirror_plan(**options)
    click.echo(json.dumps(plan.to_json(), indent=1))


@mirror.command("stage")
@_mirror_options
def mirror_stage(**options: Any) -> None:
    """Copy the planned shard files (atomic, checksummed, resumable); print a JSON report."""
    from storage.multidisk.staging import stage_mirror

    plan = _mirror_plan(**options)
    last = [""]

    def progress(name: str, done: int, total: int) -> None:
        if name != last[0] or done == total:
            last[0] = name
            click.echo(f"{name}: {done / 2**20:.1f}/{total / 2**20:.1f} MiB", err=True)

    report = stage_mirror(plan, progress=progress)
    click.echo(json.dumps({"plan_bytes": plan.nbytes, **report.to_json()}, indent=1))


@mirror.command("verify")
@_model_option
@_shard_dirs_option
@click.option("--to", "to", type=click.Path(path_type=Path), required=True, help="The mirror.")
def mirror_verify(model: Path | None, to: Path, model_dirs: tuple[Path, ...]) -> None:
    """Re-check sizes, header bytes and sha256 of every shard in the mirror (exit 1 if bad)."""
    from storage.multidisk.staging import verify_mirror

    opts = EngineOptions(model=model, model_dirs=model_dirs)
    report = verify_mirror(opts.resolved_model(), to, model_dirs=opts.model_dirs)
    click.echo(json.dumps(report.to_json(), indent=1))
    if not report.ok:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()

"""The ``coli`` command.

Every command takes ``--model DIR`` (default: ``COLI_MODEL``, else the bundled demo model).
Errors a user can cause print one line with a hint and exit non-zero; ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from colibri._config import EngineOptions, default_model_path, env_defaults
from storage.errors import ColibriError

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["main"]


def _fail(message: str, hint: str | None = None) -> None:
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


def _engine_options(fn: F) -> F:
    env = env_defaults()
    fn = click.option(
        "--ram",
        "ram",
        default=env.get("ram_budget"),
        help="RAM budget for the whole engine, e.g. 6GiB (env COLI_RAM; default: auto).",
    )(fn)
    fn = click.option(
        "--reader",
        type=click.Choice(["auto", "uring", "threads", "buffered"]),
        default=env.get("reader", "auto"),
        show_default=True,
        help="Expert read backend (env COLI_READER).",
    )(fn)
    return _model_option(fn)


def _options(model: Path | None, ram: str | None, reader: str) -> EngineOptions:
    return EngineOptions(model=model, ram_budget=ram, reader=reader)  # type: ignore[arg-type]


class _Group(click.Group):
    """Maps ColibriError (and a few OS errors) to one clear line unless --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ColibriError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            _fail(str(exc), _hint_for(exc))
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)


def _hint_for(exc: ColibriError) -> str | None:
    from storage.errors import ContainerError, ConversionError, FormatError

    if isinstance(exc, FormatError):
        return "run `coli doctor --model DIR` for a full report"
    if isinstance(exc, ConversionError):
        return "see `coli convert --help`"
    if isinstance(exc, ContainerError):
        return "pass --model DIR pointing at a converted model, or omit it for the demo model"
    return None


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option(
    "--log-format",
    type=click.Choice(["console", "json"]),
    default=env_defaults().get("log_format", "console"),
    help="Structured log output (env COLI_LOG_FORMAT).",
)
@click.version_option(package_name="colibri")
@click.pass_context
def main(ctx: click.Context, debug: bool, log_format: str) -> None:
    """colibri: run giant Mixture-of-Experts models on ordinary machines."""
    from colibri._logging import configure_logging

    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    configure_logging(log_format)


# ---------------------------------------------------------------------------- run


@main.command()
@_engine_options
@click.argument("prompt")
@click.option("--max-tokens", "-n", default=64, show_default=True, help="Tokens to generate.")
@click.option("--temperature", "-t", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed (same seed, same output).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--stats", "show_stats", is_flag=True, help="Print counters as JSON at the end.")
def run(
    model: Path | None,
    ram: str | None,
    reader: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    raw: bool,
    show_stats: bool,
) -> None:
    """Generate a completion for PROMPT and print it as it streams."""
    from colibri._engine import TokenEvent, open_model
    from colibri.tokenizer import ChatTokenizer

    opts = _options(model, ram, reader)
    with open_model(**opts.model_dump()) as m:
        c = m.container
        tok_path = c.tokenizer_path()
        if tok_path is None:
            raise ColibriError(f"{c.path}: no tokenizer.json, cannot turn text into tokens")
        tok = ChatTokenizer(tok_path, c.tokenizer_config())
        if raw or not tok.has_chat_template:
            ids = tok.encode(prompt)
        else:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
        t0 = time.perf_counter()
        printed = ""
        toks: list[int] = []
        engine = m.engine

        async def stream() -> list[int]:
            nonlocal printed
            async for ev in engine.generate(
                ids,
                max_new_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
            ):
                if isinstance(ev, TokenEvent):
                    toks.append(ev.token_id)
                    text = tok.decode(toks)
                    if text.startswith(printed):
                        click.echo(text[len(printed) :], nl=False)
                        printed = text
            return toks

        m._portal.call(stream)
        click.echo()
        dt = time.perf_counter() - t0
        if show_stats:
            click.echo(json.dumps({"tokens": len(toks), "seconds": dt, **m.stats()}, default=str))


# ---------------------------------------------------------------------------- convert


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--experts", default=None, help="Routed experts format (default int4-g64).")
@click.option("--dense", default=None, help="Dense matrices format (default int4-g64).")
@click.option("--io", "io_fmt", default=None, help="embed_tokens/lm_head format (default int8).")
@click.option("--mtp", default=None, help="MTP layer format (default int8).")
@click.option("--shard-size", default=None, help="Target output shard size, e.g. 2GiB.")
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
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    from storage.convert import DEFAULTS, ConvertOptions
    from storage.convert import convert as do_convert

    base = DEFAULTS
    from colibri._config import parse_bytes

    given = {"experts": experts, "dense": dense, "io": io_fmt, "mtp": mtp}
    fields: dict[str, object] = {k: v for k, v in given.items() if v}
    if shard_size:
        fields["shard_size"] = parse_bytes(shard_size)
    options = ConvertOptions(**{**base.__dict__, **fields}) if fields else base
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        transient=not sys.stderr.isatty(),
        disable=not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("converting", total=None)

        def progress(done: int, total: int, message: str) -> None:
            bar.update(task, completed=done, total=total, description=message[:40])

        result = do_convert(src, dst, options, force=force, progress=progress)
    click.echo(str(result))


# ---------------------------------------------------------------------------- doctor


@main.command()
@_model_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
def doctor(model: Path | None, as_json: bool) -> None:
    """Read-only health check of a model directory."""
    from storage.doctor import run_doctor

    report = run_doctor(model or default_model_path())
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for line in report.render_lines():
            click.echo(line)
    sys.exit(report.exit_code)


# ---------------------------------------------------------------------------- info


@main.command()
@_model_option
@click.option("--json", "as_json", is_flag=True)
def info(model: Path | None, as_json: bool) -> None:
    """Model and machine summary."""
    from storage.container import Container

    c = Container.open(model or default_model_path())
    a = c.arch
    experts = c.expert_layers()
    data: dict[str, Any] = {
        "model": str(c.path),
        "model_type": a.model_type,
        "layers": a.num_hidden_layers,
        "mtp_layers": a.num_mtp_layers,
        "hidden": a.hidden_size,
        "vocab": a.vocab_size,
        "routed_experts_per_layer": a.n_routed_experts,
        "moe_layers": len(experts),
        "expert_bytes": c.expert_nbytes,
        "experts_total_bytes": c.expert_nbytes * a.n_routed_experts * len(experts),
        "cpu_count": os.cpu_count(),
        "ram_total_bytes": _mem_total(),
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            click.echo(f"{k:26} {v}")


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


if __name__ == "__main__":  # pragma: no cover
    main()

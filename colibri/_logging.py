"""structlog set-up: a console renderer for people, JSON lines for machines (stderr)."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "default_library_logging"]


def default_library_logging() -> None:
    """Used by an engine opening in a program that has not configured structlog: warnings and
    errors on stderr. structlog's own default prints every level on stdout, which mixed the
    engine's info lines ("loaded ...") into the output of a script using the Python API. A
    program that configured structlog (before or after) keeps its own set-up."""
    if not structlog.is_configured():
        configure_logging("console", logging.WARNING)


def configure_logging(fmt: str = "console", level: int = logging.WARNING) -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        # plain tracebacks: structlog's default (rich) prints every frame's local variables,
        # which in a server holds API keys, request headers and users' prompts
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )

"""A container's chat template, compiled the way Hugging Face ``transformers`` compiles it: a
jinja2 sandbox with the same helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII and ``<`` as is, ``{% break %}``/``{% continue %}`` and the
``{% generation %}`` block). ``coli doctor`` compiles it to check it; the tokenizer renders it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from storage.errors import ConfigError

__all__ = [
    "CHAT_TEMPLATE_NAME",
    "chat_template_source",
    "compile_chat_template",
    "tool_use_template_source",
]

CHAT_TEMPLATE_NAME = "chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
    transformers): renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja declares it as an instance attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def compile_chat_template(source: str, where: str) -> Template:
    """The compiled template; a ConfigError naming ``where`` if it does not compile."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ConfigError(f"{where}: the chat template does not compile: {exc}") from exc


def chat_template_source(
    model_dir: Path, tokenizer_config: Mapping[str, Any]
) -> tuple[str | None, str]:
    """(template text or None, where it came from): ``chat_template.jinja`` in ``model_dir``
    wins over ``chat_template`` in tokenizer_config.json, which may also be a list of named
    templates (the one named "default", else the first)."""
    template: object = tokenizer_config.get("chat_template")
    where = f"{model_dir / 'tokenizer_config.json'}: chat_template"
    jinja_file = model_dir / CHAT_TEMPLATE_NAME
    if jinja_file.is_file():
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{jinja_file}: cannot read: {exc}") from exc
        where = str(jinja_file)
    if isinstance(template, list):  # HF allows a list of named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return (template if isinstance(template, str) else None), where


def tool_use_template_source(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The template named "tool_use" among tokenizer_config.json's named templates, which
    transformers renders when tools are given (Mistral's and Mixtral's instruct models ship
    such a pair), or None (one template serves both; ``chat_template.jinja`` wins, as in
    :func:`chat_template_source`)."""
    if (model_dir / CHAT_TEMPLATE_NAME).is_file():
        return None
    template = tokenizer_config.get("chat_template")
    if not isinstance(template, list):
        return None
    for t in template:
        if (
            isinstance(t, dict)
            and t.get("name") == "tool_use"
            and isinstance(t.get("template"), str)
        ):
            return str(t["template"])
    return None

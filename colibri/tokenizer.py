"""Text <-> token ids with the model directory's own tokenizer and chat template.

Uses the ``tokenizers`` library (``tokenizer.json``) and renders ``chat_template`` from
``tokenizer_config.json`` with jinja2 in a sandbox, as Hugging Face does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from storage.errors import ConfigError

__all__ = ["ChatTokenizer"]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class ChatTokenizer:
    """The model's tokenizer plus its chat template."""

    def __init__(self, tokenizer_file: Path, tokenizer_config: Mapping[str, Any]) -> None:
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ConfigError(f"{tokenizer_file}: cannot load tokenizer ({exc})") from exc
        self.config = dict(tokenizer_config)
        template = self.config.get("chat_template")
        if isinstance(template, list):  # HF allows a list of named templates
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self._template_src: str | None = template if isinstance(template, str) else None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self._template_src) if self._template_src else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render messages with the model's template (plain ``role: content`` lines if none)."""
        if self._template is None:
            lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
            if add_generation_prompt:
                lines.append("assistant:")
            return "\n".join(lines)
        special = {
            k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)
        }
        try:
            return str(
                self._template.render(
                    messages=list(messages),
                    add_generation_prompt=add_generation_prompt,
                    **special,
                    **extra,
                )
            )
        except TemplateError as exc:
            raise ConfigError(f"chat template failed to render: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **extra))

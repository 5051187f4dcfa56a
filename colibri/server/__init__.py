"""The HTTP server: OpenAI- and Anthropic-compatible APIs over one :class:`~colibri.Engine`.

``coli serve`` runs it; embed it with :func:`create_app` (an ASGI app around an open engine)."""

from colibri.server.app import create_app, serve
from colibri.server.state import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]

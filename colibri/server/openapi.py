"""``GET /openapi.json``: an OpenAPI 3.1 document of the generation and read-only routes.

The request bodies come straight from the pydantic models the routes validate with
(:mod:`colibri.server.schemas`), so the document cannot drift from what the server accepts;
``model`` is narrowed to the one model this server serves. Clients and fuzzers
(``tests/test_server_fuzz.py`` runs schemathesis against it) read it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from colibri.server.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest

__all__ = ["openapi_document", "openapi_route"]

_ERRORS = {
    "400": "invalid request (bad JSON, bad text, unsupported option, prompt too long, ...)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "body too large",
    "422": "a field of the wrong type or range",
    "429": "queue full (Retry-After)",
}


def _responses(ok: str) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": ok}}
    out.update({code: {"description": why} for code, why in _ERRORS.items()})
    return out


def openapi_document(model_name: str, version: str) -> dict[str, Any]:
    bodies: list[tuple[str, type[BaseModel]]] = [
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/completions", CompletionRequest),
        ("/v1/messages", MessagesRequest),
    ]
    _, top = models_json_schema(
        [(m, "validation") for _, m in bodies], ref_template="#/components/schemas/{model}"
    )
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    for _, m in bodies:  # the one model served here
        schemas[m.__name__]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    paths: dict[str, Any] = {}
    for path, m in bodies:
        paths[path] = {
            "post": {
                "operationId": m.__name__,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{m.__name__}"}
                        }
                    },
                },
                "responses": _responses("the completion (JSON, or SSE with stream: true)"),
            }
        }
    for path, what in (
        ("/health", "liveness"),
        ("/v1/models", "the served model"),
        ("/metrics", "Prometheus metrics"),
        ("/profile", "recent turns, queue, slots, engine counters"),
        ("/experts", "tier and routing heat per expert"),
    ):
        paths[path] = {"get": {"operationId": path.strip("/").replace("/", "_"),
                               "responses": _responses(what)}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "colibri", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def openapi_route(model_name: str, version: str) -> Any:
    doc = openapi_document(model_name, version)

    async def openapi(request: Request) -> Response:
        return JSONResponse(doc)

    return openapi

"""``GET /openapi.json``: an OpenAPI 3.1 document of the generation and read-only routes.

The request bodies come straight from the pydantic models the routes validate with
(:mod:`colibri.server.schemas`), so the document cannot drift from what the server accepts;
``model`` is narrowed to the one model this server serves, and the fields the server takes
only some values of are narrowed to those (``n`` 1, no penalties, token ids inside the
vocabulary, one non-empty prompt, an existing ``cache_slot``, ...: :func:`_served`), so that
a request the document describes is one the server runs. Clients and fuzzers
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


_NULL = {"type": "null"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL], "default": None}


def _served(props: dict[str, Any], vocab_size: int, n_slots: int) -> None:
    """Narrow a request schema's ``props`` to the values the server serves (the rest are 400s
    that name the field: colibri.server.requests.refuse_unsupported and the routes)."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    if "n" in props:
        props["n"] = {"type": "integer", "const": 1, "default": 1}
    for name in ("frequency_penalty", "presence_penalty", "min_p"):
        if name in props:
            props[name] = _nullable({"type": "number", "const": 0})
    if "repetition_penalty" in props:
        props["repetition_penalty"] = _nullable({"type": "number", "const": 1})
    if "logit_bias" in props:
        props["logit_bias"] = _nullable(
            {"type": "object", "additionalProperties": {"type": "number", "const": 0}}
        )
    if "best_of" in props:
        props["best_of"] = _nullable({"type": "integer", "const": 1})
    if "suffix" in props:
        props["suffix"] = _nullable({"type": "string", "maxLength": 0})
    if "cache_slot" in props:
        props["cache_slot"] = (
            _nullable({"type": "integer", "minimum": 0, "maximum": n_slots - 1})
            if n_slots
            else {"type": "null", "default": None}
        )
    if "stop_token_ids" in props:
        props["stop_token_ids"] = _nullable({"type": "array", "items": token})
    if "stop" in props:
        props["stop"] = _nullable(
            {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                            "maxItems": 16}]}
        )  # fmt: skip
    if "draft" in props:
        n = r"0*([0-9]|1[0-6])"  # DraftPolicy: at most 16 drafts
        props["draft"] = _nullable(
            {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 16},
                       {"type": "string", "pattern": f"^(auto|off|{n}|(mtp|lookup)(:{n})?)$"}]}
        )  # fmt: skip
    if "prompt" in props:  # one prompt: text or token ids, never empty
        ids = {"type": "array", "items": token, "minItems": 1}
        text = {"type": "string", "minLength": 1}
        props["prompt"] = {
            "anyOf": [
                text,
                {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                ids,
                {"type": "array", "items": ids, "minItems": 1, "maxItems": 1},
            ]
        }


def _param(name: str, where: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A path or query parameter (a path one is required)."""
    return {"name": name, "in": where, "required": where == "path", "schema": schema}


def openapi_document(
    model_name: str, version: str, *, vocab_size: int | None = None, n_slots: int | None = None
) -> dict[str, Any]:
    """The document; with ``vocab_size`` and ``n_slots`` (the served model's), the fields the
    server takes only some values of are narrowed to them (:func:`_served`)."""
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
        props = schemas[m.__name__]["properties"]
        props["model"] = {"type": "string", "enum": [model_name]}
        if vocab_size is not None and n_slots is not None:
            _served(props, vocab_size, n_slots)
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
    paths["/v1/models/{model}"] = {
        "get": {
            "operationId": "v1_models_id",
            "parameters": [_param("model", "path", {"type": "string"})],
            "responses": _responses("the served model (404 model_not_found for another id)"),
        }
    }
    paths["/atlas"] = {
        "get": {
            "operationId": "atlas",
            "parameters": [_param("missing", "query", {"type": "string", "enum": ["ok"]})],
            "responses": _responses(
                "the expert atlas (404 atlas_missing before coli atlas wrote one)"
            ),
        }
    }
    paths["/admin/replicas/{index}/enable"] = {
        "post": {
            "operationId": "enable_replica",
            "parameters": [_param("index", "path", {"type": "integer", "minimum": 0})],
            "responses": _responses("the copy re-enabled (400 not_streaming when resident)"),
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "colibri", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def openapi_route(model_name: str, version: str, *, vocab_size: int, n_slots: int) -> Any:
    doc = openapi_document(model_name, version, vocab_size=vocab_size, n_slots=n_slots)

    async def openapi(request: Request) -> Response:
        return JSONResponse(doc)

    return openapi

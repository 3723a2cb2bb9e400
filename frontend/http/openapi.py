"""The HTTP API's OpenAPI 3.1 document (``GET /openapi.json``) and each route's body as a msgspec
Struct derived from it (``body_types``), which ``common.read_body`` decodes every body into: the
document states what the validation checks, because the validation is built from it.

Built from the definitions the validation itself uses, not written a second time: the OpenAI
routes' fields from ``fields.FIELDS`` (honoured, without effect or refused; the sampling fields'
type, default and help from ``shared.sampling.SAMPLING_FIELDS``), the roles and the stop-string count from
``frontend.protocol.wire``, the caption lengths from ``frontend.skills``, the error statuses from
``errors.STATUS``, and the routes from the application itself (a route without a description
here is an error when the document is built).

What a body may hold is checked in two layers, as documented: the field's JSON type here (the
Struct's, checked by msgspec: a wrong type is a 400 naming it, before a route reads the body; the
routes read the Struct's typed attributes), then ranges, sizes and shapes by the routes' post-checks
and the server's protocol (``frontend/protocol/parse.py``: also a 400, or a 413 for sizes).
Unknown fields are ignored, as OpenAI does (clients send fields of newer API versions).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Union

import msgspec

from ..protocol.wire import CHAT_TEMPLATE_FIELDS, MAX_STOP, ROLES
from ..skills import CAPTION_LENGTHS
from .errors import STATUS, bad_request
from .fields import CHAT, COMPLETIONS, route_fields

WHAT = {"integer": "an integer", "number": "a number", "boolean": "a boolean", "string": "a string",
        "array": "an array", "object": "an object"}


def _t(kind: str, description: str = "", **more) -> dict[str, Any]:
    return {"type": kind, **({"description": description} if description else {}), **more}


@lru_cache(maxsize=1)
def bodies() -> dict[str, dict[str, Any]]:
    """Each POST route's body schema, by path."""
    from .openai import ROLE_ALIASES  # (openai.py reads the body through common.py)

    model = _t("string", "The served model's name (GET /v1/models); on the OpenAI routes also a LoRA adapter's.")
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    image_part = {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "image_url"},
        "image_url": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"url": {"type": "string"}}}],
                      "description": "A data: URL (nothing is fetched from the network); vision models only."}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": [*ROLES, *ROLE_ALIASES]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [text_part, image_part]}},
                              {"type": "null"}]}}}
    messages = _t("array", "The conversation, rendered with the model's chat template.", minItems=1, items=message)
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    # the OpenAI routes' fields: fields.FIELDS, with the shapes only this module spells out
    shapes = {"model": model, "messages": messages, "prompt": {"anyOf": [
        {"type": "string"}, token_ids,
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [{"type": "string"}, token_ids]}}]},
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP}]},
        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}]},
        "function_call": {"anyOf": [{"type": "string"}, {"type": "object"}]}}
    openai = {route: {name: {**f.schema, **shapes.get(name, {})} for name, f in route_fields(route).items()}
              for route in (CHAT, COMPLETIONS)}
    settings = _t("object", "Moondream's {temperature, top_p, max_tokens, max_objects}.")
    image_url = _t("string", "The image as a data: URL.")
    moondream = {"model": model, "image_url": image_url, "settings": settings, "user": openai[CHAT]["user"]}
    return {
        CHAT: _body(["messages"], **openai[CHAT]),
        COMPLETIONS: _body(["prompt"], **openai[COMPLETIONS]),
        "/v1/caption": _body([], **moondream, stream=_t("boolean"),
                             length=_t("string", "How long a caption.", enum=list(CAPTION_LENGTHS))),
        "/v1/query": _body([], **moondream, stream=_t("boolean"),
                           question=_t("string"), reasoning=_t("boolean", "Moondream 2 only: reason first."),
                           spatial_refs=_t("array", "Moondream 2 only: points and boxes the question refers to.")),
        "/v1/point": _body([], **moondream, object=_t("string")),
        "/v1/detect": _body([], **moondream, object=_t("string")),
        "/tokenize": _body([], model=model, prompt=_t("string", "A plain prompt (no special tokens added)."),
                           messages=messages, **{name: openai[CHAT][name] for name in CHAT_TEMPLATE_FIELDS}),
        "/detokenize": _body(["tokens"], model=model, tokens={**token_ids, "minItems": 0}),
    }


def _body(required: list[str], **properties) -> dict[str, Any]:
    """An object of these properties; an optional one may also be null (null is read as absent)."""
    return {"type": "object", "required": required,
            "properties": {name: prop if name in required else _nullable(prop) for name, prop in properties.items()}}


def _nullable(prop: dict[str, Any]) -> dict[str, Any]:
    if "type" in prop:
        return {**prop, "type": [prop["type"], "null"], **({"enum": [*prop["enum"], None]} if "enum" in prop else {})}
    return {**prop, "anyOf": [*prop["anyOf"], {"type": "null"}]}


EXAMPLES = {  # one request per text route, as a client sends it (the document's examples)
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
    "/v1/query": {"question": "What is the capital of France?"},
    "/tokenize": {"messages": [{"role": "user", "content": "Hello"}]},
    "/detokenize": {"tokens": [1, 2, 3]},
}


@lru_cache(maxsize=1)
def body_types() -> dict[str, type[msgspec.Struct]]:
    """Each POST route's body as a msgspec Struct: one field per documented property, of its JSON
    type(s) (the schema's top level: items and shapes are the route's and the protocol's to check).
    Every field is optional and null is absent; fields the document does not name are ignored."""
    return {path: msgspec.defstruct("Body" + re.sub(r"\W", "_", path), [
        (name, _wire_type(prop), None) for name, prop in schema["properties"].items()])
        for path, schema in bodies().items()}


def decode_body(path: str, body: dict[str, Any]) -> msgspec.Struct:
    """``body`` as ``path``'s Struct; a 400 naming the first field whose JSON type is not the
    documented one (msgspec checks every field's type, in C)."""
    try:
        return msgspec.convert(body, body_types()[path], strict=True)
    except msgspec.ValidationError as e:
        name = str(e).rpartition(" - at `$.")[2].rstrip("`")  # the bodies' fields are top-level
        prop = bodies()[path]["properties"][name]
        what = " or ".join(dict.fromkeys(_phrase(kind, alt) for kind, alt in _alternatives(prop)))
        raise bad_request(f"{name} must be {what}, got {WHAT[_json_type(body[name])]}") from None


_WIRE_TYPES = {"integer": int, "number": float, "boolean": bool, "string": str, "array": list, "object": dict}


def _wire_type(prop: dict[str, Any]) -> Any:
    """A property's JSON types as msgspec's: a union with None (null is absent). A number may be an
    integer, kept as one (``1`` stays 1, as JSON gave it)."""
    kinds = dict.fromkeys(kind for kind, _ in _alternatives(prop))
    if "number" in kinds:
        kinds = {"integer": None, **kinds}
    return Union[(*(_WIRE_TYPES[kind] for kind in kinds), None)]


def _alternatives(prop: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The JSON types a property takes, each with the schema that says it (null left out: absent)."""
    if "type" in prop:
        kinds = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
        return [(kind, prop) for kind in kinds if kind != "null"]
    return [a for alt in prop["anyOf"] for a in _alternatives(alt)]


def _phrase(kind: str, prop: dict[str, Any]) -> str:
    """``an integer``, ``a non-empty array of integers``: what the error message says a field must be."""
    if kind != "array":
        return WHAT[kind]
    items = {"integer": " of integers", "string": " of strings"}.get(prop.get("items", {}).get("type"), "")
    return ("a non-empty array" if prop.get("minItems") else "an array") + items


def _json_type(v: Any) -> str:
    """The JSON Schema type of a value ``json.loads`` gave (never None here: null is absent)."""
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(v)]


# --------------------------------------------------------------------------- the document

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}}}}}
ANY_JSON = {"type": "object"}
# The statuses besides 200: a POST's are every protocol error's (errors.STATUS) and the HTTP layer's own
# (401 API key, 404 model, 413 body size); a GET's only the API key's and a server bug's.
REQUEST_ERRORS = sorted({401, 404, 413, *(status for status, _ in STATUS.values())})
READ_ERRORS = (401, 500)
PAGES = {"/metrics": "text/plain", "/": "text/html"}  # GET routes that do not answer JSON


def document(app_routes: list[tuple[str, tuple[str, ...]]], is_open, version: str) -> dict[str, Any]:
    """The OpenAPI document for ``app_routes`` (``(path, methods)`` as the app serves them);
    ``is_open(path)``: the route needs no API key."""
    paths: dict[str, Any] = {}
    for path, methods in app_routes:
        for method in methods:
            paths.setdefault(path, {})[method.lower()] = _operation(path, method, is_open(path))
    return {"openapi": "3.1.0", "info": {"title": "Tandem", "version": version,
                                         "description": "OpenAI- and Moondream-compatible routes (docs/HTTP.md)."},
            "paths": paths,
            "components": {"schemas": {"Error": ERROR},
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def _operation(path: str, method: str, open_: bool) -> dict[str, Any]:
    error = {"description": "An error (docs/HTTP.md)", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
    op: dict[str, Any] = {"operationId": f"{method.lower()}{path.replace('/', '_')}"}
    if method == "POST":
        example = {"example": EXAMPLES[path]} if path in EXAMPLES else {}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": bodies()[path], **example}}}
        ok = {"application/json": {"schema": ANY_JSON}}
        if "stream" in bodies()[path]["properties"]:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op["responses"] = {"200": {"description": "The answer", "content": ok},
                           **{str(s): error for s in REQUEST_ERRORS}}
    elif path == "/ready":
        status = {"type": "object", "properties": {"status": {"type": "string"}, "reason": {"type": "string"}}}
        op["responses"] = {"200": {"description": "Ready", "content": {"application/json": {"schema": status}}},
                           "503": {"description": "Not ready, and why",
                                   "content": {"application/json": {"schema": status}}},
                           "500": error}
    else:
        kind = PAGES.get(path, "application/json")
        op["responses"] = {"200": {"description": "The answer", "content": {kind: {"schema": (
            ANY_JSON if kind == "application/json" else {"type": "string"})}}},
            **{str(s): error for s in READ_ERRORS}}
    if not open_:
        op["security"] = [{"bearer": []}, {}]  # an API key when the server has one (--api-key)
    return op

"""GrammarSpec: the validated description of one constrained-decoding request.

Pure Python (no numpy, no xgrammar): the protocol layer can validate a request
map before anything is compiled.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from frontend.protocol.wire import MAX_GRAMMAR_OBJECTS as MAX_OBJECTS_LIMIT

KINDS = ("point", "box", "regex", "json_schema", "ebnf")
TEXT_KINDS = ("regex", "ebnf")  # their output is the text itself
SPATIAL_KINDS = ("point", "box")
MAX_PATTERN_CHARS = 8192
MAX_SCHEMA_CHARS = 65536

# JSON Schema's lists of subschemas that must not be empty (the specification says so; xgrammar
# compiles an empty anyOf to the empty output, which is no JSON at all), the keywords whose value
# maps names to subschemas, and those whose value is data ("{\"anyOf\": []}" there is a value).
_NONEMPTY_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})

# The fields each kind takes in the protocol map (all of them required).
_FIELDS = {
    "point": ("kind", "max_objects"),
    "box": ("kind", "max_objects"),
    "regex": ("kind", "pattern"),
    "json_schema": ("kind", "schema"),
    "ebnf": ("kind", "grammar"),  # xgrammar's EBNF (GBNF), starting at rule "root" (vLLM's guided_grammar)
}


class GrammarError(ValueError):
    """A grammar request that cannot be honoured: malformed protocol map, a
    regex or JSON schema the library rejects (the message carries the
    library's own text), text that does not parse, or a misused matcher."""


def _type_name(v: object) -> str:
    return type(v).__name__


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_schema_lists(schema: Any, where: str) -> None:
    """GrammarError at the first anyOf/oneOf/allOf, in any subschema, that is not a non-empty array."""
    if not isinstance(schema, Mapping):
        return
    for key, value in schema.items():
        at = f"{where}.{key}"
        if key in _DATA_KEYWORDS:
            continue
        if key in _NONEMPTY_SCHEMA_LISTS and not (isinstance(value, list) and value):
            raise GrammarError(f"{at} must be a non-empty array of schemas")
        if key in _NAMED_SCHEMAS and isinstance(value, Mapping):
            for name, sub in value.items():
                _check_schema_lists(sub, f"{at}.{name}")
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                _check_schema_lists(sub, f"{at}[{i}]")
        else:
            _check_schema_lists(value, at)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must look like.

    ``kind`` is one of ``point``, ``box``, ``regex``, ``json_schema``;
    ``max_objects`` is set for point/box only (1..100), ``pattern`` for regex
    only, ``schema`` (a JSON-schema map) for json_schema only. Constructing one
    validates it (``GrammarError`` otherwise). ``schema`` is deep-copied so a
    later change to the caller's dict cannot change a compiled grammar;
    instances hash by :attr:`cache_key`.
    """

    kind: str
    max_objects: int | None = None
    pattern: str | None = None
    schema: dict | None = None
    grammar: str | None = None
    cache_key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        k = self.kind
        if not isinstance(k, str):
            raise GrammarError(f"grammar.kind must be a string, got {_type_name(k)}")
        if k not in KINDS:
            raise GrammarError(f"grammar.kind must be one of {', '.join(map(repr, KINDS))}, got {k!r}")
        given = {"max_objects": self.max_objects, "pattern": self.pattern, "schema": self.schema,
                 "grammar": self.grammar}
        wanted = set(_FIELDS[k]) - {"kind"}
        for name, value in given.items():
            if name in wanted:
                if value is None:
                    raise GrammarError(f"grammar: kind {k!r} requires field {name!r}")
            elif value is not None:
                raise GrammarError(
                    f"grammar: field {name!r} is not allowed for kind {k!r} "
                    f"(allowed: {', '.join(_FIELDS[k])})"
                )
        if k in SPATIAL_KINDS:
            m = self.max_objects
            if not _is_int(m):
                raise GrammarError(f"grammar.max_objects must be an integer, got {_type_name(m)} {m!r}")
            if not 1 <= m <= MAX_OBJECTS_LIMIT:
                raise GrammarError(f"grammar.max_objects must be in 1..{MAX_OBJECTS_LIMIT}, got {m}")
            key: tuple = (k, m)
        elif k == "regex":
            p = self.pattern
            if not isinstance(p, str):
                raise GrammarError(f"grammar.pattern must be a string, got {_type_name(p)}")
            if not p:
                raise GrammarError("grammar.pattern must be a non-empty string")
            if len(p) > MAX_PATTERN_CHARS:
                raise GrammarError(f"grammar.pattern is too long ({len(p)} > {MAX_PATTERN_CHARS} characters)")
            if "\x00" in p:
                raise GrammarError("grammar.pattern must not contain NUL characters")
            key = (k, p)
        elif k == "ebnf":
            g = self.grammar
            if not isinstance(g, str) or not g.strip():
                raise GrammarError(f"grammar.grammar must be a non-empty string, got {_type_name(g)}")
            if len(g) > MAX_SCHEMA_CHARS:
                raise GrammarError(f"grammar.grammar is too long ({len(g)} > {MAX_SCHEMA_CHARS} characters)")
            key = (k, g)
        else:
            s = self.schema
            if not isinstance(s, Mapping):
                raise GrammarError(f"grammar.schema must be a map (JSON object), got {_type_name(s)}")
            try:
                # key order is kept: xgrammar emits object properties in schema order
                text = json.dumps(s, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise GrammarError(f"grammar.schema is not valid JSON: {e}") from None
            if len(text) > MAX_SCHEMA_CHARS:
                raise GrammarError(f"grammar.schema is too large ({len(text)} > {MAX_SCHEMA_CHARS} characters of JSON)")
            _check_schema_lists(s, "grammar.schema")
            object.__setattr__(self, "schema", copy.deepcopy(dict(s)))
            key = (k, text)
        object.__setattr__(self, "cache_key", key)

    def __hash__(self) -> int:
        return hash(self.cache_key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GrammarSpec):
            return NotImplemented
        return self.cache_key == other.cache_key

    @property
    def schema_json(self) -> str | None:
        """The schema as compact JSON text, key order kept (json_schema only)."""
        return self.cache_key[1] if self.kind == "json_schema" else None

    @classmethod
    def from_protocol(cls, d: Any) -> "GrammarSpec":
        """Validate a protocol map such as ``{"kind": "box", "max_objects": 3}``.

        Accepted maps: ``{"kind": "point"|"box", "max_objects": int 1..100}``,
        ``{"kind": "regex", "pattern": str}``,
        ``{"kind": "json_schema", "schema": map}``, ``{"kind": "ebnf", "grammar": str}``. Every field is required;
        any other field is an error. Raises ``GrammarError`` naming the problem.
        """
        if not isinstance(d, Mapping):
            raise GrammarError(f"grammar must be a map, got {_type_name(d)}")
        for key in d:
            if not isinstance(key, str):
                raise GrammarError(f"grammar field names must be strings, got {_type_name(key)} {key!r}")
        if "kind" not in d:
            raise GrammarError("grammar: missing field 'kind'")
        k = d["kind"]
        if not isinstance(k, str):
            raise GrammarError(f"grammar.kind must be a string, got {_type_name(k)}")
        if k not in KINDS:
            raise GrammarError(f"grammar.kind must be one of {', '.join(map(repr, KINDS))}, got {k!r}")
        allowed = _FIELDS[k]
        extra = sorted(set(d) - set(allowed))
        if extra:
            raise GrammarError(
                f"grammar: unexpected field {extra[0]!r} for kind {k!r} (allowed: {', '.join(allowed)})"
            )
        for name in allowed:
            if name not in d:
                raise GrammarError(f"grammar: kind {k!r} requires field {name!r}")
            if d[name] is None:
                raise GrammarError(f"grammar.{name} must not be null")
        return cls(**{name: d[name] for name in allowed})

    def to_protocol(self) -> dict:
        """The inverse of :meth:`from_protocol`."""
        out: dict = {"kind": self.kind}
        for name in _FIELDS[self.kind][1:]:
            out[name] = copy.deepcopy(getattr(self, name))
        return out

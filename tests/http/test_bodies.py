"""Each POST route's body decodes into its msgspec Struct (``openapi.body_types``), derived from the
OpenAPI document: the Struct names exactly the documented fields, a value of an undocumented JSON type
is a 400 naming the field, and everything the document allows decodes as given (no server: the live
checks are in test_http.py and test_openapi.py)."""
from __future__ import annotations

import pytest

from frontend.http.errors import HttpError
from frontend.http.openapi import WHAT, _alternatives, bodies, body_types, decode_body

# one value of each JSON type (as json.loads gives it)
SAMPLES = {"integer": 3, "number": 2.5, "boolean": True, "string": "x", "array": [1], "object": {"a": 1}}
FIELDS = [(path, name) for path, schema in bodies().items() for name in schema["properties"]]


def _kinds(path: str, name: str) -> set[str]:
    kinds = {kind for kind, _ in _alternatives(bodies()[path]["properties"][name])}
    return kinds | ({"integer"} if "number" in kinds else set())  # an integer is a number


def test_each_struct_names_exactly_the_documented_fields():
    assert set(body_types()) == set(bodies())
    for path, schema in bodies().items():
        assert set(body_types()[path].__struct_fields__) == set(schema["properties"]), path


@pytest.mark.parametrize("path, name", FIELDS, ids=lambda v: v)
def test_a_value_of_another_json_type_is_a_400_naming_the_field(path, name):
    wrong = [kind for kind in SAMPLES if kind not in _kinds(path, name)]
    assert wrong, (path, name)  # non-vacuity: every field refuses some JSON type
    for kind in wrong:
        with pytest.raises(HttpError) as e:
            decode_body(path, {"unknown_field": 1, name: SAMPLES[kind]})
        message = e.value.message
        assert e.value.status == 400 and message.startswith(f"{name} must be ") and \
            message.endswith(f", got {WHAT[kind]}"), message


@pytest.mark.parametrize("path, name", FIELDS, ids=lambda v: v)
def test_a_documented_json_type_or_null_decodes_as_given(path, name):
    for kind in _kinds(path, name):
        body = decode_body(path, {name: SAMPLES[kind]})
        value = getattr(body, name)
        assert value == SAMPLES[kind] and type(value) is type(SAMPLES[kind]), (path, name, kind)  # 3 stays an int
    assert getattr(decode_body(path, {name: None}), name) is None  # null is absent


def test_unknown_fields_are_ignored_and_the_session_field_is_read_on_every_generate_route():
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/caption", "/v1/query", "/v1/point", "/v1/detect"):
        body = decode_body(path, {"user": "s1", "not_a_field": {"x": [1]}})
        assert body.user == "s1" and not hasattr(body, "not_a_field"), path

"""The OpenAI routes' field table (``frontend/http/fields.py``) is what the OpenAPI document and
docs/HTTP.md say, and its refusals name the field; a grammar's parsed output can be written as JSON
(no server: the live checks are in test_http.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from frontend.http.errors import HttpError
from frontend.http.fields import BOTH, CHAT, COMPLETIONS, FIELDS, NO_EFFECT, PASS, PASS_THROUGH, REFUSED, \
    refuse_unsupported
from frontend.http.openai import json_value
from frontend.http.openapi import bodies
from shared.sampling import SAMPLING_FIELD_NAMES

DOCS = (Path(__file__).parents[2] / "docs" / "HTTP.md").read_text()
WORD = {PASS: "sampler", NO_EFFECT: "no effect", REFUSED: "refused"}


def _table_rows() -> list[tuple[set[str], str, str]]:
    section = DOCS[DOCS.index("#### Fields"):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0] not in ("field", "---"):
            rows.append((set(re.findall(r"`([a-z_]+)`", cells[0])), cells[1], cells[2]))
    return rows


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f"{f.name}@{f.routes[-1]}")
def test_docs_list_each_field_with_its_routes_and_fate(f):
    rows = [(where, what) for names, where, what in _table_rows() if f.name in names]
    assert len(rows) == 1, f"docs/HTTP.md's field table lists {f.name} {len(rows)} times"
    where, what = rows[0]
    routes = {"both": BOTH, "chat": (CHAT,), "completions": (COMPLETIONS,)}[where]
    assert set(f.routes) <= set(routes), (f.name, where)
    assert what.startswith(WORD.get(f.fate, "route")), (f.name, what)
    for accepted in f.accepted:  # the accepted value is written next to it
        shown = json.dumps(accepted)
        assert re.search(rf"`{f.name}` \(`{re.escape(shown)}`\)", DOCS), (f.name, shown)


def test_the_document_has_every_field_of_each_route_and_the_sampler_fields_pass_through():
    for route in (CHAT, COMPLETIONS):
        props = bodies()[route]["properties"]
        assert {f.name for f in FIELDS if route in f.routes} == set(props)
        for f in FIELDS:
            if route in f.routes and f.fate == REFUSED:
                assert props[f.name]["description"].startswith("Not supported"), f.name
    assert set(PASS_THROUGH) <= set(SAMPLING_FIELD_NAMES) and "min_tokens" in PASS_THROUGH


@pytest.mark.parametrize("body, says", [
    ({"echo": True}, "echo: true is not supported by this server (send false, or leave it out)"),
    ({"best_of": True}, "best_of: true is not supported"),  # a bool is not the number 1
    ({"use_beam_search": True, "echo": True}, "echo: "),  # the first in the table's order
    ({"prompt_logprobs": 0}, "prompt_logprobs: 0 is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities: "),
])
def test_refusals_name_the_field(body, says):
    with pytest.raises(HttpError) as e:
        refuse_unsupported(COMPLETIONS if "suffix" in body else CHAT, body)
    assert e.value.status == 400 and e.value.message.startswith(says), e.value.message


@pytest.mark.parametrize("body", [{}, {"echo": False, "best_of": 1, "length_penalty": 1, "priority": 0,
                                       "modalities": ["text"], "chat_template_kwargs": {}, "bad_words": [],
                                       "prompt_logprobs": None}])
def test_accepted_values_and_nulls_pass(body):
    refuse_unsupported(CHAT, body)


def test_a_parsed_output_is_written_back_as_json_even_with_numbers_beyond_a_float():
    parsed = json.loads('{"a": [1e999, -1e999, 2.5], "b": {"c": 1e999, "d": "x"}}')
    assert parsed["a"][0] == float("inf")  # non-vacuity: Python reads them as infinities
    assert json.loads(json.dumps(json_value(parsed), allow_nan=False)) == \
        {"a": [None, None, 2.5], "b": {"c": None, "d": "x"}}

"""The HTTP API's OpenAPI document (``GET /openapi.json``) against the server that serves it:
schemathesis generates requests from the document, valid ones and ones that break it, and every
answer must be one the document states (status, content type, body schema), never a server
error; error answers carry the JSON error body. The server still serves a normal request after.

One in-process server (``live_server.LiveServer``) with a short context, so that each generated
request ends within a few dozen tokens; the examples per operation are bounded and derandomized
(the same requests every run).
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance
from starlette.routing import Route

from frontend.http import HttpListener
from live_server import LiveServer

MODEL = "tiny-random"
pytestmark = pytest.mark.slow

EXAMPLES = 12  # per operation and mode


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(max_model_len=32)  # short answers: the fuzzing's time goes to many different requests
    srv.http = HttpListener(srv.server, "127.0.0.1", 0).start()
    yield srv
    srv.http.stop()
    srv.close()


@pytest.fixture(scope="module")
def document(live):
    return httpx.get(live.http.url + "/openapi.json").json()


def test_the_document_lists_every_route_the_app_serves(live, document):
    app = live.http._uvicorn.config.app  # the Starlette app (no API key here)
    served = {r.path for r in app.routes if isinstance(r, Route)}
    assert served == set(document["paths"]), served ^ set(document["paths"])
    chat = document["paths"]["/v1/chat/completions"]["post"]
    props = chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"temperature", "top_p", "seed", "max_tokens", "messages"} <= set(props)
    # optional fields may be null (read as absent), the required ones may not
    assert props["temperature"]["type"] == ["number", "null"] and props["max_tokens"]["type"] == ["integer", "null"]
    assert props["messages"]["type"] == "array"


@pytest.mark.parametrize("body, says", [
    ({"messages": "hi"}, "messages must be a non-empty array, got a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature must be a number"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop must be a string or an array of strings, got an integer"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, "seed must be an integer, got a number"),
])
def test_a_field_of_another_json_type_than_documented_is_a_400_naming_it(live, body, says):
    r = httpx.post(live.http.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_fuzzed_requests_get_documented_answers_and_the_server_keeps_serving(live, document):
    url = live.http.url
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == sum(len(methods) for methods in document["paths"].values())
    seen: dict[str, set[int]] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for op in operations:
            # a GET has no input to break: negative cases only for the bodies
            modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.method.upper() == "POST" else \
                (GenerationMode.POSITIVE,)
            for mode in modes:
                @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case):
                    response = case.call(base_url=url, timeout=60)
                    # documented status, content type and schema; not a 5xx; a request that breaks the document
                    # is refused. Not "valid data gets a 2xx": the document states JSON types, the protocol's
                    # ranges and shapes (top_p in (0, 1], token ids in the vocabulary) answer a documented 400.
                    case.validate_response(response, excluded_checks=[positive_data_acceptance])
                    seen.setdefault(f"{case.operation.method.upper()} {case.operation.path}", set()).add(response.status_code)
                    if response.status_code >= 400:
                        error = response.json()["error"]
                        assert error["message"] and error["type"] and error["code"], response.text

                run()
        answer = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None
    # non-vacuity: the generate routes ran requests (the document's examples at least) and refused others
    assert {200, 400} <= seen["POST /v1/chat/completions"] and {200, 400} <= seen["POST /v1/completions"], seen
    live.assert_no_leak()

"""The HTTP frontend with real clients over real sockets: the unmodified ``openai`` and
``moondream`` clients, raw HTTP for each error status, metrics that move by exactly what
was asked, and 200 concurrent streams with random disconnects (nothing leaks).

One in-process server (``live_server.LiveServer``: a thread running the ZeroMQ
``Server`` in front of a real two-process ``Service`` with tiny-random on the CPU), with
an ``HttpListener`` on an ephemeral port.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import random
import re
import signal
import time
from collections import Counter

import httpx
import moondream
import openai
import pytest
from live_server import LiveServer
from PIL import Image

from frontend.client import Client
from frontend.http import HttpListener
from frontend.http.errors import STATUS, HttpError
from frontend.http.fields import FIELDS
from frontend.http.fields import REFUSED as REFUSED_FATE
from frontend.logs import JsonFormatter

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
MSG = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def live():
    srv = LiveServer()
    http = HttpListener(srv.server, "127.0.0.1", 0).start()
    srv.http = http
    yield srv
    http.stop()
    srv.close()


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.http.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def raw(live):
    with httpx.Client(base_url=live.http.url, timeout=60) as c:
        yield c


def metric_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# --------------------------------------------------------------------------- openai


def test_models_and_probes(live, oai, raw):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == live.server.gate.max_model_len > 0  # what the server enforces
    assert raw.get("/health").json() == {"status": "live", "state": "ready"}
    r = raw.get("/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    assert raw.get("/version").json() == {"version": importlib.metadata.version("tandem")}


# --------------------------------------------------------------------------- the request log


def test_each_finished_request_leaves_one_log_line_with_its_figures(oai, caplog):
    caplog.set_level(logging.INFO, logger="tandem.requests")
    answers = [oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=n, temperature=0, seed=n)
               for n in (3, 5)]
    records = {r.fields["request_id"]: r for r in caplog.records if r.name == "tandem.requests"}
    assert set(records) >= {a.id for a in answers}  # the id the HTTP answer carries
    for a in answers:
        record = records[a.id]
        line = json.loads(JsonFormatter().format(record))  # --log-format json
        assert {k: line[k] for k in ("level", "logger", "request_id", "model", "prompt_tokens", "output_tokens",
                                     "finish_reason")} == {
            "level": "INFO", "logger": "tandem.requests", "request_id": a.id, "model": MODEL,
            "prompt_tokens": a.usage.prompt_tokens, "output_tokens": a.usage.completion_tokens,
            "finish_reason": a.choices[0].finish_reason}
        assert 0 < line["ttft_ms"] <= line["duration_ms"]
        text = record.getMessage()  # --log-format text: the same figures as key=value
        assert text.startswith(f"request {a.id} finished: ")
        assert dict(re.findall(r"(\w+)=(\S+)", text)) == {
            k: str(v) for k, v in line.items() if k in record.fields and k != "request_id" and v is not None}
    assert answers[0].usage.completion_tokens != answers[1].usage.completion_tokens  # non-vacuity: each its own


# --------------------------------------------------------------------------- /tokenize, /detokenize


@pytest.fixture(scope="module")
def tokenizer():
    from shared.models.registry import load_tokenizer

    return load_tokenizer(MODEL)


def test_tokenize_is_the_tokenizers_ids_and_detokenize_gives_the_text_back(live, raw, tokenizer):
    prompt = "Once upon a time, in Paris: 42 cats!"
    r = raw.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert r["tokens"] == tokenizer.encode(prompt, add_special_tokens=False) and r["count"] == len(r["tokens"]) > 1
    assert r["max_model_len"] == live.server.gate.max_model_len
    assert raw.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": prompt}
    assert raw.post("/detokenize", json={"tokens": r["tokens"][:-1]}).json()["prompt"] != prompt  # non-vacuity


def test_tokenize_messages_counts_what_a_chat_completion_uses(raw, oai, tokenizer):
    r = raw.post("/tokenize", json={"messages": MSG}).json()
    assert r["tokens"] == tokenizer.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True)["input_ids"]
    done = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == r["count"]
    bare = raw.post("/tokenize", json={"messages": MSG, "add_generation_prompt": False}).json()["tokens"]
    assert bare == r["tokens"][:len(bare)] and len(bare) < r["count"]  # without the assistant's opening


@pytest.mark.parametrize("path, body, status, says", [
    ("/tokenize", {"prompt": "a", "messages": MSG}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt must be a string"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role must be one of"),
    ("/tokenize", {"messages": MSG, "add_generation_prompt": "yes"}, 400, "add_generation_prompt must be a boolean"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "x" * ((1 << 18) + 1)}, 413, "the limit is"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens[1] must be >= 0"),
    ("/detokenize", {"tokens": [1, 1 << 20]}, 400, "tokens[1] must be < vocab size"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens must be an array of integers"),
])
def test_tokenize_and_detokenize_errors_name_the_field(raw, path, body, status, says):
    r = raw.post(path, json=body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


def test_chat_stream_concatenates_to_the_same_seeded_text(oai):
    kw = dict(model=MODEL, messages=MSG, max_tokens=24, temperature=1.0, seed=7)
    full = oai.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    other = oai.chat.completions.create(**{**kw, "seed": 8})  # non-vacuity: the seed matters
    assert other.choices[0].message.content != text


def test_completions_text_and_token_ids(oai):
    a = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == a.choices[0].text
    b = oai.completions.create(model=MODEL, prompt=[101, 202, 303], max_tokens=3, temperature=0, logprobs=0)
    lp = b.choices[0].logprobs
    assert b.usage.prompt_tokens == 3 and len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)


def test_stop_and_logprobs(oai):
    base = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0, logprobs=True)
    text = base.choices[0].message.content
    assert len(base.choices[0].logprobs.content) == base.usage.completion_tokens
    word = text.split()[2]
    cut = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0, stop=word)
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].message.content
    assert text.startswith(cut.choices[0].message.content)


def test_logprobs_stream_with_each_chunk(live, oai):
    """Streamed, each text chunk carries its tokens' logprobs; together they are the non-streamed
    answer's, over HTTP (chat and completions) and over ZeroMQ."""
    kw = dict(model=MODEL, messages=MSG, max_tokens=12, temperature=0, logprobs=True)
    whole = oai.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = [c for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
    with_lp = [c for c in chunks if c.choices[0].logprobs is not None]
    assert len(with_lp) >= len(whole) // 2 > 1  # non-vacuity: spread over the stream, not only the last chunk
    streamed = [t for c in with_lp for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    ckw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=0)
    one = oai.completions.create(**ckw).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in oai.completions.create(**ckw, stream=True)
             if c.choices and c.choices[0].logprobs is not None]
    assert len(parts) > 1
    assert [t for p in parts for t in p.tokens] == one.tokens
    assert [x for p in parts for x in p.token_logprobs] == one.token_logprobs
    assert [x for p in parts for x in p.text_offset] == one.text_offset
    with Client(live.endpoint) as zc:
        s = zc.stream("Once upon a time", max_tokens=10, temperature=0, logprobs=True)
        got = [x for chunk in s for x in chunk.logprobs]
        assert got == s.result.logprobs and len(got) == 10


def test_top_logprobs_best_first_streamed_and_whole(live, oai):
    """Greedy: each token is its own best alternative; the alternatives are sorted, as many as asked,
    the same streamed or not, over HTTP (chat and completions) and over ZeroMQ."""
    kw = dict(model=MODEL, messages=MSG, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    whole = oai.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 8
    for t in whole:
        alts = [a.logprob for a in t.top_logprobs]
        assert len(alts) == 5 and alts == sorted(alts, reverse=True) and alts[0] > alts[-1]
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
    streamed = [t for c in oai.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in whole]
    one = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3)
    lp = one.choices[0].logprobs
    assert len(lp.top_logprobs) == 6 and all(1 <= len(d) <= 3 for d in lp.top_logprobs)
    assert all(max(d.values()) == x for d, x in zip(lp.top_logprobs, lp.token_logprobs))
    with Client(live.endpoint) as zc:
        s = zc.stream("Once upon a time", max_tokens=6, temperature=0, top_logprobs=4)
        chunks = list(s)
        assert [p for c in chunks for p in c.top_logprobs] == s.result.top_logprobs
        assert [len(t) for t in s.result.top_logprobs] == [4] * 6 and s.result.logprobs is not None
    for bad in (dict(logprobs=True, top_logprobs=21), dict(top_logprobs=2)):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, **bad)
        assert "top_logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=21)
    assert "logprobs" in e.value.body["message"]


def test_n_choices_share_the_prompt_and_each_has_its_own_seeded_stream(live, oai):
    """n choices: choice i is the request with seed + i (non-vacuity: they differ); the others map the
    first one's prompt pages from the prefix cache; streamed, each chunk says its choice's index."""
    prompt = list(range(5000, 5070))  # token ids no other test sends: nothing of it is cached before
    live.wait_idle()
    with Client(live.endpoint) as zc:
        hits = zc.info()["prefix_cache"]["hit_tokens"]
        shared = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, n=3)
        hits = zc.info()["prefix_cache"]["hit_tokens"] - hits
    # Page size 8: each of the other two maps the 64 tokens of whole pages; one admitted after the first
    # choice's answer filled its page 8 also copies that page's 5 rows the prompt shares (but the last).
    whole = (len(prompt) - 1) // 8 * 8
    assert len(shared.choices) == 3 and hits - 2 * whole in (0, 5, 10), hits
    messages = [{"role": "user", "content": "Choices, choices: " + "one two three " * 20}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    r = oai.chat.completions.create(**kw, n=3)
    prompt = r.usage.prompt_tokens
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (24, prompt + 24)
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3
    for i, text in enumerate(texts):
        alone = oai.chat.completions.create(**{**kw, "seed": 11 + i})
        assert alone.choices[0].message.content == text, i
    with Client(live.endpoint) as zc:  # the ZeroMQ client's n: the same choices
        zmq = zc.choices(messages=messages, n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    assert [c.text for c in zmq] == texts
    streamed = {i: "" for i in range(3)}
    finished = set()
    usage = None
    for c in oai.chat.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}):
        if not c.choices:
            usage = c.usage
            continue
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
        if c.choices[0].finish_reason:
            finished.add(c.choices[0].index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert usage.completion_tokens == 24
    one = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=3, n=2)
    assert [c.index for c in one.choices] == [0, 1] and one.choices[0].text != one.choices[1].text
    for bad in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, n=bad)
        assert e.value.body["message"].startswith("n must be")
    live.wait_idle()


def test_response_format_json_schema_and_grammar_extra(oai):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "yn", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert value["answer"] in ("yes", "no") and r.choices[0].model_extra["output"] == value
    p = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=64, temperature=0,
                                    extra_body={"grammar": {"kind": "point", "max_objects": 2}})
    points = p.choices[0].model_extra["output"]["points"]
    assert len(points) <= 2 and all(0 <= q["x"] <= 1 and 0 <= q["y"] <= 1 for q in points)
    assert re.fullmatch(r"none|\d\.\d{3},\d\.\d{3}(;\d\.\d{3},\d\.\d{3})?", p.choices[0].message.content)


def test_unknown_fields_are_ignored_as_openai_does(raw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2,
            "frequency_penalty": 0, "user": "u1", "metadata": {"a": "b"}, "no_such_field": [1]}
    r = raw.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = raw.post("/v1/chat/completions", json={**body, "temperature": "hot"})  # a known field of a wrong type
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_openai_client_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSG, top_p=1.5)
    assert e.value.status_code == 400 and "top_p" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "does not take images" in e.value.body["message"]


def test_each_sampler_field_reaches_the_sampler(live, oai):
    """The unmodified openai client sends each field (vLLM's extras through ``extra_body``): the HTTP
    answer equals the ZeroMQ answer with the same field (it reached the sampler as it was sent) and
    differs from the answer without it (it was not dropped)."""
    prompt = "Once upon a time"
    greedy = dict(max_tokens=16, temperature=0.0)
    with Client(live.endpoint) as zc:
        first = zc.generate(prompt, **greedy).token_ids[0]
        cases = [  # (the request without the field, the field as the openai client takes it, as extra_body)
            # greedy on the random model hardly repeats: penalties < 0 (< 1) that reward repeats show
            (greedy, dict(presence_penalty=-2.0), {}),
            (greedy, dict(frequency_penalty=-2.0), {}),
            (greedy, dict(logit_bias={str(first): -100}), {}),
            (greedy, {}, dict(repetition_penalty=0.3)),
            # the random model's distribution is nearly flat: min_p 1 keeps the most likely tokens only
            (dict(max_tokens=16, temperature=1.5, seed=5), {}, dict(min_p=1.0)),
        ]
        for base, kw, extra in cases:
            http = oai.completions.create(model=MODEL, prompt=prompt, **base, **kw, extra_body=extra).choices[0]
            zmq = zc.generate(prompt, **base, **kw, **extra)
            without = zc.generate(prompt, **base)
            assert http.text == zmq.text != without.text, (kw, extra)
        assert first not in zc.generate(prompt, **greedy, logit_bias={first: -100}).token_ids


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 2),
                                         ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
                                         ("logit_bias", {"99999999": 1})])
def test_sampler_fields_out_of_range_are_400s_naming_them(oai, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={field: value})
    assert e.value.status_code == 400 and field in e.value.body["message"], e.value.body


def test_max_tokens_omitted_fills_the_context_and_an_overlong_prompt_is_openais_400(live, oai):
    with Client(live.endpoint) as zc:
        context = zc.info()["max_model_len"]
    near_full = [7] * (context - 5)
    r = oai.completions.create(model=MODEL, prompt=near_full, extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (context - 5, 5)
    assert r.choices[0].finish_reason == "length"
    for prompt in ([7] * context, [7] * (context + 100)):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert e.value.status_code == 400 and e.value.code == "context_length_exceeded", e.value.body
        assert e.value.body["type"] == "invalid_request_error" and str(context) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # chat: the rendered conversation is what counts
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * context}])
    assert e.value.code == "context_length_exceeded"


def test_text_parts_render_the_same_through_every_door(live, oai):
    """Text parts are joined with newlines over HTTP and over ZeroMQ alike."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    answers = {}
    with Client(live.endpoint) as zc:
        for name, content in [("parts", parts), ("newline", "Hello\nworld"), ("glued", "Helloworld")]:
            messages = [{"role": "user", "content": content}]
            http = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
            zmq = zc.generate(messages=messages, max_tokens=8, temperature=0)
            assert (http.choices[0].message.content, http.usage.prompt_tokens) == \
                (zmq.text, zmq.usage["prompt_tokens"]), name
            answers[name] = (zmq.text, zmq.usage["prompt_tokens"])
    assert answers["parts"] == answers["newline"] != answers["glued"]


def test_tools_are_refused_unless_tool_choice_is_none(oai):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw, name in [(dict(tools=tools), "tools"), (dict(tools=tools, tool_choice="auto"), "tools"),
                     (dict(tool_choice="required"), "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, **kw)
        assert e.value.body["message"].startswith(name), e.value.body
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, tools=tools, tool_choice="none")
    assert r.usage.completion_tokens == 2


def test_vllms_stop_and_text_fields_act_as_vllm_defines_them(live, oai, tokenizer):
    """min_tokens, stop_token_ids, include_stop_str_in_output and skip_special_tokens through the unmodified
    openai client (``extra_body``), each against the answer without it, and the same over ZeroMQ."""
    prompt = "Once upon a time"
    greedy = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)

    def complete(**extra):
        r = oai.completions.create(**{**greedy, "extra_body": extra})
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    plain = oai.completions.create(**greedy).choices[0]
    with Client(live.endpoint) as zc:
        tokens = zc.generate(prompt, max_tokens=12, temperature=0).token_ids
        first, third = tokens[0], tokens[2]
        assert first not in tokens[1:4] and third not in tokens[:2], tokens  # the cases below need it
        # The stop token id ends the answer and, as vLLM, is not part of its text unless asked
        assert complete(stop_token_ids=[third]) == (tokenizer.decode(tokens[:2]), "stop", 3)
        assert complete(stop_token_ids=[third], include_stop_str_in_output=True) == \
            (tokenizer.decode(tokens[:3]), "stop", 3)
        # min_tokens: the stop token id cannot end the answer before 4 tokens; the fourth differs from greedy's
        text, reason, count = complete(stop_token_ids=[first], min_tokens=4, max_tokens=4)
        zmq = zc.generate(prompt, max_tokens=4, temperature=0, stop_token_ids=[first], min_tokens=4)
        assert (text, count) == (zmq.text, 4) and first not in zmq.token_ids and zmq.token_ids != tokens[:4]
        assert complete(stop_token_ids=[first]) == ("", "stop", 1)  # non-vacuity: without min_tokens
        # A stop string: cut before it, or kept with include_stop_str_in_output
        stop = plain.text[4:7]
        at = plain.text.find(stop)
        assert complete(stop=[stop])[0] == plain.text[:at] and at > 0
        assert complete(stop=[stop], include_stop_str_in_output=True)[0] == plain.text[:at + len(stop)]
        # skip_special_tokens: <|im_start|> (id 1, forced by logit_bias) has no text unless asked
        forced = dict(max_tokens=2, logit_bias={"1": 100})
        assert complete(**forced) == ("", "length", 2)
        assert complete(**forced, skip_special_tokens=False) == ("<|im_start|><|im_start|>", "length", 2)


def test_vllms_structured_outputs_request_id_and_token_ids(oai):
    choices = ["yes, sir", "no (never)", "a.b|c"]
    for extra in [dict(guided_choice=choices), dict(structured_outputs={"choice": choices})]:
        r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16, temperature=0, extra_body=extra)
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop", extra
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16, temperature=0,
                                    extra_body=dict(guided_regex="[0-9]{3}-[a-c]{2}"))
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r.choices[0].message.content)
    ebnf = 'root ::= word " " word\nword ::= "red" | "green" | "blue"'
    for extra in [dict(guided_grammar=ebnf), dict(structured_outputs={"grammar": ebnf})]:
        r = oai.completions.create(model=MODEL, prompt="Colors:", max_tokens=16, temperature=0, extra_body=extra)
        assert re.fullmatch("(red|green|blue) (red|green|blue)", r.choices[0].text), extra
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for extra in [dict(guided_json=schema), dict(guided_json=json.dumps(schema)),
                  dict(structured_outputs={"json": schema})]:
        r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0, extra_body=extra)
        assert set(json.loads(r.choices[0].message.content)) == {"n"}, extra
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSG, response_format={"type": "json_object"},
                                    extra_body=dict(guided_regex="a"))
    assert e.value.body["message"].startswith("guided_regex: one way to ask for structured output")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSG, extra_body=dict(structured_outputs={"structural_tag": "x"}))
    assert e.value.body["message"].startswith("structured_outputs.structural_tag is not supported")
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2,
                                    extra_body=dict(request_id="trace-7", return_tokens_as_token_ids=True))
    assert r.id == "chatcmpl-trace-7"
    tokens = [c.token for c in r.choices[0].logprobs.content]
    assert all(re.fullmatch(r"token_id:\d+", t) for c in r.choices[0].logprobs.content
               for t in [c.token, *(a.token for a in c.top_logprobs)]) and len(tokens) == 3


def test_the_chat_templates_options_render_as_transformers_does(raw, oai, tokenizer):
    """add_generation_prompt, continue_final_message and chat_template_kwargs (vLLM's) reach the template:
    /tokenize's ids and a chat completion's prompt_tokens are transformers' apply_chat_template's."""
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    for options in [{}, {"add_generation_prompt": False},
                    {"add_generation_prompt": False, "continue_final_message": True},
                    {"chat_template_kwargs": {"unused_by_this_template": 1}}]:
        template = {"add_generation_prompt": True, **options.get("chat_template_kwargs", {}),
                    **{k: v for k, v in options.items() if k != "chat_template_kwargs"}}
        want = tokenizer.apply_chat_template(messages, tokenize=True, **template)["input_ids"]
        got = raw.post("/tokenize", json={"messages": messages, **options}).json()["tokens"]
        r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=options)
        assert got == want and r.usage.prompt_tokens == len(want), options
    continued = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert continued.endswith("Once upon")  # non-vacuity: the final message is left open
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=messages, extra_body={"continue_final_message": True})
    assert e.value.body["message"].startswith("continue_final_message needs add_generation_prompt: false")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=messages, extra_body={"chat_template_kwargs": {"tools": 1}})
    assert e.value.body["message"].startswith("chat_template_kwargs.tools is not a template variable")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(live, oai):
    prompt = list(range(6000, 6030))
    with Client(live.endpoint) as zc:
        tail = zc.generate(prompt_token_ids=prompt[-7:], max_tokens=6, temperature=0)
        whole = zc.generate(prompt_token_ids=prompt, max_tokens=6, temperature=0)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={"truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7 and r.choices[0].text == tail.text != whole.text
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["message"].startswith("truncate_prompt_tokens must be an integer >= 1")


def test_a_request_id_may_be_sent_again_while_its_first_request_runs(live, raw):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "request_id": "twice"}
    with raw.stream("POST", "/v1/chat/completions", json=body) as first:
        line = next(first.iter_lines())
        assert first.status_code == 200 and json.loads(line[len("data: "):])["id"] == "chatcmpl-twice"
        again = raw.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert again.status_code == 200 and again.json()["id"] == "chatcmpl-twice", again.text
        assert again.json()["choices"][0]["finish_reason"] == "length"  # its own answer, not the first's
    live.wait_idle()  # the first was cancelled when its client left


REFUSED = [f for f in FIELDS if f.fate == REFUSED_FATE]
UNSUPPORTED_VALUE = {"boolean": lambda a: not a[0] if a else True, "integer": lambda a: 7, "number": lambda a: 0.5,
                     "string": lambda a: "x", "array": lambda a: [1], "object": lambda a: {"x": 1},
                     None: lambda a: "auto"}


@pytest.mark.parametrize("f", REFUSED, ids=lambda f: f.name)
def test_each_refused_field_is_a_400_naming_it_and_its_default_is_served(raw, f):
    route = f.routes[0]
    body = {"model": MODEL, "max_tokens": 1,
            **({"messages": MSG} if route.endswith("chat/completions") else {"prompt": "Hi"})}
    value = UNSUPPORTED_VALUE[f.schema.get("type")](f.accepted)
    r = raw.post(route, json={**body, f.name: value})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{f.name}: "), r.text
    for accepted in f.accepted:  # the value that asks for nothing unsupported is answered
        r = raw.post(route, json={**body, f.name: accepted})
        assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- moondream


def test_moondream_client(live):
    md = moondream.vl(endpoint=live.http.url + "/v1")
    answer = md.query(question="What is the capital of France?", settings={"max_tokens": 8})["answer"]
    assert isinstance(answer, str) and answer
    streamed = list(md.query(question="Hi", stream=True, settings={"max_tokens": 8, "temperature": 0})["answer"])
    again = md.query(question="Hi", settings={"max_tokens": 8, "temperature": 0})["answer"]
    assert len(streamed) >= 1 and "".join(streamed) == again
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    for call in (lambda: md.caption(image), lambda: md.point(image, "cat"), lambda: md.detect(image, "cat"),
                 lambda: md.query(image, "what is it?")):
        with pytest.raises(Exception) as e:  # urllib's HTTPError
            call()
        assert getattr(e.value, "code", None) == 400, e.value
        assert "does not take images" in json.loads(e.value.read())["error"]["message"]


# --------------------------------------------------------------------------- raw HTTP statuses


def test_error_statuses(live, raw):
    chat = "/v1/chat/completions"
    cases = [
        (raw.post(chat, content=b"{not json"), 400, "bad_request"),
        (raw.post(chat, json=[1, 2]), 400, "bad_request"),
        (raw.post(chat, json={"model": MODEL, "messages": MSG, "max_tokens": "ten"}), 400, "bad_request"),
        (raw.post(chat, json={"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}), 400, "bad_request"),
        (raw.post(chat, json={"model": MODEL, "messages": MSG, "n": 17}), 400, "bad_request"),
        (raw.post("/v1/query", json={"settings": {"max_tokens": 4}}), 400, "bad_request"),
        (raw.post(chat, json={"model": "nope", "messages": MSG}), 404, "model_not_found"),
        (raw.get("/v1/nothing"), 404, "not_found"),
        (raw.get(chat), 405, "method_not_allowed"),
        (raw.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 300_000}), 413, "too_long"),
    ]
    for r, status, code in cases:
        assert r.status_code == status, (r.request.url, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"] and err["type"], err
    assert "max_tokens" in cases[2][0].json()["error"]["message"]  # the server's validation names the field
    live.server.max_queue = 0  # read by the server loop at each admission
    try:
        r = raw.post(chat, json={"model": MODEL, "messages": MSG, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]
    finally:
        live.server.max_queue = 1024
    for code, (status, _) in STATUS.items():  # the statuses no client input can reach
        assert HttpError.from_protocol({"code": code, "message": "m"}).status == status
    assert STATUS["internal"][0] == 500 and STATUS["worker_failed"][0] == 503
    live.wait_idle()


# --------------------------------------------------------------------------- metrics


def test_metrics_move_by_exactly_the_requests(live, oai, raw):
    before = metric_values(raw.get("/metrics").text)
    for n in (3, 5):
        oai.completions.create(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=n, temperature=0,
                               extra_body={"ignore_eos": True})
    list(oai.completions.create(model=MODEL, prompt=[11, 12], max_tokens=4, temperature=0, stream=True,
                                extra_body={"ignore_eos": True}))
    with Client(live.endpoint, timeout=60) as zc:  # ZeroMQ requests are counted the same way
        zc.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=MSG, top_p=2.0)
    live.wait_idle()  # the worker frees KV pages just after the answers went out
    after = metric_values(raw.get("/metrics").text)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("tandem:prompt_tokens_total") == 4 + 4 + 2 + 3
    assert delta("tandem:generation_tokens_total") == 3 + 5 + 4 + 2
    assert delta('tandem:request_success_total{finished_reason="length"}') == 4
    assert delta('tandem:request_failure_total{code="bad_request"}') == 1
    assert delta("tandem:time_to_first_token_seconds_count") == 4
    assert delta("tandem:e2e_request_latency_seconds_count") == 4
    assert delta("tandem:inter_token_latency_seconds_count") == 2 + 4 + 3 + 1
    assert after["tandem:num_requests_live"] == 0 and after["tandem:kv_cache_usage_perc"] == 0
    assert after["tandem:worker_ready"] == 1 and 0 <= after["tandem:device_idle_fraction"] <= 1
    assert delta("tandem:engine_steps_total") > 0 and after["tandem:host_ms_per_step"] > 0
    assert 0 <= after["tandem:prefix_cache_hits_total"] <= after["tandem:prefix_cache_queries_total"]


# --------------------------------------------------------------------------- load with disconnects


def test_200_streams_with_random_disconnects(live, raw):
    rng = random.Random(3)
    before = metric_values(raw.get("/metrics").text)
    plans = [rng.choice(["read", "read", "drop_after", "drop_before"]) for _ in range(200)]

    async def one(client: httpx.AsyncClient, plan: str, i: int) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}], "stream": True,
                "max_tokens": rng.randint(4, 40), "ignore_eos": True, "temperature": 0}
        if plan == "drop_before":
            task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()
            return plan
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                n += line.startswith("data: ")
                if plan == "drop_after" and n >= 3:
                    return plan  # leaving the block closes the connection mid-stream
        return "ended without [DONE]"

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.http.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p, i) for i, p in enumerate(plans)),
                                        return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, str) for r in results), [r for r in results if not isinstance(r, str)][:3]
    assert results.count("done") == plans.count("read"), (Counter(results), Counter(plans))
    stats = live.wait_idle(timeout=60)  # nothing live, every KV page and batch row free again
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    after = metric_values(raw.get("/metrics").text)
    ended = sum(after[k] - before.get(k, 0.0) for k in after if k.startswith("tandem:request_success_total"))
    started = 200 - plans.count("drop_before")
    # every request that reached the server ended exactly once (a dropped-before one may not have reached it)
    assert started <= ended <= 200
    assert after.get('tandem:request_success_total{finished_reason="cancelled"}', 0) - \
        before.get('tandem:request_success_total{finished_reason="cancelled"}', 0) >= 1
    assert after["tandem:num_requests_live"] == 0


def test_a_non_streaming_client_that_goes_away_cancels_its_request(live, raw):
    cancelled = 'tandem:request_success_total{finished_reason="cancelled"}'
    before = metric_values(raw.get("/metrics").text)
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1900, "ignore_eos": True}  # seconds of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.http.url + "/v1/chat/completions", json=body, timeout=1.0)
    live.wait_idle(timeout=60)
    after = metric_values(raw.get("/metrics").text)
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == 1  # not run to its length for nobody
    length = 'tandem:request_success_total{finished_reason="length"}'
    assert after.get(length, 0) == before.get(length, 0)


# --------------------------------------------------------------------------- health across a worker restart


def test_ready_is_503_while_the_worker_restarts_and_health_stays_200(live, raw):
    assert raw.get("/ready").status_code == 200
    os.kill(live.svc.worker_pid, signal.SIGKILL)  # the server replaces its worker in-process
    seen, reasons = [], set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, health = raw.get("/ready"), raw.get("/health")
        seen.append((ready.status_code, ready.json()["status"], health.status_code))
        reasons.add(ready.json().get("reason"))
        if seen[-1][:2] == (200, "ready") and (503, "restarting") in {s[:2] for s in seen}:
            break
        time.sleep(0.05)
    assert (503, "restarting") in {s[:2] for s in seen} and seen[-1][:2] == (200, "ready"), seen[-5:]
    assert {s[:2] for s in seen} <= {(200, "ready"), (503, "restarting")}, set(seen)
    assert {s[2] for s in seen} == {200}, set(seen)  # live throughout: a liveness probe keeps the pod
    assert {r for r in reasons if r} == {"the worker failed and a new one is warming up; requests wait for it"}
    after = metric_values(raw.get("/metrics").text)
    assert after["tandem:worker_generation"] == 2 and after["tandem:worker_ready"] == 1

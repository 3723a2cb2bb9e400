"""Attacks real clients and real failures make, and what must hold after each: the bad request
gets a clear error of its own (OpenAI's shape, the status of docs/HTTP.md), the connection and
the server keep serving, and every resource returns to idle.

What tests/http/ and tests/server/test_load.py already cover (malformed msgpack,
bad fields, disconnects under load, bad images) is not repeated here. One in-process server per
model (``live_server.LiveServer``, with an ``HttpListener``), module-scoped.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import socket
import struct
import time
import zlib

import httpx
import msgpack
import pytest
import zmq
from live_server import LiveServer, Raw, check_request
from PIL import Image

import frontend.http.openai as openai_routes
from frontend.protocol.encode import encode_done
from frontend.client import Client
from frontend.http import HttpListener
from frontend.server.outbox import Outbox, Sent

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Tell me a story."}]
CHAT = "/v1/chat/completions"
# A chat template that refuses a conversation, as many real ones do (Mistral's and Gemma's
# with raise_exception for roles that do not alternate, or a system message).
REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                     "{{ raise_exception('System role not supported') }}{% endif %}"
                     "{{ m['role'] }}: {{ m['content'] if m['content'] is string else '<image>' }}\n{% endfor %}")


@contextlib.contextmanager
def listening(model: str):
    srv = LiveServer(model=model)
    srv.http = HttpListener(srv.server, "127.0.0.1", 0).start()
    try:
        yield srv
    finally:
        srv.http.stop()
        srv.close()


@pytest.fixture(scope="module")
def live():
    with listening("tiny-random") as srv:
        yield srv


@pytest.fixture(scope="module")
def vlm():
    with listening("tiny-random-vlm") as srv:
        yield srv


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.http.url, timeout=30) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["message"], err
    return err


def still_serves(c: httpx.Client) -> None:
    r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def data_url(size=(32, 32), seed: int | None = None) -> str:
    buf = io.BytesIO()
    img = Image.new("RGB", size, (200, 40, 40)) if seed is None else Image.effect_noise(size, 10 + seed).convert("RGB")
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# --------------------------------------------------------------------------- raw HTTP on one connection


def exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    """Send one request on ``sock`` and read its whole response: (status, body); (0, b"") when
    the server closed the connection instead of answering."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            got = sock.recv(65536)
        except ConnectionResetError:
            got = b""
        if not got:
            return 0, b""
        data += got
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()


def wait_requests_handled(srv, timeout: float = 30.0) -> None:
    """Every HTTP request task of the listener has ended (uvicorn tracks them)."""
    state = srv.http._uvicorn.server_state
    deadline = time.monotonic() + timeout
    while state.tasks:
        assert time.monotonic() < deadline, f"{len(state.tasks)} HTTP requests still running"
        time.sleep(0.02)


# --------------------------------------------------------------------------- input JSON allows and the protocol cannot carry


@pytest.mark.parametrize("body, path, named", [
    ({"messages": MSG, "max_tokens": 2 ** 64}, CHAT, "max_tokens"),
    ({"messages": MSG, "max_tokens": 2, "seed": -2 ** 63 - 1}, CHAT, "seed"),
    ({"messages": MSG, "max_tokens": 2, "stop_token_ids": [10 ** 30]}, CHAT, "stop_token_ids"),
    ({"messages": MSG, "max_tokens": 2, "grammar": {"kind": "point", "max_objects": 10 ** 20}}, CHAT, "grammar"),
    ({"prompt": [2 ** 64], "max_tokens": 2}, "/v1/completions", "prompt_token_ids"),
    ({"question": "why?", "settings": {"max_tokens": 2 ** 64}}, "/v1/query", "max_tokens"),
])
def test_integers_beyond_64_bits_are_a_400_naming_the_field(live, http, body, path, named):
    err = error_of(http.post(path, json=body), 400)
    assert err["code"] == "bad_request" and named in err["message"] and "64 bits" in err["message"], err
    still_serves(http)  # on the same keep-alive connection


@pytest.mark.parametrize("raw_json, named", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', "messages"),
    (b'{"messages": [{"role": "user", "content": "ab"}], "stop": "\\udc00", "max_tokens": 2}', "stop"),
    (b'{"messages": [{"role": "\\ud800", "content": "ab"}], "max_tokens": 2}', "messages"),
    (b'{"question": "\\udfff?", "settings": {"max_tokens": 2}}', "messages"),
])
def test_lone_surrogates_are_a_400_naming_the_field(live, http, raw_json, named):
    path = "/v1/query" if b"question" in raw_json else CHAT
    err = error_of(http.post(path, content=raw_json, headers={"content-type": "application/json"}), 400)
    assert named in err["message"] and "surrogate" in err["message"], err
    still_serves(http)


def test_a_surrogate_pair_is_an_ordinary_character(live, http):  # non-vacuity of the test above
    r = http.post(CHAT, content=b'{"messages": [{"role": "user", "content": "a\\ud83d\\ude00b"}], "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, says", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"max_tokens": ' + b"1" * 5000 + b"}", "not valid JSON"),  # over Python's int digit limit
    (b'{"messages": [{"role": ["user"], "content": "x"}]}', "role must be a string"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"include_usage": "no"}}',
     "include_usage"),
])
def test_json_that_breaks_parsers_is_a_400(live, http, body, says):
    err = error_of(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400)
    assert says in err["message"], err
    still_serves(http)


def test_a_body_over_the_limit_is_a_413_declared_or_streamed(live):
    limit = 32 << 20  # docs/HTTP.md
    with socket.create_connection(("127.0.0.1", live.http.port)) as s:
        status, body = exchange(s, f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Length: {limit + 1}\r\n\r\n".encode())
        assert status == 413 and json.loads(body)["error"]["code"] == "too_long"
    with socket.create_connection(("127.0.0.1", live.http.port), timeout=30) as s:  # chunked: no length ahead
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b" " * (1 << 20)
        for _ in range(limit // len(piece) + 1):  # just over the limit, and never the body's end
            s.sendall(b"100000\r\n" + piece + b"\r\n")
        status, body = exchange(s, b"")
        assert status == 413 and "limit" in json.loads(body)["error"]["message"]
    with httpx.Client(base_url=live.http.url, timeout=30) as c:
        still_serves(c)


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: t\r\nno colon in this header\r\n\r\n",
    b"GET /he alth HTTP/1.1\r\nHost: t\r\n\r\n",  # a space in the target
    f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{{}}\r\n".encode(),
    f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}".encode(),
])
def test_malformed_http_framing_is_a_json_400(live, request_bytes):
    with socket.create_connection(("127.0.0.1", live.http.port), timeout=30) as s:
        status, body = exchange(s, request_bytes)
    assert status == 400, (status, body)
    assert json.loads(body)["error"]["code"] == "bad_request" and b"malformed HTTP request" in body, body
    with httpx.Client(base_url=live.http.url, timeout=30) as c:
        still_serves(c)


def test_as_many_messages_as_the_context_has_tokens_are_refused_before_rendering(live, http):
    """30,000 empty messages rendered by the chat template hold the server loop for about a
    second before the prompt is found too long; they are refused by their count instead."""
    limit = live.server.gate.max_model_len - 1
    body = {"messages": [{"role": "user", "content": ""}] * 30_000, "max_tokens": 2}
    err = error_of(http.post(CHAT, json=body), 413)
    assert err["code"] == "too_long" and f"30000 entries, the limit is {limit}" in err["message"], err
    at_limit = {"messages": [{"role": "user", "content": ""}] * limit, "max_tokens": 2}  # rendered, then too long
    err = error_of(http.post(CHAT, json=at_limit), 400)
    assert err["code"] == "context_length_exceeded" and "the prompt has" in err["message"], err
    ok = {"messages": [{"role": "user", "content": ""}] * 3 + MSG, "max_tokens": 2}  # empty ones are fine
    assert http.post(CHAT, json=ok).status_code == 200
    live.wait_idle()


@pytest.mark.parametrize("schema, where", [
    ({"anyOf": []}, "grammar.schema.anyOf"),
    ({"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]}, "grammar.schema.properties.a.oneOf"),
    ({"type": "array", "items": {"allOf": []}}, "grammar.schema.items.allOf"),
])
def test_a_json_schema_with_an_empty_anyof_is_a_400(live, http, schema, where):
    grammar = {"kind": "json_schema", "schema": schema}
    err = error_of(http.post(CHAT, json={"messages": MSG, "max_tokens": 8, "grammar": grammar}), 400)
    assert err["code"] == "bad_request" and f"{where} must be a non-empty array" in err["message"], err
    still_serves(http)


def test_a_json_schema_with_anyof_and_data_that_looks_like_it_is_valid(live, http):  # non-vacuity of the above
    for schema in ({"anyOf": [{"type": "integer"}]}, {"const": {"anyOf": []}},
                   {"type": "object", "properties": {"anyOf": {"type": "integer"}}, "required": ["anyOf"]}):
        r = http.post(CHAT, json={"messages": MSG, "max_tokens": 12, "temperature": 0,
                                  "grammar": {"kind": "json_schema", "schema": schema}})
        assert r.status_code == 200, (schema, r.text)
    live.wait_idle()


def test_the_python_client_names_a_field_msgpack_cannot_carry(live):
    with Client(live.endpoint, timeout=60) as c:
        with pytest.raises(ValueError, match="seed holds an integer out of range"):
            c.generate("Hello", seed=2 ** 64, max_tokens=2, request_id="r")
        with pytest.raises(ValueError, match="stop holds a string that is not valid Unicode"):
            list(c.stream("Hello", stop=["\udc00"], max_tokens=2, request_id="r"))
        assert c.generate("Hello", max_tokens=2, ignore_eos=True, request_id="r").finish_reason == "length"


# --------------------------------------------------------------------------- server bugs and vanished clients


def test_a_server_bug_is_a_500_and_the_connection_stays_open(live, monkeypatch, caplog):
    def broken(ctx):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_routes, "models", broken)
    with socket.create_connection(("127.0.0.1", live.http.port)) as s:
        status, body = exchange(s, get("/v1/models"))
        assert status == 500 and json.loads(body)["error"] == {
            "message": "internal error: RuntimeError", "type": "server_error", "code": "internal"}
        monkeypatch.undo()
        status, body = exchange(s, get("/v1/models"))  # the next request on the same connection
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-random"
    assert sum("internal error on GET /v1/models" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_a_client_gone_before_its_body_arrived_is_not_a_server_error(live, caplog):
    caplog.set_level(logging.ERROR)
    with socket.create_connection(("127.0.0.1", live.http.port)) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"messa')
        deadline = time.monotonic() + 30
        while not live.http._uvicorn.server_state.tasks:  # its handler is reading the body
            assert time.monotonic() < deadline
            time.sleep(0.01)
    wait_requests_handled(live)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    with httpx.Client(base_url=live.http.url, timeout=30) as c:
        still_serves(c)


def test_an_internal_error_ends_its_request_for_every_client(live, http):
    """A bug while admitting a request answers *that* request (its id), over ZeroMQ and HTTP
    alike: nobody waits for a terminal message that never comes."""
    def broken(msg):
        raise RuntimeError("a bug while rendering")

    live.server.gate._prompt_ids = broken  # read by the server thread at each admission
    try:
        r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=20)
        err = error_of(r, 500)
        assert err["code"] == "internal" and "RuntimeError" in err["message"]
        zctx = zmq.Context()
        conn = Raw(zctx, live.endpoint)
        try:
            conn.generate("r1", max_tokens=2)
            [term] = conn.request("r1", timeout_s=20)
            assert term["type"] == "error" and term["code"] == "internal" and term["id"] == "r1"
        finally:
            conn.close()
            zctx.term()
    finally:
        del live.server.gate._prompt_ids
    still_serves(http)
    live.wait_idle()


def test_a_grammar_output_msgpack_cannot_carry_reaches_the_client(live, http):
    """A JSON answer may hold what msgpack cannot carry: a "\\ud800" escape (a lone surrogate
    once parsed) or an integer beyond 64 bits. The answer still goes out, and the server lives."""
    schema = {"type": "string", "pattern": "^\\\\ud800$"}  # the model must write "\ud800"
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 20, "temperature": 0,
                              "grammar": {"kind": "json_schema", "schema": schema}}, timeout=20)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == '"\\ud800"' and choice["output"] == "\ufffd", choice
    assert live.thread.is_alive()
    still_serves(http)
    live.wait_idle()


def test_done_carries_any_parsed_json_output():
    output = {"big": 2 ** 70, "neg": -2 ** 64, "huge": 10 ** 400, "s": "a\ud800b", "\udc00": [1, True, "ok"]}
    msg = msgpack.unpackb(encode_done("r", "stop", "t", [1], {}, {}, output=output)[1], raw=False)
    assert msg["output"] == {"big": float(2 ** 70), "neg": -float(2 ** 64), "huge": float("inf"), "s": "a\ufffdb",
                             "\ufffd": [1, True, "ok"]}
    plain = {"n": 2 ** 63, "s": "\U0001f600", "l": [-(2 ** 63)]}  # what msgpack carries is left as it is
    assert msgpack.unpackb(encode_done("r", "stop", "t", [1], {}, {}, output=plain)[1], raw=False)["output"] == plain


def test_a_chat_template_that_refuses_the_conversation_is_a_400(live, http):
    tok = live.svc.tokenizer
    original, tok.chat_template = tok.chat_template, REFUSING_TEMPLATE
    try:
        r = http.post(CHAT, json={"messages": [{"role": "system", "content": "Be brief."}, *MSG], "max_tokens": 2},
                      timeout=20)
        err = error_of(r, 400)
        assert "System role not supported" in err["message"] and err["code"] == "bad_request"
        ok = http.post(CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=20)  # non-vacuity: same template
        assert ok.status_code == 200, ok.text
    finally:
        tok.chat_template = original
    live.wait_idle()


def test_a_client_that_reads_too_slowly_still_gets_every_terminal_message(live, tmp_path):
    """A ZeroMQ client that stops reading while its streams run: once its queue is full the
    server cancels its requests (it never blocks, nor buffers without bound), and still every
    request's messages arrive in order, adding up, with exactly one terminal message."""
    endpoint = f"ipc://{tmp_path}/slow.sock"
    sock = live.server.sock

    def bind_with_small_queues():  # on the server thread; the endpoint keeps the options it was bound with
        sock.setsockopt(zmq.SNDHWM, 20)
        sock.setsockopt(zmq.SNDBUF, 4096)
        sock.bind(endpoint)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.SNDBUF, -1)

    live.on_server_thread(bind_with_small_queues)
    zctx = zmq.Context()
    conn = Raw(zctx, endpoint)
    conn.sock.close(0)
    conn.sock = zctx.socket(zmq.DEALER)  # small queues on this side too
    for option, value in ((zmq.RCVHWM, 20), (zmq.RCVBUF, 4096), (zmq.LINGER, 0)):
        conn.sock.setsockopt(option, value)
    conn.sock.connect(endpoint)
    ids = [f"s{i}" for i in range(48)]
    try:
        for rid in ids:
            conn.generate(rid, max_tokens=40, ignore_eos=True, temperature=0)
        deadline = time.monotonic() + 60  # not reading until every request has ended in the server
        while live.on_server_thread(lambda: len(live.server.live)):
            assert time.monotonic() < deadline, "the requests did not end"
            time.sleep(0.05)
        terminals = [check_request(conn.request(rid, timeout_s=10)) for rid in ids]
    finally:
        conn.close()
        zctx.term()
    reasons = [t.get("finish_reason") for t in terminals]
    assert "cancelled" in reasons, reasons  # non-vacuity: its queue did fill up
    assert set(reasons) <= {"length", "cancelled"}, reasons
    live.wait_idle()
    with httpx.Client(base_url=live.http.url, timeout=30) as c:
        still_serves(c)


def test_outbox_holds_request_messages_in_order_drops_other_replies_and_caps_a_client(tmp_path):
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 5)
        dealer.setsockopt(zmq.RCVHWM, 5)
        router.bind(f"ipc://{tmp_path}/o.sock")
        dealer.connect(f"ipc://{tmp_path}/o.sock")
        dealer.send(b"hello")
        identity = router.recv_multipart()[0]
        outbox = Outbox(router, max_held=1000, max_held_bytes=1 << 20)
        payload = b"x" * 2000
        results = [outbox.send(identity, [b"%d" % i, payload]) for i in range(400)]
        assert Sent.HELD in results and set(results) == {Sent.SENT, Sent.HELD}, "the queue never filled"
        assert results.index(Sent.HELD) > 0 and Sent.SENT not in results[results.index(Sent.HELD):]
        assert outbox.send(identity, [b"pong", b""], keep=False) is Sent.DROPPED
        got = []
        while len(got) < 400:
            router.poll(0)  # as the server loop's poll: the socket learns its queue has room again
            outbox.flush()
            if dealer.poll(1000):
                got.append(int(dealer.recv_multipart()[0]))
        assert got == list(range(400)) and outbox.held == 0  # every one, in order, and nothing else
        assert outbox.send(identity, [b"pong", b""], keep=False) is Sent.SENT  # read up: replies go again
        dealer.recv_multipart()
        results = [outbox.send(identity, [b"big", payload * 10]) for _ in range(200)]  # 4 MB, never read
        assert Sent.GONE in results and outbox.held < 60  # over 1 MiB held: treated as gone
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


# --------------------------------------------------------------------------- vision-language model


def test_a_refusing_chat_template_with_images_is_a_400_and_the_server_lives(vlm):
    tok = vlm.svc.tokenizer
    image = {"type": "image_url", "image_url": {"url": data_url()}}
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [image]}],
            "max_tokens": 2}
    original, tok.chat_template = tok.chat_template, REFUSING_TEMPLATE
    try:
        with httpx.Client(base_url=vlm.http.url, timeout=20) as c:
            err = error_of(c.post(CHAT, json=body), 400)
            assert "System role not supported" in err["message"]
    finally:
        tok.chat_template = original
    assert vlm.thread.is_alive()  # the rendering runs on the server loop: it must not end it
    with httpx.Client(base_url=vlm.http.url, timeout=30) as c:
        r = c.post(CHAT, json={**body, "messages": body["messages"][1:]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    vlm.wait_idle()


def handmade_png(width: int, height: int, rows: int) -> str:
    """A data URL of an RGB PNG whose header says WIDTHxHEIGHT and whose one, complete zlib
    stream holds ``rows`` rows (fewer than ``height``: a truncated image Pillow zero-fills)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = (b"\x00" + bytes([200, 40, 40]) * width) * rows
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.parametrize("width, height, rows", [(8192, 8192, 1), (64, 48, 47)])
def test_a_truncated_image_is_a_400(vlm, width, height, rows):
    image = {"type": "image_url", "image_url": {"url": handmade_png(width, height, rows)}}
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}], "max_tokens": 2}
    with httpx.Client(base_url=vlm.http.url, timeout=60) as c:
        err = error_of(c.post(CHAT, json=body), 400)
        assert err["code"] == "bad_request" and "truncated" in err["message"] and "images[0]" in err["message"], err
        complete = {"type": "image_url", "image_url": {"url": handmade_png(64, 48, 48)}}  # non-vacuity
        body["messages"][0]["content"][0] = complete
        r = c.post(CHAT, json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    vlm.wait_idle()


def test_point_that_does_not_fit_its_max_tokens_is_a_400(vlm):
    with httpx.Client(base_url=vlm.http.url, timeout=30) as c:
        r = c.post("/v1/point", json={"image_url": data_url(), "object": "dot", "settings": {"max_tokens": 1}})
        err = error_of(r, 400)
        assert "max_tokens" in err["message"], err
        ok = c.post("/v1/point", json={"image_url": data_url(), "object": "dot", "settings": {"max_objects": 1}})
        assert ok.status_code == 200 and isinstance(ok.json()["points"], list), ok.text
    vlm.wait_idle()


def test_clients_leaving_while_their_images_are_prepared_or_generated_free_everything(vlm):
    """Four clients leave once the server holds their requests (images still being decoded and
    tiled, or queued), four after three streamed events: every request ends, and the KV pages,
    batch rows, mask rows and tile blocks all come back."""
    svc = vlm.svc

    def body(i: int) -> dict:
        image = {"type": "image_url", "image_url": {"url": data_url((96 + 120 * i, 64 + 90 * i), seed=i)}}
        return {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}

    def server_holds(n: int) -> None:
        deadline = time.monotonic() + 30
        while vlm.on_server_thread(lambda: len(svc.requests)) < n:
            assert time.monotonic() < deadline, "the requests did not reach the server"
            time.sleep(0.005)

    async def leave_mid_stream(client: httpx.AsyncClient, i: int) -> int:
        async with client.stream("POST", CHAT, json=body(i)) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    return r.status_code
        raise AssertionError("the stream ended before the client left")

    async def main():
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=vlm.http.url, timeout=120, limits=limits) as client:
            early = [asyncio.ensure_future(client.post(CHAT, json=body(i))) for i in range(4)]
            await asyncio.to_thread(server_holds, 4)
            for task in early:
                task.cancel()
            return await asyncio.gather(*(leave_mid_stream(client, i) for i in range(4, 8)))

    assert asyncio.run(main()) == [200] * 4
    vlm.wait_idle(timeout=60)
    blocks = vlm.on_server_thread(lambda: (svc.worker.images.num_free, svc.worker.images.capacity))
    assert blocks[0] == blocks[1], f"tile blocks free / total: {blocks}"
    with httpx.Client(base_url=vlm.http.url, timeout=60) as c:  # and the server still answers
        r = c.post("/v1/query", json={"image_url": data_url(), "question": "?", "settings": {"max_tokens": 2}})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text

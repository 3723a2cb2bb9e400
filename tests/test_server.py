"""End-to-end tests of the ZeroMQ server over a real socket (``docs/PROTOCOL.md``).

Most tests share one in-process server (``live_server.LiveServer``) and talk to it with raw
DEALER sockets (``live_server.Raw``) and with ``frontend.client``. The last tests run
``tandem serve`` as a subprocess under a fake systemd ``NOTIFY_SOCKET``; its SIGTERM drain
runs on the simulated device, so what finishes within the drain does not depend on the CPU.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import msgpack
import pytest
import zmq

from frontend.client import AsyncClient, BadRequest, Client, ConnectionClosed, Overloaded, TooLong
from frontend.server.tokenization import chat_prompt_ids, text_prompt_ids
from live_server import MAX_BATCH, TERMINAL, V, LiveServer, Raw, check_request, pack
from shared.finish import FinishReason
from shared.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2048  # tiny-random's max_position_embeddings: the default context
VOCAB = 49152  # tiny-random (SmolLM2 tokenizer)
LONG = 1900  # max_tokens that keeps a request live for the whole test (ignore_eos)


@pytest.fixture(scope="module")
def live():
    srv = LiveServer()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()  # not Context.instance(): that one is the server's
    yield c
    c.destroy(linger=0)  # closes what a failed test left open


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


@pytest.fixture
def conn(live, ctx):
    c = Raw(ctx, live.endpoint)
    yield c
    c.close()


# --------------------------------------------------------------------------- info, ping


def test_info_fields_raw_and_clients(live, conn):
    conn.send({"type": "info"})
    info = conn.reply()
    assert info["type"] == "info"
    assert info["protocol"] == 1
    assert info["model"] == "tiny-random"
    assert info["max_batch"] == MAX_BATCH
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert isinstance(info["pipeline"], bool) and info["pipeline"] is True
    assert info["device"] == "cpu"
    assert info["live_requests"] == 0
    with Client(live.endpoint, timeout=30) as c:
        ci = c.info()
    assert {k: ci[k] for k in ("protocol", "model", "max_batch", "max_model_len", "pipeline", "device")} == \
        {k: info[k] for k in ("protocol", "model", "max_batch", "max_model_len", "pipeline", "device")}

    async def ainfo():
        async with AsyncClient(live.endpoint, timeout=30) as ac:
            return await ac.info(), await ac.ping()

    ai, rtt = asyncio.run(ainfo())
    assert ai["protocol"] == 1 and ai["model"] == "tiny-random" and rtt > 0
    conn.assert_quiet(0.05)


@pytest.mark.parametrize("nonce", [None, 0, -7, 2**64 - 1, 1.5, True, "abc", "é" * 300, b"\x00\xffbin",
                                   [1, [2, "x"]], {"k": "v", "n": [1, 2]}])
def test_ping_echoes_nonce(conn, nonce):
    conn.send({"type": "ping", "nonce": nonce})
    assert conn.reply() == {"type": "pong", "nonce": nonce}


def test_ping_without_nonce_and_client_ping(live, conn):
    conn.send({"type": "ping"})
    assert conn.reply() == {"type": "pong", "nonce": None}
    with Client(live.endpoint, timeout=30) as c:
        assert 0 < c.ping() < 30


# --------------------------------------------------------------------------- generate: guarantees 1-3


def test_generate_streams_in_order_and_adds_up(conn, tok):
    cases = {
        "p": dict(prompt="The capital of France is", max_tokens=24),
        "ids": dict(prompt_token_ids=[1, 2, 3, 400, 5000], max_tokens=17),
        "msgs": dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                     max_tokens=9),
        "sampled": dict(prompt="Once upon a time", max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=7),
        "eos": dict(prompt="x", max_tokens=30, stop_token_ids=[], ignore_eos=True, logprobs=True),
    }
    for rid, fields in cases.items():  # all concurrently on one connection
        conn.generate(rid, **fields)
    for rid, fields in cases.items():
        done = check_request(conn.request(rid))
        assert done["type"] == "done", done
        assert done["finish_reason"] in ("stop", "length")
        if done["finish_reason"] == "length":
            assert len(done["token_ids"]) == fields["max_tokens"]
        assert len(done["token_ids"]) <= fields["max_tokens"]
    # logprobs only when asked, output only with a grammar
    conn.generate("lp", prompt="x", max_tokens=3, logprobs=True)
    conn.generate("nolp", prompt="x", max_tokens=3)
    lp, nolp = check_request(conn.request("lp")), check_request(conn.request("nolp"))
    assert len(lp["logprobs"]) == 3 and "logprobs" not in nolp
    assert "output" not in lp and "output" not in nolp
    conn.assert_quiet()


def test_greedy_is_deterministic_and_stream_false_sends_no_chunks(conn):
    conn.generate("s", prompt="Tell me a story", max_tokens=20)
    streamed = check_request(conn.request("s"))
    conn.generate("ns", prompt="Tell me a story", max_tokens=20, stream=False)
    msgs = conn.request("ns")
    assert [m["type"] for m in msgs] == ["done"]
    plain = check_request(msgs, stream=False)
    assert plain["text"] == streamed["text"] and plain["token_ids"] == streamed["token_ids"]
    conn.assert_quiet()


def test_python_client_stream_and_generate(live):
    with Client(live.endpoint, timeout=60) as c:
        s = c.stream("The capital of France is", max_tokens=16)
        chunks = list(s)
        assert [ch.seq for ch in chunks] == list(range(len(chunks)))
        assert "".join(ch.text for ch in chunks) == s.result.text
        assert [t for ch in chunks for t in ch.token_ids] == s.result.token_ids
        assert s.result.finish_reason in ("stop", "length")
        r = c.generate("The capital of France is", max_tokens=16)
        assert (r.text, r.token_ids) == (s.result.text, s.result.token_ids)
        assert r.usage == {"prompt_tokens": s.result.usage["prompt_tokens"], "completion_tokens": len(r.token_ids),
                           "cached_tokens": r.usage["cached_tokens"]}
        assert 0 <= r.usage["cached_tokens"] < r.usage["prompt_tokens"]


def test_messages_rendered_with_chat_template(conn, tok):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_prompt_ids(tok, messages)
    assert len(ids) > len(text_prompt_ids(tok, "You are terse. Name a colour."))  # the template adds tokens
    conn.generate("m", messages=messages, max_tokens=12)
    conn.generate("t", prompt_token_ids=ids, max_tokens=12)
    conn.generate("raw", prompt=messages[1]["content"], max_tokens=12)
    m, t, raw = (check_request(conn.request(r)) for r in ("m", "t", "raw"))
    assert m["usage"]["prompt_tokens"] == len(ids) == t["usage"]["prompt_tokens"]
    assert m["token_ids"] == t["token_ids"] and m["text"] == t["text"]
    assert raw["usage"]["prompt_tokens"] == len(text_prompt_ids(tok, messages[1]["content"])) < len(ids)
    conn.assert_quiet()


# --------------------------------------------------------------------------- stop strings


def _stop_candidates(chunks: list[dict]) -> list[str]:
    """Stop strings that straddle chunk (token) boundaries of a reference answer."""
    texts = [c["text"] for c in chunks]
    out = []
    for k in (2, 6, 11, 17):
        if k + 1 < len(texts) and texts[k] and texts[k + 1]:
            out.append(texts[k][-2:] + texts[k + 1][:2])
    return out


def test_stop_strings_are_never_sent(live, conn):
    prompt = dict(prompt="The quick brown fox", max_tokens=40, ignore_eos=True)
    conn.generate("ref", **prompt)
    ref_msgs = conn.request("ref")
    ref = check_request(ref_msgs)
    full = ref["text"]
    stops = _stop_candidates(ref_msgs[:-1])
    assert len(stops) >= 3, stops
    for i, s in enumerate(stops):
        expected = full[:full.find(s)]
        for stream in (True, False):
            rid = f"stop{i}{stream}"
            conn.generate(rid, stop=[s], stream=stream, **prompt)
            done = check_request(conn.request(rid), stream=stream)
            assert done["finish_reason"] == "stop", (s, done)
            assert done["text"] == expected, (s, done["text"], full)
            assert s not in done["text"]
    # Several stop strings (the earliest-ending match wins), one never matching but sharing a prefix
    # with the text (held back, then released).
    never = full[5:9] + "\x00never"
    conn.generate("multi", stop=[never, stops[1], stops[0]], **prompt)
    done = check_request(conn.request("multi"))
    first = min((full.find(s) + len(s), full.find(s)) for s in (stops[0], stops[1]))
    assert done["text"] == full[:first[1]] and done["finish_reason"] == "stop"
    conn.generate("held", stop=[never], **prompt)
    done = check_request(conn.request("held"))
    assert done["text"] == full and done["finish_reason"] == "length"
    # The same through the Python client.
    with Client(live.endpoint, timeout=60) as c:
        s = c.stream(stop=[stops[2]], **prompt)
        texts = [ch.text for ch in s]
        assert "".join(texts) == s.result.text == full[:full.find(stops[2])]
    conn.assert_quiet()


# --------------------------------------------------------------------------- cancel


def test_cancel_live_request(conn):
    conn.generate("c1", max_tokens=LONG, ignore_eos=True)
    conn.wait_for(lambda: len(conn.by_id["c1"]) >= 3, what="3 chunks")
    conn.send({"type": "cancel", "id": "c1"})
    done = check_request(conn.request("c1"))
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert 3 <= len(done["token_ids"]) < LONG
    # A non-streaming request, cancelled before it produced anything visible.
    conn.generate("c2", max_tokens=LONG, ignore_eos=True, stream=False)
    conn.send({"type": "cancel", "id": "c2"})
    done = check_request(conn.request("c2"), stream=False)
    assert done["finish_reason"] == "cancelled"
    # A cancel racing a natural end: either is fine, but exactly one terminal message.
    conn.generate("c3", max_tokens=2)
    conn.send({"type": "cancel", "id": "c3"})
    assert check_request(conn.request("c3"))["finish_reason"] in ("cancelled", "length", "stop")
    conn.assert_quiet()


def test_cancel_unknown_id_is_ignored(conn):
    conn.generate("fin", max_tokens=2)
    check_request(conn.request("fin"))
    for rid in ("never-sent", "fin", "x" * 128):  # unknown, already ended, max-length
        conn.send({"type": "cancel", "id": rid})
    conn.ping("after-cancels")  # the pong is the next reply: no error came before it
    conn.assert_quiet()
    conn.generate("still", max_tokens=3)  # and the connection still serves
    assert check_request(conn.request("still"))["type"] == "done"


def test_cancel_only_affects_its_own_connection(live, ctx):
    a, b = Raw(ctx, live.endpoint), Raw(ctx, live.endpoint)
    try:
        a.generate("same", max_tokens=LONG, ignore_eos=True)
        b.generate("same", max_tokens=8)  # ids are per connection
        a.wait_for(lambda: len(a.by_id["same"]) >= 1, what="a chunk")
        b.send({"type": "cancel", "id": "same"})  # b's own request (or nothing once it ended)
        assert check_request(b.request("same"))["finish_reason"] in ("cancelled", "length", "stop")
        a.pump(0.1)
        assert not any(m["type"] in TERMINAL for m in a.by_id["same"])  # a's request goes on
        a.send({"type": "cancel", "id": "same"})
        assert check_request(a.request("same"))["finish_reason"] == "cancelled"
        a.assert_quiet(0.05)
        b.assert_quiet(0.05)
    finally:
        a.close()
        b.close()


def test_python_client_cancel(live):
    with Client(live.endpoint, timeout=60) as c:
        s = c.stream("Hello", max_tokens=LONG, ignore_eos=True)
        got = []
        for ch in s:
            got.append(ch)
            if len(got) == 2:
                s.cancel()
        assert s.result.finish_reason == "cancelled"
        assert "".join(ch.text for ch in got) == s.result.text
        c.cancel("no-such-request")  # fire and forget, ignored
        assert c.ping() > 0
        assert c.generate("Hi", max_tokens=2).finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- errors


def test_unsupported_version(conn):
    for bad in (b"TANDEM2", b"tandem1", b"", b"TANDEM1\x00", b"\x92\x01"):
        conn.send_frames([bad, pack({"type": "generate", "id": "v", "prompt": "Hi"})])
        err = check_request(conn.request("v"))
        assert err["type"] == "error" and err["code"] == "unsupported_version", err
        conn.ended.discard("v")
    conn.send_frames([b"HTTP/1.1", b"\xc1garbage"])  # the id cannot be read: error with a nil id
    err = conn.reply()
    assert err["type"] == "error" and err["code"] == "unsupported_version" and err["id"] is None
    conn.send_frames([b"GET / HTTP/1.1"])
    err = conn.reply()
    assert err["code"] == "unsupported_version" and err["id"] is None
    conn.generate("ok", max_tokens=2)  # the connection stays usable
    assert check_request(conn.request("ok"))["type"] == "done"
    conn.assert_quiet()


def test_duplicate_id(live, conn):
    conn.generate("dup", max_tokens=LONG, ignore_eos=True)
    conn.wait_for(lambda: len(conn.by_id["dup"]) >= 1, what="a chunk")
    conn.generate("dup", prompt="again", max_tokens=2)
    conn.wait_for(lambda: any(m["type"] == "error" for m in conn.by_id["dup"]), what="the duplicate_id error")
    conn.send({"type": "cancel", "id": "dup"})
    conn.wait_for(lambda: any(m["type"] == "done" for m in conn.by_id["dup"]), what="the cancelled done")
    msgs = conn.by_id.pop("dup")
    errors = [m for m in msgs if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "duplicate_id", errors  # the second generate's terminal
    first = check_request([m for m in msgs if m["type"] != "error"])  # the first request is unharmed
    assert first["finish_reason"] == "cancelled"
    # Once ended, the id may be used again.
    conn.generate("dup", max_tokens=2)
    assert check_request(conn.request("dup"))["type"] == "done"
    conn.assert_quiet()


def test_too_long(live, conn):
    conn.generate("ctx", prompt_token_ids=[7] * MAX_MODEL_LEN, max_tokens=1)
    err = check_request(conn.request("ctx"))
    assert err["type"] == "error" and err["code"] == "too_long", err
    conn.generate("fits", prompt_token_ids=[7] * (MAX_MODEL_LEN - 1), max_tokens=5)
    done = check_request(conn.request("fits"))  # the longest prompt that fits: one generated token
    assert done["type"] == "done" and done["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    conn.generate("chars", prompt="a" * ((1 << 18) + 1))
    assert check_request(conn.request("chars"))["code"] == "too_long"
    with Client(live.endpoint, timeout=30) as c, pytest.raises(TooLong) as e:
        c.generate(prompt_token_ids=[7] * (MAX_MODEL_LEN + 5))
    assert e.value.code == "too_long"
    conn.assert_quiet()


def test_overloaded(live, ctx, conn):
    other = Raw(ctx, live.endpoint)
    live.server.max_queue = 3  # a plain attribute read by the loop: a small admission queue for this test
    try:
        for i in range(3):
            conn.generate(f"q{i}", max_tokens=LONG, ignore_eos=True)
        conn.wait_for(lambda: all(conn.by_id[f"q{i}"] for i in range(3)), what="3 live requests")
        conn.generate("q3", max_tokens=2)
        err = check_request(conn.request("q3"))
        assert err["type"] == "error" and err["code"] == "overloaded", err
        other.generate("o", max_tokens=2)  # the queue is the server's, not the connection's
        assert check_request(other.request("o"))["code"] == "overloaded"
        with Client(live.endpoint, timeout=30) as c, pytest.raises(Overloaded):
            c.generate("Hi", max_tokens=2)
        for i in range(3):
            conn.send({"type": "cancel", "id": f"q{i}"})
        for i in range(3):
            assert check_request(conn.request(f"q{i}"))["finish_reason"] == "cancelled"
        other.generate("o2", max_tokens=2)  # room again
        assert check_request(other.request("o2"))["type"] == "done"
    finally:
        live.server.max_queue = 1024
        other.close()
    conn.assert_quiet()


@pytest.mark.parametrize("grammar", [
    {"kind": "nonsense"},
    {"kind": "point"},
    {"kind": "point", "max_objects": 0},
    {"kind": "box", "max_objects": 3, "extra": 1},
    {"kind": "regex", "pattern": "("},
    {"kind": "regex", "pattern": ""},
    {"kind": "json_schema", "schema": {"type": "nonsense"}},
    {"kind": "json_schema", "schema": "not a map"},
    {"kind": 5},
    {},
    "point",
])
def test_bad_grammar_is_bad_request(live, conn, grammar):
    conn.generate("g", grammar=grammar, max_tokens=4)
    err = check_request(conn.request("g"))
    assert err["type"] == "error" and err["code"] == "bad_request", err
    assert "grammar" in err["message"]
    conn.assert_quiet(0.02)


def test_grammar_output_satisfies_constraints(live):
    with Client(live.endpoint, timeout=60) as c:
        with pytest.raises(BadRequest) as e:
            c.generate("Point", grammar={"kind": "regex", "pattern": "("})
        assert e.value.code == "bad_request"
        r = c.generate("Point at the cat", grammar={"kind": "box", "max_objects": 2}, max_tokens=96,
                       temperature=0.7, seed=3)
        if r.finish_reason == "stop":  # a random model may not finish the structure in max_tokens
            objs = r.output["objects"]
            assert len(objs) <= 2
            for o in objs:
                assert 0 <= o["x_min"] <= o["x_max"] <= 1 and 0 <= o["y_min"] <= o["y_max"] <= 1
        else:
            assert r.finish_reason == "length" and r.output is None


@pytest.mark.parametrize("msg, field", [
    ({"type": "generate", "id": "e", "prompt": "x", "max_token": 3}, "max_token"),
    ({"type": "generate", "id": "e", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"type": "generate", "id": "e", "prompt": "x", "temperature": True}, "temperature"),
    ({"type": "generate", "id": "e", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one"),
    ({"type": "generate", "id": "e"}, "exactly one"),
    ({"type": "generate", "id": "e", "messages": [{"role": "bot", "content": "y"}]}, "role"),
    ({"type": "generate", "id": "e", "prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"type": "generate", "id": "e", "prompt_token_ids": [VOCAB]}, "prompt_token_ids"),
    ({"type": "cancel", "id": "e", "extra": 1}, "extra"),
    ({"id": "e", "prompt": "x"}, "type"),
    ({"type": "shout", "id": "e"}, "shout"),
])
def test_bad_request_names_the_field(conn, msg, field):
    conn.send(msg)
    err = check_request(conn.request("e"))
    assert err["type"] == "error" and err["code"] == "bad_request" and field in err["message"], err
    conn.ended.discard("e")
    conn.assert_quiet(0.02)


def test_oversized_message_gets_too_long_and_keeps_the_connection(conn):
    conn.generate("live", max_tokens=LONG, ignore_eos=True)
    conn.wait_for(lambda: len(conn.by_id["live"]) >= 1, what="a chunk")
    conn.send({"type": "generate", "id": "big", "prompt": "x" * (2 << 20)})
    err = check_request(conn.request("big", timeout_s=3))
    assert err["code"] == "too_long"
    conn.send({"type": "cancel", "id": "live"})  # the live request is still ours to cancel
    assert check_request(conn.request("live", timeout_s=10))["finish_reason"] == "cancelled"


def test_message_just_over_the_limit_gets_too_long(conn):
    conn.send({"type": "generate", "id": "big", "prompt": "x" * ((1 << 20) + 16)})
    err = check_request(conn.request("big"))
    assert err["code"] == "too_long", err
    conn.ping()


# --------------------------------------------------------------------------- 64 concurrent clients


PROMPTS = ["Hello", "The capital of France is", "Once upon a time", "1, 2, 3,", "def f(x):", "Écris un poème"]


def _random_request(rng: random.Random, rid: str) -> dict:
    msg: dict = {"type": "generate", "id": rid, "max_tokens": rng.randint(1, 24)}
    r = rng.random()
    if r < 0.4:
        msg["prompt"] = rng.choice(PROMPTS)
    elif r < 0.7:
        msg["prompt_token_ids"] = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    else:
        msg["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.3:
        msg.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 32))
    if rng.random() < 0.2:
        msg["stop"] = [rng.choice([" the", "e", "ing", ", ", "\n"])]
    return msg


class _Conc:
    """One of the 64 clients: several requests, at most two in flight, on a DEALER it may drop."""

    def __init__(self, i: int, rng: random.Random, ctx, endpoint) -> None:
        self.i, self.rng, self.ctx, self.endpoint = i, rng, ctx, endpoint
        self.todo = deque()
        for j in range(rng.randint(3, 4)):
            kind = rng.choices(["normal", "nostream", "cancel", "disconnect"], [0.5, 0.15, 0.25, 0.1])[0]
            msg = _random_request(rng, f"c{i}r{j}")
            if kind in ("cancel", "disconnect"):
                msg.update(max_tokens=rng.choice([10, 60]), ignore_eos=True)
                msg.pop("stop", None)
            if kind == "nostream":
                msg["stream"] = False
            self.todo.append((kind, msg, rng.randint(0, 4)))  # act after this many chunks
        self.sock = None
        self.inflight: dict[str, tuple] = {}  # rid -> (kind, msg, at)
        self.msgs: dict[str, list] = {}
        self.results: dict[str, tuple] = {}  # rid -> (kind, msg, messages) when ended
        self.abandoned: set[str] = set()
        self.cancelled: set[str] = set()
        self.stray: list = []

    def connect(self, poller) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        poller.register(self.sock, zmq.POLLIN)

    def fill(self) -> None:
        while self.todo and len(self.inflight) < 2:
            kind, msg, at = self.todo.popleft()
            self.inflight[msg["id"]] = (kind, msg, at)
            self.msgs[msg["id"]] = []
            self.sock.send_multipart([V, pack(msg)])
            if kind == "cancel" and at == 0:
                self._cancel(msg["id"])

    def _cancel(self, rid: str) -> None:
        self.cancelled.add(rid)
        self.sock.send_multipart([V, pack({"type": "cancel", "id": rid})])

    def on_message(self, msg: dict, poller) -> None:
        rid = msg.get("id")
        if rid not in self.inflight:
            self.stray.append(msg)
            return
        self.msgs[rid].append(msg)
        kind, req, at = self.inflight[rid]
        if msg["type"] in TERMINAL:
            del self.inflight[rid]
            self.results[rid] = (kind, req, self.msgs.pop(rid))
            return
        n = len(self.msgs[rid])
        if kind == "cancel" and n == at and rid not in self.cancelled:
            self._cancel(rid)
        elif kind == "disconnect" and n == max(at, 1):  # drop the connection mid-stream
            poller.unregister(self.sock)
            self.sock.close(0)
            for other in self.inflight:
                self.abandoned.add(other)
                self.msgs.pop(other, None)
            self.inflight.clear()
            self.connect(poller)

    @property
    def finished(self) -> bool:
        return not self.todo and not self.inflight


def test_64_concurrent_clients_with_cancels_and_disconnects(live, ctx):
    rng = random.Random(64)
    clients = [_Conc(i, random.Random(rng.random()), ctx, live.endpoint) for i in range(64)]
    poller = zmq.Poller()
    for c in clients:
        c.connect(poller)
        c.fill()
    owner = lambda: {c.sock: c for c in clients}  # noqa: E731 - sockets change on disconnect
    deadline = time.monotonic() + 120
    while not all(c.finished for c in clients):
        assert time.monotonic() < deadline, [(c.i, list(c.inflight)) for c in clients if not c.finished][:5]
        events = dict(poller.poll(500))
        by_sock = owner()
        for sock in list(events):
            c = by_sock.get(sock)
            if c is None:
                continue  # closed by a disconnect in this round
            while c.sock is sock:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                assert frames[0] == V and len(frames) == 2
                c.on_message(msgpack.unpackb(frames[1], raw=False), poller)
            c.fill()
    time.sleep(0.3)  # nothing may arrive after a terminal message
    for c in clients:
        while c.sock.poll(0):
            c.stray.append(msgpack.unpackb(c.sock.recv_multipart()[1], raw=False))
    counts = defaultdict(int)
    for c in clients:
        assert not c.stray, (c.i, c.stray[:3])
        for kind, req, msgs in c.results.values():
            term = check_request(msgs, stream=req.get("stream", True))
            assert term["type"] == "done", term
            if kind in ("normal", "nostream"):
                assert term["finish_reason"] in ("stop", "length"), term
                if term["finish_reason"] == "length":
                    assert len(term["token_ids"]) == req["max_tokens"]
            elif kind == "cancel":
                assert term["finish_reason"] in ("cancelled", "length"), term
            counts[(kind, term["finish_reason"])] += 1
    total = sum(len(c.results) + len(c.abandoned) for c in clients)
    assert total >= 64 * 3
    assert counts[("cancel", "cancelled")] >= 10, dict(counts)
    assert sum(len(c.abandoned) for c in clients) >= 3, "too few disconnects to mean anything"
    for c in clients:
        c.sock.close(0)
    # Resources are back: nothing live, the worker's KV cache and batch rows are all free.
    live.assert_no_leak()
    with Client(live.endpoint, timeout=30) as cl:
        assert cl.info()["live_requests"] == 0
        assert cl.generate("Still here?", max_tokens=4).finish_reason in ("stop", "length")


def test_async_clients_with_cancels_and_disconnects(live):
    n_clients = 64

    async def one(i: int) -> dict:
        rng = random.Random(1000 + i)
        c = AsyncClient(live.endpoint, timeout=60)
        outcome = defaultdict(int)
        drop = i % 6 == 5  # these clients close the connection while their requests stream

        async def req(j: int) -> None:
            kind = "stream" if drop and j == 0 else rng.choice(["generate", "stream", "cancel"])
            prompt = rng.choice(PROMPTS)
            try:
                if kind == "generate":
                    r = await c.generate(prompt, max_tokens=rng.randint(1, 24))
                    assert r.finish_reason in ("stop", "length") and len(r.token_ids) == r.usage["completion_tokens"]
                else:
                    s = c.stream(prompt, max_tokens=120 if kind == "cancel" or drop else 16, ignore_eos=True)
                    chunks = []
                    async for ch in s:
                        chunks.append(ch)
                        if kind == "cancel" and len(chunks) == 2:
                            await s.cancel()
                        if drop and j == 0 and len(chunks) == 3:
                            await c.close()  # abrupt: no cancel is sent for the other requests
                    assert [ch.seq for ch in chunks] == list(range(len(chunks)))
                    assert "".join(ch.text for ch in chunks) == s.result.text
                    if kind == "cancel":
                        assert s.result.finish_reason == "cancelled"
                outcome[kind] += 1
            except ConnectionClosed:
                assert drop
                outcome["closed"] += 1

        await asyncio.gather(*(req(j) for j in range(4)))
        await c.close()
        return outcome

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n_clients)))

    outcomes = asyncio.run(main())
    assert sum(o["closed"] for o in outcomes) >= n_clients // 6
    assert sum(o["cancel"] for o in outcomes) >= 5
    live.assert_no_leak()


# --------------------------------------------------------------------------- fuzz


ANY_ID = object()  # the server may or may not attribute the error


def _valid_base(rng: random.Random, rid: str) -> dict:
    msg = {"type": "generate", "id": rid}
    r = rng.random()
    if r < 0.5:
        msg["prompt"] = rng.choice(PROMPTS)
    elif r < 0.75:
        msg["prompt_token_ids"] = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
    else:
        msg["messages"] = [{"role": "user", "content": "hi"}]
    msg["max_tokens"] = rng.randint(1, 8)
    return msg


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice([None, True, False, rng.randint(-2**63, 2**64 - 1), rng.random() * 1e6, "",
                           "é" * rng.randint(0, 20), bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 16))),
                           msgpack.ExtType(rng.randint(0, 127), b"ext"), float("nan"), -0.0])
    if r < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["type", "id", "prompt", "k", "", "nonce"]
    return {rng.choice(keys) + str(rng.randint(0, 3)): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


# One definitely-invalid change to a valid generate: (field, value, code).
_BAD_FIELDS = [
    ("prompt", 5, "bad_request"), ("prompt", "", "bad_request"), ("prompt", b"bytes", "bad_request"),
    ("prompt", ["a"], "bad_request"), ("prompt", "a" * ((1 << 18) + 1), "too_long"),
    ("messages", "hi", "bad_request"), ("messages", [], "bad_request"), ("messages", ["hi"], "bad_request"),
    ("messages", [{"role": "bot", "content": "x"}], "bad_request"),
    ("messages", [{"role": "user"}], "bad_request"), ("messages", [{"role": "user", "content": 1}], "bad_request"),
    ("messages", [{"role": "user", "content": "x", "name": "n"}], "bad_request"),
    ("messages", [{"role": "user", "content": "a" * 70000}] * 4, "too_long"),
    ("prompt_token_ids", [], "bad_request"), ("prompt_token_ids", ["1"], "bad_request"),
    ("prompt_token_ids", [-1], "bad_request"), ("prompt_token_ids", [VOCAB], "bad_request"),
    ("prompt_token_ids", [1.0], "bad_request"), ("prompt_token_ids", [True], "bad_request"),
    ("prompt_token_ids", [1] * ((1 << 17) + 1), "too_long"), ("prompt_token_ids", [3] * MAX_MODEL_LEN, "too_long"),
    ("max_tokens", 0, "bad_request"), ("max_tokens", -2**63, "bad_request"), ("max_tokens", "8", "bad_request"),
    ("max_tokens", 1.5, "bad_request"), ("max_tokens", True, "bad_request"), ("max_tokens", [8], "bad_request"),
    ("temperature", -0.5, "bad_request"), ("temperature", "hot", "bad_request"), ("temperature", True, "bad_request"),
    ("temperature", float("nan"), "bad_request"), ("temperature", float("inf"), "bad_request"),
    ("top_p", 0, "bad_request"), ("top_p", 1.0001, "bad_request"), ("top_p", -1, "bad_request"),
    ("top_p", "1", "bad_request"), ("top_k", -1, "bad_request"), ("top_k", 2.5, "bad_request"),
    ("top_k", False, "bad_request"), ("seed", 1.5, "bad_request"), ("seed", "42", "bad_request"),
    ("seed", [1], "bad_request"), ("stop", "x", "bad_request"), ("stop", [""], "bad_request"),
    ("stop", [1], "bad_request"), ("stop", ["s"] * 17, "bad_request"), ("stop", {"a": 1}, "bad_request"),
    ("stop_token_ids", [-3], "bad_request"), ("stop_token_ids", ["a"], "bad_request"),
    ("stop_token_ids", [1] * 65, "bad_request"), ("stop_token_ids", [VOCAB + 9], "bad_request"),
    ("stop_token_ids", 5, "bad_request"), ("ignore_eos", 1, "bad_request"), ("ignore_eos", "true", "bad_request"),
    ("stream", 0, "bad_request"), ("stream", "no", "bad_request"), ("logprobs", 1, "bad_request"),
    ("grammar", "point", "bad_request"), ("grammar", {}, "bad_request"), ("grammar", {"kind": 1}, "bad_request"),
    ("grammar", {1: "point"}, "bad_request"), ("grammar", {"kind": "nonsense"}, "bad_request"),
    ("grammar", {"kind": "point", "max_objects": 0}, "bad_request"),
    ("grammar", {"kind": "regex", "pattern": "(("}, "bad_request"),
    ("max_token", 5, "bad_request"), ("Prompt", "x", "bad_request"), ("extra", None, None),  # nil = absent: valid
]


def _fuzz_case(rng: random.Random, i: int):
    """(frames, expected error code or a set of codes, expected id / ANY_ID)."""
    rid = f"f{i}"
    r = rng.randrange(14)
    if r == 0:  # wrong version frame; the id comes first in the map, so the error carries it
        version = rng.choice([b"TANDEM2", b"tandem1", b"", b"TANDEM1 ", b"TANDEM", b"\x00" * 7,
                              bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 12)))])
        if version == V:
            version = b"X"
        return [version, pack({"id": rid, **_valid_base(rng, rid)})], "unsupported_version", rid
    if r == 1:  # wrong version frame and an unreadable payload, or a version frame alone
        frames = [rng.choice([b"TANDEM0", b"{", b"\xff"])]
        if rng.random() < 0.7:
            frames.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 24))))
        return frames, "unsupported_version", ANY_ID
    if r == 2:  # not msgpack: random bytes, truncated maps, trailing bytes, invalid UTF-8
        good = pack(_valid_base(rng, rid))
        payload = rng.choice([
            bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))),
            good[:rng.randint(0, len(good) - 1)],
            good + b"\x00",
            b"\x81\xa2id\xa2\xff\xfe",  # {"id": <invalid UTF-8>}
            b"\xc1",  # never used
            b"\xdd\xff\xff\xff\xff",  # array32 header claiming 4 G items
        ])
        return [V, payload], "bad_request", ANY_ID
    if r == 3:  # random msgpack values that are not maps
        v = _random_value(rng)
        while isinstance(v, dict):
            v = _random_value(rng)
        return [V, pack(v)], "bad_request", None
    if r == 4:  # random maps: no valid type
        m = _random_value(rng, 3) if rng.random() < 0.5 else {}
        m = m if isinstance(m, dict) else {}
        m.pop("type", None)
        m["id"] = rid
        if rng.random() < 0.5:
            m["type"] = rng.choice([5, None, "GENERATE", "generate ", "", "shutdown", ["generate"], b"ping"])
        return [V, pack(m)], "bad_request", rid
    if r == 5:  # non-string keys
        m = _valid_base(rng, rid)
        m[rng.choice([1, 2.5, b"k", True, None])] = "x"
        return [V, pack(m)], "bad_request", ANY_ID
    if r in (6, 7, 8):  # one wrong field in a generate
        field, value, code = rng.choice(_BAD_FIELDS)
        if code is None:
            field, value, code = "max_token", 1, "bad_request"
        m = _valid_base(rng, rid)
        if field in ("prompt", "messages", "prompt_token_ids"):
            for k in ("prompt", "messages", "prompt_token_ids"):
                m.pop(k, None)
        m[field] = value
        return [V, pack(m)], code, rid
    if r == 9:  # prompt fields: none or several
        m = _valid_base(rng, rid)
        for k in ("prompt", "messages", "prompt_token_ids"):
            m.pop(k, None)
        for k in rng.sample(["prompt", "messages", "prompt_token_ids"], rng.choice([0, 2, 3])):
            m[k] = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [1]}[k]
        return [V, pack(m)], "bad_request", rid
    if r == 10:  # bad ids: the error cannot carry them
        m = _valid_base(rng, rid)
        m["id"] = rng.choice([5, "", "x" * 129, "y" * 5000, ["id"], b"bin", True, 1.5])
        if rng.random() < 0.3:
            m["type"] = rng.choice(["cancel", "generate"])
        return [V, pack(m)], "bad_request", None
    if r == 11:  # cancel / ping / info with bad fields
        m = rng.choice([
            ({"type": "cancel"}, None), ({"type": "cancel", "id": 7}, None),
            ({"type": "cancel", "id": rid, "reason": "x"}, rid), ({"type": "ping", "nonce": 1, "x": 2}, None),
            ({"type": "ping", "id": rid}, rid), ({"type": "info", "verbose": True}, None),
            ({"type": "info", "id": rid}, rid),
        ])
        return [V, pack(m[0])], "bad_request", m[1]
    if r == 12:  # extra frames (reserved): the id is peeked from the map
        m = pack({"id": rid, **_valid_base(rng, rid)})
        extra = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 32))) for _ in range(rng.randint(1, 3))]
        return [V, m, *extra], "bad_request", rid
    # r == 13: huge or deep values
    kind = rng.randrange(4)
    if kind == 0:  # deeply nested: past the decoder's depth limit
        depth = rng.choice([1024, 3000, 100_000])
        if rng.random() < 0.5:
            payload = b"\x82" + pack("type") + pack("ping") + pack("nonce") + b"\x91" * depth + b"\x01"
        else:
            payload = b"\x91" * depth + b"\x01"
        return [V, payload], "bad_request", None
    if kind == 1:  # long lists
        m = _valid_base(rng, rid)
        m[rng.choice(["stop", "stop_token_ids"])] = rng.choice([["s" * 100] * 1000, [1] * 5000])
        return [V, pack(m)], "bad_request", rid
    if kind == 2:  # numbers out of every range
        m = _valid_base(rng, rid)
        m[rng.choice(["temperature", "top_p"])] = rng.choice([1e308 * 10, -1e308 * 10])
        return [V, pack(m)], "bad_request", rid
    m = _valid_base(rng, rid)
    m["max_tokens"] = rng.choice([-1, -2**63, 0])
    m["prompt_token_ids"] = [2**64 - 1] * rng.randint(1, 3)
    m.pop("prompt", None), m.pop("messages", None)
    return [V, pack(m)], "bad_request", rid


def _fuzz_messages(rng: random.Random, start: int, count: int) -> list:
    out = []
    for i in range(start, start + count):
        if i % 500 == 499:  # a message over the size limit (below the transport's hard cap), 20 in all
            rid = f"f{i}"
            out.append(([V, pack({"type": "generate", "id": rid, "prompt": "z" * ((1 << 20) + 10)})], "too_long",
                        rid))
        elif i % 997 == 0:
            out.append(([V], "bad_request", None))  # the version frame alone
        else:
            out.append(_fuzz_case(rng, i))
    return out


def test_fuzz_malformed_messages_while_serving(live, ctx):
    rng = random.Random(10_000)
    fuzz = Raw(ctx, live.endpoint)
    fuzz.sock.setsockopt(zmq.SNDHWM, 0)
    fuzz.sock.setsockopt(zmq.RCVHWM, 0)
    stop = threading.Event()
    valid_results: list = []
    valid_errors: list = []

    def valid_traffic():  # a well-behaved client, throughout
        vrng = random.Random(1)
        try:
            with Client(live.endpoint, timeout=60) as c:
                while not stop.is_set():
                    if vrng.random() < 0.5:
                        r = c.generate(vrng.choice(PROMPTS), max_tokens=vrng.randint(1, 12))
                    else:
                        s = c.stream(messages=[{"role": "user", "content": vrng.choice(PROMPTS)}],
                                     max_tokens=vrng.randint(1, 12))
                        text = "".join(ch.text for ch in s)
                        r = s.result
                        assert text == r.text
                    assert r.finish_reason in ("stop", "length")
                    valid_results.append(r)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            valid_errors.append(e)

    t = threading.Thread(target=valid_traffic, daemon=True)
    t.start()
    n, batch, sent = 10_000, 400, 0
    codes = defaultdict(int)
    mismatches = []
    while sent < n:
        cases = _fuzz_messages(rng, sent, min(batch, n - sent))
        for frames, _, _ in cases:
            fuzz.send_frames(frames)
        nonce = f"batch{sent}"
        fuzz.send({"type": "ping", "nonce": nonce})  # the connection stays usable: replies come in order
        replies = []
        deadline = time.monotonic() + 60
        while len(replies) < len(cases) + 1:
            assert time.monotonic() < deadline, f"{len(replies)} of {len(cases) + 1} replies"
            while fuzz.sock.poll(0 if replies else 1000):
                frames = fuzz.sock.recv_multipart()
                assert len(frames) == 2 and frames[0] == V
                replies.append(msgpack.unpackb(frames[1], raw=False))
        assert replies[-1] == {"type": "pong", "nonce": nonce}, replies[-1]
        for (frames, code, rid), reply in zip(cases, replies):
            ok = reply.get("type") == "error" and reply.get("code") in ({code} if isinstance(code, str) else code) \
                and isinstance(reply.get("message"), str) and (rid is ANY_ID or reply.get("id") == rid)
            if not ok:
                mismatches.append((frames[0], frames[1][:120] if len(frames) > 1 else None, code, rid, reply))
            codes[reply.get("code")] += 1
        sent += len(cases)
    stop.set()
    t.join(60)
    fuzz.close()
    assert not mismatches, f"{len(mismatches)} unexpected replies, e.g. {mismatches[:5]}"
    assert not valid_errors, valid_errors
    assert len(valid_results) >= 5, "the valid client was starved"
    assert codes["unsupported_version"] > 500 and codes["too_long"] > 50 and codes["bad_request"] > 5000, codes
    live.assert_no_leak()
    with Client(live.endpoint, timeout=30) as c:
        assert c.generate("Hi", max_tokens=3).finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- KV stats through the protocol


def test_info_exposes_kv_pages_back_to_full_at_idle(live, conn):
    live.wait_idle(frontend_requests=False)
    conn.send({"type": "info"})
    info = conn.reply()
    assert info["kv_pages_free"] == info["kv_pages_total"] > 0


# --------------------------------------------------------------------------- regressions found by these tests


def _thread_cpu_s(tid: int) -> float:
    f = Path(f"/proc/{os.getpid()}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_server_does_not_spin(live, conn):
    # (Not wait_idle() after the request: Service.stats() polls with a timeout, which drains the eventfd.)
    conn.generate("w", max_tokens=3)
    check_request(conn.request("w"))
    time.sleep(0.2)  # the worker's Released
    tid = live.thread.native_id
    c0 = _thread_cpu_s(tid)
    time.sleep(1.5)
    used = _thread_cpu_s(tid) - c0
    assert used < 0.3, f"the idle server loop used {used:.2f} s of CPU in 1.5 s"


def test_cancel_of_a_queued_request_releases_it(live, conn):
    # Admission reserves prompt + max_tokens of KV: 1 + 1900 tokens = 238 pages of 8, 5 fit in 1199 pages.
    fillers = [f"fill{i}" for i in range(6)]
    for rid in fillers:
        conn.generate(rid, max_tokens=LONG, ignore_eos=True)
    conn.wait_for(lambda: all(conn.by_id[r] for r in fillers[:5]), what="5 admitted requests")
    conn.generate("queued", max_tokens=LONG, ignore_eos=True)
    conn.generate("queued-grammar", max_tokens=LONG, grammar={"kind": "regex", "pattern": "[a-z]+"})
    conn.pump(0.2)
    assert not conn.by_id["queued"] and not conn.by_id["fill5"]  # waiting for KV in the worker
    for rid in ("queued", "queued-grammar", *fillers):
        conn.send({"type": "cancel", "id": rid})
    for rid in ("queued", "queued-grammar", *fillers):
        assert check_request(conn.request(rid))["finish_reason"] == "cancelled"
    live.wait_idle(timeout=3)


# --------------------------------------------------------------------------- `tandem serve` under systemd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``tandem serve`` in a subprocess with a fake systemd notify socket."""

    def __init__(self, tmp_path: Path, bind: str, *extra: str, abstract: bool = False, device: str = "cpu") -> None:
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"tandem-test-{os.getpid()}-{time.monotonic_ns()}"
            self.notify.bind("\0" + name)
            addr = "@" + name
        else:
            addr = str(tmp_path / "notify.sock")
            self.notify.bind(addr)
        self.notify.settimeout(0.1)
        self.notes: list[tuple[float, str]] = []  # (monotonic time, datagram)
        self.stderr: list[str] = []
        self.worker_pid: int | None = None
        self.bind = bind
        env = dict(os.environ, NOTIFY_SOCKET=addr, WATCHDOG_USEC="200000", PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontend.cli.main", "serve", "--model", "tiny-random", "--device", device,
             "--bind", bind, "--http", f"127.0.0.1:{_free_port()}", "--exit-on-worker-failure", *extra],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._done = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._read_notify, daemon=True).start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            m = re.search(r"worker pid (\d+)", line)
            if m:
                self.worker_pid = int(m.group(1))

    def _read_notify(self) -> None:
        while not self._done.is_set():
            try:
                data = self.notify.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.notes.append((time.monotonic(), data.decode()))

    def states(self) -> list[str]:
        return [s for _, s in self.notes]

    def wait_note(self, prefix: str, timeout: float) -> int:
        """Index of the first notification starting with prefix."""
        deadline = time.monotonic() + timeout
        while True:
            for i, s in enumerate(self.states()):
                if s.startswith(prefix):
                    return i
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}): {''.join(self.stderr)[-2000:]}"
            assert time.monotonic() < deadline, f"no {prefix} in {self.states()}"
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            time.sleep(0.1)  # the last datagrams
            self._done.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._done.set()
        self.notify.close()
        if self.worker_pid and _alive(self.worker_pid):
            os.kill(self.worker_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True if pid is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gpu_workers_of(pid: int) -> list[int]:
    """Processes running gpu_worker whose parent is pid."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"gpu_worker" in cmd:
            out.append(int(d.name))
    return out


def test_closed_connection_cancels_its_requests_even_without_streaming(live, ctx):
    """A client that closes its socket gets its requests cancelled at once, stream: false
    included (nothing is ever sent to it, so no failed send can tell). A client connecting
    right after, likely on the reused fd, is not affected."""
    gone = Raw(ctx, live.endpoint)
    for rid in ("quiet", "quiet2"):  # no chunk is ever sent to this client
        gone.generate(rid, max_tokens=LONG, ignore_eos=True, stream=False)
    gone.ping()

    def running():
        reqs = {rid: r for (_ident, rid), r in live.server.live.items() if rid in ("quiet", "quiet2")}
        return reqs if len(reqs) == 2 and all(r.token_ids for r in reqs.values()) else None

    deadline = time.monotonic() + 30
    while not (reqs := live.on_server_thread(running)):
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    gone.close()
    fresh = Raw(ctx, live.endpoint)
    try:
        fresh.generate("after", max_tokens=6, ignore_eos=True, stream=False)
        done = check_request(fresh.request("after", timeout_s=30), stream=False)
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        deadline = time.monotonic() + 10
        while not live.on_server_thread(lambda: all(r.ended for r in reqs.values())):
            assert time.monotonic() < deadline, "the closed client's requests are still running"
            time.sleep(0.02)
        for r in reqs.values():
            assert r.finish_reason == FinishReason.CANCELLED and len(r.token_ids) < LONG, (r.finish_reason, len(r.token_ids))
        live.assert_no_leak()
    finally:
        fresh.close()


def test_second_stop_ends_the_drain_at_once(ctx):
    """While draining the server answers pings and refuses new requests; a second stop
    request ends the drain at once, and the request still in flight gets its error."""
    srv = LiveServer(drain_timeout_s=600)
    c = Raw(ctx, srv.endpoint)
    try:
        c.generate("long", max_tokens=LONG, ignore_eos=True)
        c.wait_for(lambda: len(c.by_id["long"]) >= 1, what="a chunk")
        srv.server.stop()
        c.ping()
        assert srv.server.draining and srv.thread.is_alive()
        c.generate("new", max_tokens=2)
        assert check_request(c.request("new"))["code"] == "overloaded"
        srv.server.stop()  # the second one: no more waiting
        srv.thread.join(30)
        assert not srv.thread.is_alive()
        term = check_request(c.request("long", timeout_s=10))
        assert term["type"] == "error" and "shutting down" in term["message"]
    finally:
        c.close()
        if srv.thread.is_alive():
            srv.close()


def test_worker_restart_keeps_the_server_answering(ctx):
    """kill -9 of the worker: its requests fail with worker_failed, and while the next
    worker generation loads the server still answers pings and info, and queues new
    requests, which are served once it is ready."""
    srv = LiveServer()  # its own server: this test kills the worker
    c = Raw(ctx, srv.endpoint)
    try:
        c.generate("inflight", max_tokens=LONG, ignore_eos=True)
        c.wait_for(lambda: len(c.by_id["inflight"]) >= 1, what="a chunk")
        os.kill(srv.svc.worker_pid, signal.SIGKILL)
        err = check_request(c.request("inflight", timeout_s=10))
        assert err["type"] == "error" and err["code"] == "worker_failed", err
        c.ping()  # a fresh interpreter importing torch takes seconds: the new worker is still loading
        c.send({"type": "info"})
        info = c.reply()
        assert info["generation"] == 2 and info["worker_ready"] is False and "kv_pages_free" not in info, info
        c.generate("queued", max_tokens=5, ignore_eos=True)
        done = check_request(c.request("queued", timeout_s=120))
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        c.send({"type": "info"})
        info = c.reply()
        assert info["generation"] == 2 and info["worker_ready"] is True and "kv_pages_free" in info, info
        srv.assert_no_leak()
        c.assert_quiet(0.1)
    finally:
        c.close()
        srv.close()


def test_serve_ready_after_warmup_watchdog_and_worker_kill(tmp_path, ctx):
    srv = ServeProcess(tmp_path, f"tcp://127.0.0.1:{_free_port()}")
    try:
        ready = srv.wait_note("READY=1", 180)
        assert ready == 0, f"something before READY: {srv.states()[:ready]}"  # no WATCHDOG before READY
        assert "STATUS=serving on tcp://127.0.0.1:" in srv.states()[0]
        assert re.search(r"tandem: worker: loading \S*tiny-random\S* on cpu\n", "".join(srv.stderr))  # start-up progress
        # READY means warmed up: the worker exists and a request is served at once.
        deadline = time.monotonic() + 10
        while srv.worker_pid is None:
            assert time.monotonic() < deadline, srv.stderr
            time.sleep(0.02)
        assert _alive(srv.worker_pid) and srv.worker_pid in _gpu_workers_of(srv.proc.pid)
        c = Raw(ctx, srv.bind)  # closed by the ctx fixture if the test fails
        c.generate("first", max_tokens=4)
        assert check_request(c.request("first", timeout_s=30))["type"] == "done"
        # WATCHDOG=1 repeatedly while healthy (every WATCHDOG_USEC/2 = 0.1 s).
        t0 = time.monotonic()
        time.sleep(1.2)
        n_healthy = sum(1 for t, s in srv.notes if s == "WATCHDOG=1" and t >= t0)
        assert n_healthy >= 3, srv.states()
        # kill -9 the worker while a request streams.
        c.generate("inflight", max_tokens=LONG, ignore_eos=True)
        c.wait_for(lambda: len(c.by_id["inflight"]) >= 1, what="a chunk")
        n_before = len(srv.notes)
        os.kill(srv.worker_pid, signal.SIGKILL)
        rc = srv.wait_exit(60)
        assert rc != 0, "the server must exit non-zero when the worker dies (--exit-on-worker-failure)"
        after = srv.states()[n_before:]
        # At most one WATCHDOG=1 can race the kill (sent in the same loop iteration); none after STOPPING.
        assert after.count("WATCHDOG=1") <= 1, after
        if "STOPPING=1" in after:
            assert "WATCHDOG=1" not in after[after.index("STOPPING=1"):]
        err = check_request(c.request("inflight", timeout_s=10))
        assert err["type"] == "error" and err["code"] == "worker_failed", err
        c.assert_quiet(0.2)  # one terminal message only
        stderr = "".join(srv.stderr)  # the failure, then one line for the operator (no class name, no traceback)
        assert "worker generation 1 failed" in stderr and re.search(r"^Error: \S", stderr, re.M), stderr
        assert "Traceback" not in stderr and "WorkerDown" not in stderr, stderr
        assert not _alive(srv.worker_pid)
        c.close()
    finally:
        srv.close()


# The SIGTERM drain runs on the simulated device: a decode step takes at least SIM_STEP_MS, so
# LONG tokens (38 s) cannot finish within the drain on any CPU, and SHORT tokens (2 s of device
# time) do on any CPU whose real work for a step of three rows fits in DRAIN_S / SHORT (60 ms).
SIM_STEP_MS, DRAIN_S, SHORT = 20, 6, 100


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory, ctx) -> dict:
    """SIGTERM to a healthy ``tandem serve`` (drain DRAIN_S) with three requests in flight: two
    too long to finish in the drain, one short; and a request sent while draining."""
    tmp = tmp_path_factory.mktemp("sigterm")
    srv = ServeProcess(tmp, f"ipc://{tmp}/api.sock", "--max-queue", "3", "--drain-timeout", str(DRAIN_S),
                       abstract=True, device=f"sim:{SIM_STEP_MS}")
    c = Raw(ctx, srv.bind)
    try:
        srv.wait_note("READY=1", 180)
        c.generate("a", max_tokens=LONG, ignore_eos=True)
        c.generate("b", max_tokens=LONG, ignore_eos=True, stream=False)
        c.wait_for(lambda: len(c.by_id["a"]) >= 2, what="chunks")
        c.generate("short", max_tokens=SHORT, ignore_eos=True)
        c.generate("c", max_tokens=2)  # --max-queue 3 is wired through
        overloaded = check_request(c.request("c"))
        c.wait_for(lambda: len(c.by_id["short"]) >= 1, what="a chunk of the short request")
        worker = srv.worker_pid
        assert worker and _alive(worker)
        n_before = len(srv.notes)
        srv.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        short_chunks_at_term = len(c.by_id["short"])
        srv.wait_note("STOPPING=1", 10)
        c.generate("late", max_tokens=2)  # while draining
        late = check_request(c.request("late"))
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            c.pump(0.05)  # keep reading: a client that stops reading is cut off at its queue limit
        rc = srv.wait_exit(10)
        stopped_after_s = time.monotonic() - t_term
        c.pump(0.5)
        return {"rc": rc, "after": srv.states()[n_before:], "stderr": "".join(srv.stderr), "worker": worker,
                "server_pid": srv.proc.pid, "overloaded": overloaded, "late": late,
                "short_chunks_at_term": short_chunks_at_term, "stopped_after_s": stopped_after_s,
                "messages": {rid: c.by_id.pop(rid, []) for rid in ("a", "b", "short")}, "other": list(c.other),
                "rest": dict(c.by_id)}
    finally:
        c.close()
        srv.close()


def test_serve_sigterm_stops_cleanly(sigterm_run):
    r = sigterm_run
    assert r["overloaded"]["type"] == "error" and r["overloaded"]["code"] == "overloaded"
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert "STOPPING=1" in r["after"], r["after"]
    assert "WATCHDOG=1" not in r["after"][r["after"].index("STOPPING=1"):]
    # In-flight requests got a terminal message, after their chunks in order.
    for rid, stream in (("a", True), ("b", False), ("short", True)):
        msgs = r["messages"][rid]
        first_terminal = next(i for i, m in enumerate(msgs) if m["type"] in TERMINAL)
        term = check_request(msgs[:first_terminal + 1], stream=stream)
        assert term["type"] in TERMINAL
    assert not r["other"] and not any(r["rest"].values()), (r["other"], r["rest"])
    assert "tandem: stopped" in r["stderr"]
    assert not _alive(r["worker"]), "the gpu_worker outlived the server"
    assert _gpu_workers_of(r["server_pid"]) == []


def test_serve_sigterm_drains_in_flight_requests(sigterm_run):
    """The short request, in flight at SIGTERM, finished normally during the drain; the long
    ones were cut at the drain deadline; a request sent while draining got overloaded."""
    r = sigterm_run
    short = check_request(r["messages"]["short"])
    assert r["short_chunks_at_term"] < SHORT and short["type"] == "done" and short["finish_reason"] == "length"
    assert len(short["token_ids"]) == SHORT
    for rid in ("a", "b"):
        term = check_request(r["messages"][rid], stream=rid == "a")
        assert term["type"] == "error" and "shutting down" in term["message"], term
    assert r["late"]["type"] == "error" and r["late"]["code"] == "overloaded", r["late"]
    assert "shutting down" in r["late"]["message"]
    assert DRAIN_S - 0.5 < r["stopped_after_s"] < DRAIN_S + 25  # waited for the drain deadline, not for LONG tokens


def test_serve_sigterm_sends_exactly_one_terminal_per_request(sigterm_run):
    for rid in ("a", "b", "short"):
        terminals = [m for m in sigterm_run["messages"][rid] if m["type"] in TERMINAL]
        assert len(terminals) == 1, terminals

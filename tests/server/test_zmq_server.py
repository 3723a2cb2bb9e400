"""The ZeroMQ server over a real socket (``docs/PROTOCOL.md``): info, generate's guarantees, stop
strings, cancel, errors, KV stats. One in-process server (``live_server.LiveServer``, conftest.py),
raw DEALER sockets (``live_server.Raw``) and ``frontend.client``."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from live_server import LONG, MAX_BATCH, MAX_MODEL_LEN, TERMINAL, VOCAB, Raw, check_request, pack

from frontend.client import AsyncClient, BadRequest, Client, Overloaded, TooLong
from frontend.server.tokenization import chat_prompt_ids, text_prompt_ids

pytestmark = pytest.mark.slow

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
    assert err["type"] == "error" and err["code"] == "context_length_exceeded", err
    conn.generate("fits", prompt_token_ids=[7] * (MAX_MODEL_LEN - 1), max_tokens=5)
    done = check_request(conn.request("fits"))  # the longest prompt that fits: one generated token
    assert done["type"] == "done" and done["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    conn.generate("chars", prompt="a" * ((1 << 18) + 1))
    assert check_request(conn.request("chars"))["code"] == "too_long"
    with Client(live.endpoint, timeout=30) as c, pytest.raises(TooLong) as e:  # its subclass
        c.generate(prompt_token_ids=[7] * (MAX_MODEL_LEN + 5))
    assert e.value.code == "context_length_exceeded"
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

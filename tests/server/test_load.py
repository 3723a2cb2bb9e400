"""The ZeroMQ server under load: 64 concurrent clients (sync and async) with cancels and disconnects,
and malformed messages fuzzed while it serves."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import defaultdict, deque

import msgpack
import pytest
import zmq
from live_server import MAX_MODEL_LEN, TERMINAL, VOCAB, Raw, V, check_request, pack

from frontend.client import AsyncClient, Client, ConnectionClosed

pytestmark = pytest.mark.slow

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
    ("prompt_token_ids", [1] * ((1 << 17) + 1), "too_long"), ("prompt_token_ids", [3] * MAX_MODEL_LEN, "context_length_exceeded"),
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

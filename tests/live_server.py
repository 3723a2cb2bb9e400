"""What the tests of a live server share: an in-process ``Server`` on a thread in front of a
real two-process ``Service`` with the tiny model (:class:`LiveServer`), a raw DEALER client
that speaks the protocol by hand (:class:`Raw`: pyzmq and msgpack only, the contract as any
other language sees it) and the guarantees every request's messages keep (:func:`check_request`).

The ``Service`` is single-threaded: only the server thread may touch it. To read the
worker's stats (KV pages, batch rows) ``LiveServer`` wraps the service's ``poll`` so that
the server thread runs test callables between two loop iterations
(:meth:`LiveServer.on_server_thread`); nothing in the server is changed for the tests.
"""
from __future__ import annotations

import queue
import re
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future

import msgpack
import zmq

from frontend.server.service import Service, ServiceConfig
from frontend.server.zmq_server import Server

V = b"TANDEM1"
TERMINAL = ("done", "error")
FINISH_REASONS = {"stop", "length", "cancelled"}
ERROR_CODES = {"bad_request", "unsupported_version", "duplicate_id", "too_long", "context_length_exceeded", "overloaded",
               "worker_failed", "internal"}
MAX_BATCH = 32
MAX_MODEL_LEN = 2048  # tiny-random's max_position_embeddings: the default context
VOCAB = 49152  # tiny-random (SmolLM2 tokenizer)
LONG = 1900  # max_tokens that keeps a request live for the whole test (ignore_eos)


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


class LiveServer:
    """One ``Server`` on a thread, plus a way to run code on that thread."""

    def __init__(self, model: str = "tiny-random", max_model_len: int | None = None, **server_kw) -> None:
        self.svc = Service(ServiceConfig(model=model, device="cpu", max_batch=MAX_BATCH, kv_pages=1200,
                                         page_size=8, max_model_len=max_model_len))
        try:
            self.server = Server(self.svc, "tcp://127.0.0.1:0", **server_kw)
        except zmq.ZMQError:  # a libzmq that wants the wildcard form
            self.server = Server(self.svc, "tcp://127.0.0.1:*", **server_kw)
        self.endpoint = self.server.endpoint
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", self.endpoint) and not self.endpoint.endswith(":0")
        self._calls: queue.Queue = queue.Queue()
        self._in_call = False
        poll = self.svc.poll

        def poll_and_run_calls(timeout: float = 0.0) -> int:
            n = poll(timeout)
            if not self._in_call:
                self._in_call = True
                try:
                    while True:
                        try:
                            fn, fut = self._calls.get_nowait()
                        except queue.Empty:
                            break
                        try:
                            fut.set_result(fn())
                        except BaseException as e:  # noqa: BLE001 - handed to the test thread
                            fut.set_exception(e)
                finally:
                    self._in_call = False
            return n

        self.svc.poll = poll_and_run_calls  # instance attribute: the server loop calls it every iteration
        self.thread = threading.Thread(target=self.server.serve_forever, name="tandem-server", daemon=True)
        self.thread.start()

    def on_server_thread(self, fn, timeout: float = 30.0):
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut.result(timeout)

    def wait_idle(self, timeout: float = 30.0, frontend_requests: bool = True) -> dict:
        """Every request ended and released: nothing live in the server, the worker's KV pages and batch
        rows all free, every mask row back, and (``frontend_requests``) no request state left in the
        service. Returns the worker's stats."""
        server, svc = self.server, self.svc
        deadline = time.monotonic() + timeout
        while True:
            state = self.on_server_thread(lambda: (len(server.live), len(svc.unsent),
                                                   len(svc.free_mask_rows),
                                                   len(svc.requests) if frontend_requests else 0))
            stats = self.on_server_thread(svc.stats)
            worker = (stats["kv_pages_free"] == stats["kv_pages_total"] and stats["rows_free"] == stats["rows_total"]
                      and stats["waiting"] == 0 and stats["running"] == 0)
            if state == (0, 0, MAX_BATCH, 0) and worker:
                return stats
            assert time.monotonic() < deadline, \
                f"not idle: server live, waiting for a mask row, free mask rows, service requests = {state}; " \
                f"worker {stats}"
            time.sleep(0.05)

    def leftover_requests(self) -> list[tuple]:
        """Request state still held by the service: (ended, finish_reason, tokens, id)."""
        return self.on_server_thread(lambda: [(r.ended, r.finish_reason, len(r.token_ids), r.user_data.id)
                                              for r in self.svc.requests.values()])

    def assert_no_leak(self) -> None:
        """Everything is idle and no request state is left anywhere."""
        self.wait_idle(frontend_requests=False)
        assert self.leftover_requests() == []

    def close(self) -> None:
        self.server.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()


class Raw:
    """A DEALER connection that speaks the protocol by hand and records everything it receives."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.by_id: dict[str, list[dict]] = defaultdict(list)  # chunk/done/error with an id
        self.other: deque[dict] = deque()  # pong, info, errors with a nil id
        self.ended: set[str] = set()  # ids whose terminal message was taken by request()
        self.after_terminal: list[dict] = []  # contract violations: anything for an ended id

    def send(self, msg) -> None:
        self.sock.send_multipart([V, pack(msg)])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def generate(self, rid: str, **fields) -> None:
        if not any(k in fields for k in ("prompt", "messages", "prompt_token_ids")):
            fields["prompt"] = "Hello"
        self.send({"type": "generate", "id": rid, **fields})

    def _recv(self, timeout_s: float) -> bool:
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return False
        frames = self.sock.recv_multipart()
        assert len(frames) == 2 and frames[0] == V, f"not a two-frame TANDEM1 message: {frames[:1]}"
        msg = msgpack.unpackb(frames[1], raw=False)
        assert isinstance(msg, dict) and isinstance(msg.get("type"), str), msg
        if msg["type"] in ("chunk", "done") or (msg["type"] == "error" and msg.get("id") is not None):
            if msg["id"] in self.ended:
                self.after_terminal.append(msg)
            self.by_id[msg["id"]].append(msg)
        else:
            self.other.append(msg)
        return True

    def pump(self, timeout_s: float = 0.0) -> None:
        """Receive what has arrived (waiting up to timeout_s for the first message)."""
        if self._recv(timeout_s):
            while self._recv(0):
                pass

    def wait_for(self, cond, timeout_s: float = 60.0, what: str = "a condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}"
            self._recv(min(left, 0.5))

    def request(self, rid: str, timeout_s: float = 60.0) -> list[dict]:
        """All messages of ``rid`` up to and including its terminal one (which must be the last)."""
        self.wait_for(lambda: any(m["type"] in TERMINAL for m in self.by_id.get(rid, ())), timeout_s,
                      f"the terminal message of {rid!r}")
        msgs = self.by_id.pop(rid)
        assert msgs[-1]["type"] in TERMINAL, f"messages after the terminal one for {rid}: {msgs}"
        self.ended.add(rid)
        return msgs

    def reply(self, timeout_s: float = 30.0) -> dict:
        """The next message not attributed to a request (pong, info, error with a nil id)."""
        self.wait_for(lambda: bool(self.other), timeout_s, "a reply")
        return self.other.popleft()

    def ping(self, nonce="sync", timeout_s: float = 30.0) -> None:
        """Round trip: everything the server sent before the pong has been received."""
        self.send({"type": "ping", "nonce": nonce})
        r = self.reply(timeout_s)
        assert r == {"type": "pong", "nonce": nonce}, r

    def assert_quiet(self, seconds: float = 0.2) -> None:
        self.pump(seconds)
        assert not self.after_terminal, f"messages after a terminal message: {self.after_terminal[:3]}"
        assert not self.other, f"unexpected replies: {list(self.other)[:3]}"
        assert not any(self.by_id.values()), f"unexpected messages: {dict(self.by_id)}"

    def close(self) -> None:
        self.sock.close(0)


def check_request(msgs: list[dict], stream: bool = True) -> dict:
    """Guarantees 1-3 for one request's messages; returns its terminal message."""
    assert msgs, "no messages"
    terminals = [m for m in msgs if m["type"] in TERMINAL]
    assert len(terminals) == 1, f"{len(terminals)} terminal messages: {terminals}"
    term = msgs[-1]
    assert term is terminals[0], "the terminal message is not the last one"
    chunks = msgs[:-1]
    assert all(m["type"] == "chunk" for m in chunks), [m["type"] for m in chunks]
    rid = term["id"]
    assert all(m["id"] == rid for m in msgs)
    assert [m["seq"] for m in chunks] == list(range(len(chunks))), "chunks out of order or with gaps"
    if not stream:
        assert chunks == [], "stream: false must send no chunk"
    if term["type"] == "error":
        assert term["code"] in ERROR_CODES and isinstance(term["message"], str), term
        return term
    assert term["finish_reason"] in FINISH_REASONS, term
    assert set(term) >= {"id", "finish_reason", "text", "token_ids", "usage", "metrics"}, term.keys()
    assert term["usage"]["completion_tokens"] == len(term["token_ids"]), term["usage"]
    assert isinstance(term["usage"]["prompt_tokens"], int) and term["usage"]["prompt_tokens"] >= 1
    assert set(term["metrics"]) >= {"ttft_ms", "total_ms"}
    if stream:
        assert "".join(m["text"] for m in chunks) == term["text"], "chunk texts do not add up to done.text"
        assert [t for m in chunks for t in m["token_ids"]] == term["token_ids"]
    return term

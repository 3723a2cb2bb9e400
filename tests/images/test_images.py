"""Images end to end through the two processes (DESIGN.md §4.5, §5), on ``tiny-random-vlm``.

A real ``Service`` (frontend) with its real worker process, float32 on the CPU:
pipelined and blocking serve a mixed image workload token for token alike
(chunked prefill splitting image spans included); the encoder cache encodes a
repeated image once; cancels at every phase (still preprocessing, waiting for
an tile block, in the worker) and a kill -9 of the worker give every request
exactly one terminal event and leave every tile block, encoder-cache
reference, KV page and batch row free. The ZeroMQ server, driven from the test
thread, answers each kind of bad image input with ``bad_request`` naming the
field, and reports ``vision``, ``encoder_cache`` and ``usage.image_tokens``.
The image pool's children run at nice 19; a bad image among good ones fails
only its request, a cancel while queued takes the work out of the pool, a
killed child fails its request and the next one gets a fresh pool, and
neither ``close()`` nor a killed frontend leaves a pool process behind.
"""
from __future__ import annotations

import dataclasses
import io
import multiprocessing
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import CancelledError
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from prerequisites import require

PIL = require("PIL")
from PIL import Image  # noqa: E402

from frontend.images.idefics3 import image_prompt_ids  # noqa: E402
from frontend.images.pool import ImagePool  # noqa: E402
from frontend.server.service import Service, ServiceConfig  # noqa: E402
from frontend.server.zmq_server import Server  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

TERMINAL = ("done", "error")
PROMPT = "<|im_start|>User:{}Describe this.<end_of_utterance>\nAssistant:"
V = b"TANDEM1"


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# Few tiles each (tiny-random-vlm: longest edge 256, 64-pixel tiles): a panorama is 4 + 1 tiles.
WIDE = [png(1000, 60, seed) for seed in range(6)]
BIG = png(300, 300, 99)  # 4 x 4 + 1 = 17 tiles


def make_service(**kw) -> Service:
    cfg = dict(model="tiny-random-vlm", device="cpu", dtype="float32", max_batch=16, prefill_budget=64,
               restart=True)
    return Service(ServiceConfig(**(cfg | kw)))


@pytest.fixture(scope="module")
def svc():
    s = make_service()
    yield s
    s.close()


class Log:
    """Every event of every request; the test fails on a second terminal event."""

    def __init__(self) -> None:
        self.terminal: dict[int, tuple[str, dict]] = {}
        self.chunks: dict[int, list[int]] = {}

    def __call__(self, req, kind, payload) -> None:
        assert req.seq_id not in self.terminal, f"event {kind} after the terminal event of {req.seq_id}"
        if kind == "chunk":
            self.chunks.setdefault(req.seq_id, []).extend(payload["token_ids"])
        else:
            self.terminal[req.seq_id] = (kind, payload)


def submit(svc: Service, log: Log, images: list[bytes], params: SamplingParams, text: str | None = None):
    if text is None:
        text = PROMPT.format("<image>" * len(images))
    if not images:
        return svc.submit(svc.tokenizer.encode(text, add_special_tokens=False), params, on_event=log)
    return svc.submit_images(images, lambda prepared: image_prompt_ids(svc.tokenizer, text, prepared,
                                                                       svc.image_params), params, on_event=log)


def assert_idle(svc: Service) -> dict:
    """At idle: no request state, every tile block free, no encoder-cache reference, every page and row free."""
    svc.run_until(lambda: svc.idle() and not svc.unsent, 60)
    images = svc.worker.images
    assert images.num_free == images.capacity and sorted(images.free) == list(range(images.capacity))
    stats = svc.stats()
    assert stats["encoder_cache_refs"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["rows_free"] == stats["rows_total"]
    assert stats["running"] == stats["waiting"] == 0
    return stats


def workload() -> list[tuple[list[bytes], SamplingParams]]:
    """48 requests: text only, one image, several images, one image repeated; greedy and seeded."""
    out = []
    for i in range(48):
        kind = i % 4
        images = ([] if kind == 0 else [WIDE[i % 5]] if kind == 1 else [WIDE[i % 3], WIDE[5], WIDE[(i + 1) % 3]]
                  if kind == 2 else [WIDE[0]] * 2)
        params = (SamplingParams(max_tokens=6 + i % 5, temperature=0.0) if i % 3 else
                  SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1000 + i))
        out.append((images, params))
    return out


def run_workload(svc: Service) -> tuple[list[list[int]], dict]:
    log = Log()
    reqs = [submit(svc, log, images, params) for images, params in workload()]
    svc.run_until(lambda: len(log.terminal) == len(reqs), 240)
    for r in reqs:
        kind, payload = log.terminal[r.seq_id]
        assert kind == "done", payload
        assert payload["token_ids"] == log.chunks.get(r.seq_id, [])
    return [log.terminal[r.seq_id][1]["token_ids"] for r in reqs], log.terminal[reqs[-1].seq_id][1]["usage"]


@pytest.mark.slow
def test_pipelined_equals_blocking_on_a_mixed_image_workload(svc):
    before = svc.stats()
    pipelined, usage = run_workload(svc)
    stats = assert_idle(svc)
    blocking_svc = make_service(pipeline=False)
    try:
        blocking, _ = run_workload(blocking_svc)
        assert_idle(blocking_svc)
    finally:
        blocking_svc.close()
    assert pipelined == blocking
    # The budget (64 tokens) splits every image span (80 tokens per panorama) across launches.
    assert usage["image_tokens"] == 2 * 5 * 16 and usage["prompt_tokens"] > 64
    # Each of the six distinct images was encoded once (repeats hit the encoder or the prefix cache).
    assert 0 < stats["encoded_images"] - before["encoded_images"] <= len(WIDE)
    # Non-vacuity: the images matter (same text, different image -> different greedy tokens).
    first = {tuple(workload()[i][0]): pipelined[i] for i in range(48) if workload()[i][1].temperature == 0}
    assert len({tuple(t) for k, t in first.items() if len(k) == 1}) > 1


def test_the_same_image_twice_runs_the_encoder_once(svc):
    """Different text before the same image (so no prefix-cache page covers it): the second
    request takes the features from the encoder cache and runs no vision encoder."""
    image = png(900, 50, seed=12345)  # never used elsewhere: a miss first
    log = Log()
    before = svc.stats()
    a = submit(svc, log, [image], SamplingParams(max_tokens=3), "<|im_start|>User: One.<image>Describe it.")
    svc.run_until(lambda: a.seq_id in log.terminal, 60)
    mid = svc.stats()
    b = submit(svc, log, [image], SamplingParams(max_tokens=3), "<|im_start|>User: Two more words.<image>Describe it.")
    svc.run_until(lambda: b.seq_id in log.terminal, 60)
    after = assert_idle(svc)
    assert mid["encoder_launches"] > before["encoder_launches"]  # non-vacuity: a miss encodes (chunk by chunk)
    assert mid["encoded_tiles"] == before["encoded_tiles"] + 5  # each of its 80 / 16 tiles once
    assert mid["encoder_cache_misses"] == before["encoder_cache_misses"] + 1
    assert after["encoder_launches"] == mid["encoder_launches"]  # the hit encodes nothing
    assert after["encoded_tiles"] == mid["encoded_tiles"]
    assert after["encoder_cache_hits"] == mid["encoder_cache_hits"] + 1
    assert log.terminal[b.seq_id][0] == "done" and log.terminal[b.seq_id][1]["usage"]["image_tokens"] == 80


def test_cancel_while_preprocessing_and_while_waiting_for_a_tile_block():
    # 20 one-tile blocks: one 17-tile image fits, a second must wait for the first's copy.
    svc = make_service(tile_blocks=20)
    try:
        log = Log()
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        preprocessing = submit(svc, log, [BIG], params)
        assert preprocessing.images.preparing
        svc.cancel(preprocessing)  # before the pool has even finished decoding
        assert log.terminal[preprocessing.seq_id][1]["finish_reason"] == "cancelled"

        first = submit(svc, log, [BIG], params)
        waiting = submit(svc, log, [png(300, 300, 7)], params)
        deadline = time.monotonic() + 30
        # All three decoded (the cancelled one's result is dropped): one poll then sends
        # the first and parks the second.
        while len(svc.images._prepared) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        svc.poll(0)
        assert first.submitted and not waiting.submitted and waiting in svc.unsent
        assert svc.worker.images.num_free < 17  # it waits for tile blocks, it is not dropped
        svc.cancel(waiting)
        assert log.terminal[waiting.seq_id][1]["finish_reason"] == "cancelled"
        svc.run_until(lambda: first.seq_id in log.terminal, 60)
        assert log.terminal[first.seq_id][1]["finish_reason"] == "length"
        # A request that waited for tile blocks is sent once they come back.
        late = [submit(svc, log, [png(300, 300, 20 + i)], params) for i in range(3)]
        svc.run_until(lambda: all(r.seq_id in log.terminal for r in late), 60)
        assert all(log.terminal[r.seq_id][0] == "done" for r in late)
        assert_idle(svc)
    finally:
        svc.close()


def test_an_image_over_every_tile_block_fails_only_its_request_naming_the_option():
    svc = make_service(tile_blocks=16)  # one-tile blocks: BIG's 17 tiles can never fit, a panorama's 5 can
    try:
        log = Log()
        params = SamplingParams(max_tokens=2, temperature=0.0)
        too_big, fits = submit(svc, log, [BIG], params), submit(svc, log, [WIDE[0]], params)
        svc.run_until(lambda: too_big.seq_id in log.terminal and fits.seq_id in log.terminal, 60)
        assert log.terminal[too_big.seq_id] == ("error", {
            "code": "bad_request", "message": "images: 17 tiles need 17 tile blocks; the server has 16 (--tile-blocks)"})
        assert log.terminal[fits.seq_id][0] == "done"  # non-vacuity: the blocks take an image that fits
        assert_idle(svc)
    finally:
        svc.close()


def test_cancel_at_every_phase_in_the_worker_frees_everything(svc):
    log = Log()
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)  # only a cancel ends them
    reqs = []
    for polls in range(12):  # cancel after 0..11 loop iterations: preprocessing, queued, prefill, decode
        req = submit(svc, log, [WIDE[polls % 6], png(400, 90, 500 + polls)], params)
        for _ in range(polls):
            svc.poll(0.005)
        svc.cancel(req)
        reqs.append(req)
    svc.run_until(lambda: all(r.seq_id in log.terminal for r in reqs), 60)
    assert {log.terminal[r.seq_id][1]["finish_reason"] for r in reqs} == {"cancelled"}
    assert_idle(svc)


@pytest.mark.slow
def test_kill_9_of_the_worker_with_images_in_flight():
    svc = make_service()
    try:
        log = Log()
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        reqs = [submit(svc, log, [WIDE[i % 6]] * (1 + i % 2), params) for i in range(10)]
        svc.run_until(lambda: any(log.chunks.values()), 60)  # some decode, some prefill, some still queued
        reqs += [submit(svc, log, [png(200, 200, 900 + i)], params) for i in range(3)]  # still preprocessing
        generation = svc.generation
        os.kill(svc.worker_pid, signal.SIGKILL)
        svc.run_until(lambda: len(log.terminal) == len(reqs), 60)
        assert {log.terminal[r.seq_id][1]["code"] for r in reqs if log.terminal[r.seq_id][0] == "error"} == {
            "worker_failed"}
        svc.run_until(lambda: svc.generation > generation and svc.worker_ready, 120)
        after = submit(svc, log, [WIDE[0]], SamplingParams(max_tokens=3))
        svc.run_until(lambda: after.seq_id in log.terminal, 60)
        assert log.terminal[after.seq_id][0] == "done"
        assert_idle(svc)
    finally:
        svc.close()


# ---- the ZeroMQ server: protocol 1.1 images ---------------------------------------------------------

def png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


class Pumped:
    """A Server whose loop the test thread turns (the Service is single-threaded)."""

    def __init__(self, svc: Service) -> None:
        self.server = Server(svc, "tcp://127.0.0.1:*")
        self.svc = svc
        self.client = zmq.Context.instance().socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(self.server.endpoint)
        self.received: dict[str, dict] = {}  # id -> its terminal (or info) message

    def send(self, msg: dict) -> None:
        self.client.send_multipart([V, msgpack.packb(msg, use_bin_type=True)])

    def until_terminal(self, rid: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while rid not in self.received:
            assert time.monotonic() < deadline, f"no terminal message for {rid}"
            self.server._read_clients()
            self.svc.poll(0.01)
            while self.client.poll(0):
                _, body = self.client.recv_multipart()
                msg = msgpack.unpackb(body, raw=False)
                if msg["type"] in TERMINAL:
                    assert msg["id"] not in self.received, f"a second terminal message for {msg['id']}"
                    self.received[msg["id"]] = msg
                elif msg["type"] == "info":
                    self.received["info"] = msg
        return self.received.pop(rid)

    def close(self) -> None:
        self.client.close()
        self.server.connections.close()
        self.server.sock.close()


@pytest.fixture
def server(svc):
    p = Pumped(svc)
    yield p
    p.close()


BAD_INPUTS = {
    "not an image": ({"prompt": "<image>hi", "images": [b"GIF89a-not-really"]}, r"images\[0\]: .*not an image"),
    "truncated": ({"prompt": "<image><image>x", "images": [WIDE[0], WIDE[1][:200]]}, r"images\[1\]: .*truncated"),
    "too big": ({"prompt": "<image>x", "images": [b"\x89PNG" + b"\0" * (20 * 1024 * 1024)]},
                r"images\[0\]: .*20 MiB"),
    "bomb": ({"prompt": "<image>x", "images": [png_header_only(9000, 9000)]}, r"images\[0\]: .*8192x8192"),
    "more than 8": ({"prompt": "<image>" * 9, "images": [WIDE[0]] * 9}, r"images: too many images: 9"),
    "placeholder count": ({"prompt": "<image> and <image>", "images": [WIDE[0]]}, r"2 <image> placeholders but 1"),
    "image parts count": ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                           "images": [WIDE[0]]}, r"2 image parts but 1"),
    "with prompt_token_ids": ({"prompt_token_ids": [1, 2, 3], "images": [WIDE[0]]}, r"prompt_token_ids"),
    "not bin": ({"prompt": "<image>x", "images": ["a string"]}, r"images\[0\] must be bin"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_image_input_is_a_bad_request_for_that_request_only(case, server):
    fields, pattern = BAD_INPUTS[case]
    server.send({"type": "generate", "id": "bad", "max_tokens": 2, **fields})
    server.send({"type": "generate", "id": "good", "prompt": "<image>ok", "images": [WIDE[2]], "max_tokens": 2})
    bad = server.until_terminal("bad")
    assert bad["type"] == "error" and bad["code"] == "bad_request", bad
    assert re.search(pattern, bad["message"]), bad["message"]
    good = server.until_terminal("good")
    assert good["type"] == "done" and good["usage"]["image_tokens"] == 5 * 16, good


def test_images_to_a_text_only_model_are_refused(server, monkeypatch):
    # what a text-only model's service has
    from shared.families import FAMILIES
    monkeypatch.setattr(server.svc, "model", dataclasses.replace(server.svc.model, family=FAMILIES["llama"]))
    monkeypatch.setattr(server.svc, "image_params", None)
    server.send({"type": "generate", "id": "t", "prompt": "<image>x", "images": [WIDE[0]]})
    msg = server.until_terminal("t")
    assert msg["code"] == "bad_request" and "takes no images" in msg["message"]


def test_messages_place_images_and_info_reports_vision(server):
    text = "What is this?"
    parts = [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": text}]
    server.send({"type": "generate", "id": "parts", "messages": [{"role": "user", "content": parts}],
                 "images": [WIDE[3]], "max_tokens": 4, "temperature": 0})
    server.send({"type": "generate", "id": "first-user", "messages": [{"role": "user", "content": text}],
                 "images": [WIDE[3]], "max_tokens": 4, "temperature": 0})
    server.send({"type": "generate", "id": "explicit", "prompt": PROMPT.format("<image>").replace("Describe this.", text),
                 "images": [WIDE[3]], "max_tokens": 4, "temperature": 0})
    done = {rid: server.until_terminal(rid) for rid in ("parts", "first-user", "explicit")}
    assert all(d["type"] == "done" and d["usage"]["image_tokens"] == 80 for d in done.values()), done
    # No image part: the image goes before the text of the first user message, as in the explicit prompt.
    assert done["first-user"]["usage"]["prompt_tokens"] == done["explicit"]["usage"]["prompt_tokens"]
    assert done["parts"]["usage"]["prompt_tokens"] > done["first-user"]["usage"]["prompt_tokens"]
    server.send({"type": "info"})
    info = server.until_terminal("info")
    assert info["vision"] is True
    assert set(info["encoder_cache"]) == {"hits", "misses", "entries"} and info["encoder_cache"]["hits"] >= 2


def test_cli_generate_with_images_through_connect(server, tmp_path):
    import json
    import subprocess
    import sys

    paths = []
    for i, data in enumerate((WIDE[4], WIDE[5])):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        (tmp_path / f"{i}.png").write_bytes(data)
    cmd = [sys.executable, "-m", "frontend.cli.main", "generate", "What is this?", "--connect", server.server.endpoint,
           *paths, "--max-tokens", "3", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None:  # the server loop runs on this thread
        assert time.monotonic() < deadline
        server.server._read_clients()
        server.svc.poll(0.01)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["usage"]["image_tokens"] == 2 * 80 and len(result["token_ids"]) == 3


# ---- the encoder cache's bookkeeping (pure Python) ------------------------------------------------

def test_encoder_cache_bounds_unreferenced_entries_lru_and_never_evicts_referenced():
    from gpu_worker.encoder_cache import EncoderCache

    cache = EncoderCache(capacity_bytes=300)
    a, hit = cache.acquire("a", 100, 2)
    assert not hit
    a.enqueued[:] = True
    b, _ = cache.acquire("b", 100, 2)
    b.enqueued[1] = True  # partly encoded: kept, a later request encodes the rest
    c, _ = cache.acquire("c", 150, 3)  # 350 bytes, all referenced: over the bound, nothing evicted
    c.enqueued[:] = True
    assert set(cache.entries) == {"a", "b", "c"}
    cache.release(a)  # unreferenced and over the bound: evicted at once
    assert set(cache.entries) == {"b", "c"} and not a.cached
    cache.release(b)
    cache.release(c)  # 250 bytes: both stay, b least recently used
    again, hit = cache.acquire("b", 100, 2)
    assert hit and again is b and again.missing(0, 2).tolist() == [0] and not again.complete()
    cache.release(b)  # b is now the most recent
    d, _ = cache.acquire("d", 100, 2)  # 350: the least recently used unreferenced entry (c) goes
    assert set(cache.entries) == {"b", "d"}
    cache.release(d)  # never enqueued (its request ended before its prefill): dropped at once
    assert set(cache.entries) == {"b"} and cache.bytes == 100
    assert (cache.hits, cache.misses, cache.referenced) == (1, 4, 0)


def test_prefix_cache_tells_images_apart(svc):
    """All <image> placeholders share one token id, so prefix-cache page names hash the images in:
    the same text with another image hits only the pages before the image; the same image hits on."""
    text = "<|im_start|>User:" + " Here is a photograph taken on a long summer walk by the sea." * 4 + \
        "<image>What is in it?<end_of_utterance>\nAssistant:"
    first_image_token = len(svc.tokenizer.encode(text.split("<image>")[0], add_special_tokens=False)) + 2
    log = Log()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    x, y = png(990, 61, 4242), png(990, 61, 4343)

    def run(image):
        req = submit(svc, log, [image], greedy, text)
        svc.run_until(lambda: req.seq_id in log.terminal, 60)
        return log.terminal[req.seq_id][1]

    a = run(x)
    other = run(y)
    again = run(x)
    page = svc.config.page_size
    assert other["usage"]["cached_tokens"] <= first_image_token // page * page  # no page holding image tokens
    assert again["usage"]["cached_tokens"] > first_image_token + 80  # the image's pages hit
    assert again["token_ids"] == a["token_ids"]
    assert other["token_ids"] != a["token_ids"]  # non-vacuity: the image decides the answer
    assert_idle(svc)


@pytest.mark.slow
def test_a_long_prefill_launch_is_a_wait_not_a_hang():
    """A launch longer than the heartbeat timeout (an image prefill on a slow device, here a
    simulated 2.5 s step against a 1 s timeout) keeps the worker alive: it is waiting, not hung."""
    svc = make_service(device="sim:2500", worker_stale_s=1.0)
    try:
        log = Log()
        req = submit(svc, log, [WIDE[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        svc.run_until(lambda: req.seq_id in log.terminal, 60)
        assert log.terminal[req.seq_id][0] == "done", log.terminal[req.seq_id]
        assert svc.generation == 1
    finally:
        svc.close()


# ---- the image pool: child processes at nice 19 ------------------------------------------------------

def large_png(seed: int) -> bytes:
    """2048 x 1536 noise: tens of milliseconds of decoding and resizing, so a pool child stays busy with it."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (1536, 2048, 3), dtype=np.uint8)).save(
        buf, "PNG", compress_level=1)
    return buf.getvalue()


def test_a_bad_image_in_the_pool_fails_only_its_own_request(svc):
    """Truncated images between good ones, all in the pool at once: each fails its own request with a
    bad_request naming the image; the requests prepared beside them (same children) finish."""
    log = Log()
    truncated = WIDE[3][:300]
    reqs = [submit(svc, log, [WIDE[1], truncated] if i % 3 == 0 else [WIDE[i % 6]], SamplingParams(max_tokens=2))
            for i in range(9)]
    svc.run_until(lambda: all(r.seq_id in log.terminal for r in reqs), 60)
    for i, r in enumerate(reqs):
        kind, payload = log.terminal[r.seq_id]
        if i % 3 == 0:
            assert kind == "error" and payload["code"] == "bad_request", payload
            assert re.search(r"images\[1\]: image data is truncated or corrupt", payload["message"]), payload
        else:
            assert kind == "done" and payload["usage"]["image_tokens"] == 5 * 16, payload
    assert_idle(svc)


def test_a_renderer_that_raises_fails_its_request_not_the_loop(svc):
    """``render`` runs on the loop thread after the pool: an unexpected exception
    there is an ``internal`` error for that request, and the next request is served."""
    log = Log()

    def broken(prepared):
        raise RuntimeError("renderer bug")

    bad = svc.submit_images([WIDE[2]], broken, SamplingParams(max_tokens=2), on_event=log)
    good = submit(svc, log, [WIDE[2]], SamplingParams(max_tokens=2))
    svc.run_until(lambda: bad.seq_id in log.terminal and good.seq_id in log.terminal, 60)
    assert log.terminal[bad.seq_id] == ("error", {"code": "internal", "message": "RuntimeError: renderer bug"})
    assert log.terminal[good.seq_id][0] == "done"
    assert_idle(svc)


def test_cancel_while_queued_in_the_pool_frees_everything():
    svc = make_service(image_workers=1)
    manager = multiprocessing.get_context("spawn").Manager()
    try:
        log = Log()
        image = large_png(1)
        gate = manager.Event()  # the one child held until the cancels are in: the pool's speed decides nothing
        svc.images.pool._executor.submit(gate.wait)
        reqs = [submit(svc, log, [image], SamplingParams(max_tokens=2)) for _ in range(6)]
        for r in reqs[1:]:  # one child: the first is handed to it, the last ones wait in the pool
            svc.cancel(r)
        gate.set()
        assert reqs[-1].images.preparation.cancelled()  # non-vacuity: a cancel took work out of the pool
        assert all(log.terminal[r.seq_id][1]["finish_reason"] == "cancelled" for r in reqs[1:])
        svc.run_until(lambda: reqs[0].seq_id in log.terminal, 60)
        assert log.terminal[reqs[0].seq_id][0] == "done"
        # Those already handed to the child finish there; their results are dropped on arrival.
        svc.run_until(lambda: not any(r.images.preparing for r in reqs), 60)
        assert not svc.images._prepared and not any(r.images.preparation for r in reqs)
        assert_idle(svc)
    finally:
        svc.close()
        manager.shutdown()


@pytest.mark.slow
def test_a_killed_pool_process_fails_its_request_and_the_next_request_gets_a_new_pool():
    before = set(multiprocessing.active_children())
    svc = make_service(image_workers=1)
    try:
        log = Log()
        (child,) = set(multiprocessing.active_children()) - before
        doomed = submit(svc, log, [large_png(2)] * 4, SamplingParams(max_tokens=2))
        os.kill(child.pid, signal.SIGKILL)
        svc.run_until(lambda: doomed.seq_id in log.terminal, 60)
        kind, payload = log.terminal[doomed.seq_id]
        assert kind == "error" and payload["code"] == "internal", payload
        assert "process preparing the images died" in payload["message"]
        after = submit(svc, log, [WIDE[0]], SamplingParams(max_tokens=2))
        svc.run_until(lambda: after.seq_id in log.terminal, 60)
        assert log.terminal[after.seq_id][0] == "done", log.terminal[after.seq_id]
        assert_idle(svc)
    finally:
        svc.close()
    assert set(multiprocessing.active_children()) == {c for c in before if c.is_alive()}  # none of its own left


def test_pool_children_run_at_nice_19_and_close_leaves_no_process_or_thread(svc):
    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("the tests run at nice 19 already: the children's priority would prove nothing")
    threads_before = set(threading.enumerate())
    children_before = set(multiprocessing.active_children())
    pool = ImagePool(svc.image_params, workers=2)
    outcomes: list = []
    try:
        children = set(multiprocessing.active_children()) - children_before
        assert len(children) == 2  # started with the pool, not with the first image
        deadline = time.monotonic() + 30
        while not all(os.getpriority(os.PRIO_PROCESS, c.pid) == 19 for c in children):
            assert time.monotonic() < deadline, "the pool's children never lowered their priority"
            time.sleep(0.01)
        image = large_png(3)
        for _ in range(6):
            pool.submit([image], outcomes.append)
        assert len(outcomes) < 6  # close() comes while the pool works
    finally:
        pool.close()
    # Each submit was answered exactly once: prepared, or cancelled before it started.
    assert len(outcomes) == 6 and all(isinstance(o, (list, CancelledError)) for o in outcomes), outcomes
    assert not any(c.is_alive() for c in children)
    assert set(multiprocessing.active_children()) == {c for c in children_before if c.is_alive()}
    assert [t for t in threading.enumerate() if t not in threads_before] == []


@pytest.mark.slow
def test_close_while_images_are_prepared_ends_each_request_once_and_leaves_no_process():
    children_before = set(multiprocessing.active_children())
    svc = make_service(image_workers=2)
    log = Log()
    try:
        image = large_png(4)
        reqs = [submit(svc, log, [image], SamplingParams(max_tokens=2)) for _ in range(4)]
        assert any(r.images.preparing for r in reqs)
    finally:
        svc.close()
    assert all(log.terminal[r.seq_id][0] == "error" and "shutting down" in log.terminal[r.seq_id][1]["message"]
               for r in reqs)
    assert set(multiprocessing.active_children()) == {c for c in children_before if c.is_alive()}


POOL_THEN_SLEEP = """
import multiprocessing, sys, time
from frontend.images.pool import ImagePool
from shared.models.info import ModelInfo
from shared.vision_config import ImageProcessorParams
if __name__ == "__main__":
    pool = ImagePool(ImageProcessorParams.from_model_dir(ModelInfo.load("tiny-random-vlm").path), workers=2)
    pool.submit([], lambda result: None).result()  # the children are up
    print(*[c.pid for c in multiprocessing.active_children()], flush=True)
    time.sleep(120)
"""


def process_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_pool_children_exit_when_the_frontend_is_killed(tmp_path):
    script = tmp_path / "pool_then_sleep.py"
    script.write_text(POOL_THEN_SLEEP)
    root = str(Path(__file__).resolve().parents[2])
    frontend = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                                env={**os.environ, "PYTHONPATH": root})
    try:
        children = [int(pid) for pid in frontend.stdout.readline().split()]
        assert len(children) == 2 and all(process_running(pid) for pid in children)  # non-vacuity
    finally:
        frontend.kill()
        frontend.wait()
    deadline = time.monotonic() + 30
    while any(process_running(pid) for pid in children):
        assert time.monotonic() < deadline, "a pool child outlived its killed frontend"
        time.sleep(0.05)

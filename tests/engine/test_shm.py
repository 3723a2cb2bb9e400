"""Tests of shared/shm/: the arena, token ring, ack ring and mask rows.

Cross-process tests attach a child (``sys.executable -c``) to the parent's
arena by fd via ``pass_fds``, exactly as the worker is spawned.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shared import shm
from shared.finish import FinishReason
from shared.shm import (
    AckRingFull,
    Arena,
    Kind,
    Layout,
    LayoutMismatch,
    MaskNotReady,
    RingAborted,
    RingCorrupt,
    RingTimeout,
    Side,
    TokenFlag,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = Layout(vocab_size=1000, ring_entries=8, max_rows=40, max_batch_rows=16, ack_entries=8)


def expected(step: int, max_rows: int):
    """Deterministic content of the entry for ``step`` (shared with the child)."""
    import numpy as np
    n = 1 + (step * 5) % max_rows
    r = np.arange(n, dtype=np.int64)
    seq = (0xFFFFFF00 + step * 3 + r) & 0xFFFFFFFF          # exercises the top bit
    tok = (step * 7919 + r * 31) % 50000 - (step % 2)       # includes -1
    flags = (r + step) % 32
    lp = None if step % 4 == 0 else (-(r + step) / 7).astype(np.float32)
    kind = 0 if step % 3 == 0 else 1
    return kind, seq, tok, flags, lp


CHILD_PRELUDE = "import json, sys, time\nimport numpy as np\nfrom shared.shm import *\n" + \
    inspect.getsource(expected)


def spawn(arena: Arena, body: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO)
    code = CHILD_PRELUDE + "arena = Arena.attach_spec(sys.argv[1])\n" + body
    return subprocess.Popen([sys.executable, "-c", code, arena.fd_spec(), *args],
                            pass_fds=arena.pass_fds, env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 30) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def check_entry(e, step, max_rows):
    kind, seq, tok, flags, lp = expected(step, max_rows)
    assert e.step == step and e.kind == kind
    assert e.seq_ids.dtype == np.uint32 and np.array_equal(e.seq_ids, seq)
    assert e.token_ids.dtype == np.int32 and np.array_equal(e.token_ids, tok)
    assert np.array_equal(e.flags, flags)
    if lp is None:
        assert e.logprobs is None
    else:
        assert np.array_equal(e.logprobs, lp)


@pytest.fixture
def arena():
    a = Arena.create(SMALL, generation=3)
    yield a
    a.close()


def publish_expected(w, step, max_rows=SMALL.max_rows):
    kind, seq, tok, flags, lp = expected(step, max_rows)
    return w.publish(step, kind, seq, tok, flags, lp, timeout=5)


# ------------------------------------------------------------------ layout
def test_layout_regions_are_cache_line_aligned():
    for lay in (SMALL, Layout(vocab_size=151_936), Layout(vocab_size=33, max_rows=3, ring_entries=3)):
        for name, (off, shape, dt) in lay.regions().items():
            assert off % 64 == 0, name
            if len(shape) == 2 and name != "ack_events":  # events are 16-byte records
                assert (shape[1] * dt.itemsize) % 64 == 0, name  # every row too
        assert lay.total_bytes % 4096 == 0
    assert Layout(vocab_size=33).mask_words == 2


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="ring_entries"):
        Layout(vocab_size=10, ring_entries=1)
    with pytest.raises(ValueError, match="vocab_size"):
        Layout(vocab_size=0)


# ------------------------------------------------------------- token ring
def test_publish_poll_roundtrip_and_64bit_step(arena):
    w, r = arena.token_writer(), arena.token_reader()
    assert r.poll() is None
    big = (1 << 40) + 12345
    pos = w.publish(big, Kind.DECODE, np.array([1, 2]), np.array([5, 6]),
                    np.array([TokenFlag.NONE, FinishReason.LENGTH | TokenFlag.ZOMBIE]))
    e = r.poll()
    assert e.position == pos == 0 and e.step == big and e.kind == Kind.DECODE
    assert e.token_ids.tolist() == [5, 6] and e.logprobs is None
    assert int(e.flags[1]) & TokenFlag.FINISH_MASK == FinishReason.LENGTH and int(e.flags[1]) & TokenFlag.ZOMBIE
    assert r.poll() is None  # nothing more
    for step in range(1, 30):  # wraps the 8-entry ring several times
        publish_expected(w, step)
        e = r.poll()
        check_entry(e, step, SMALL.max_rows)
        r.consume(e.position)
    w.publish(0, Kind.PREFILL, np.array([], np.uint32), np.array([], np.int32), np.array([], np.uint32))
    assert r.poll().seq_ids.size == 0  # empty entries are fine


def test_entries_carry_region_values_beside_their_tokens(arena):
    """Moondream rows: (coordinate, width, height) float32 per row, bit-exact, with or without
    logprobs; an entry without them reads as None; a wrong shape is refused before any entry is used."""
    w, r = arena.token_writer(), arena.token_reader()
    values = np.array([[0.5, 0.25, 1e-3], [np.float32(0.1), 0.0, 2.0 ** -10]], np.float32)
    p = w.reserve()
    p.token_ids[:2] = [5, 6]
    w.stamp(p, 1, Kind.DECODE, [3, 4], [0, 0], None, None, values)
    e = r.poll()
    assert e.token_ids.tolist() == [5, 6] and e.logprobs is None
    assert e.values.dtype == np.float32 and np.array_equal(e.values.view(np.uint32), values.view(np.uint32))
    w.publish(2, Kind.DECODE, [3], [7], [0], np.array([-0.5]))
    e = r.poll()
    assert e.values is None and e.logprobs.tolist() == [-0.5]
    p = w.reserve()
    with pytest.raises(ValueError, match="values must have shape"):
        w.stamp(p, 3, Kind.DECODE, [3], [0], None, [9], np.zeros((1, 2), np.float32))
    w.stamp(p, 3, Kind.DECODE, [3], [0], np.array([-1.0]), [9], values[:1])
    e = r.poll()
    assert e.logprobs.tolist() == [-1.0] and np.array_equal(e.values, values[:1])


def test_reserve_stamp_device_path(arena):
    """The staging view is where a device copy lands; stamp writes the tags."""
    w, r = arena.token_writer(), arena.token_reader()
    p1 = w.reserve()
    p2 = w.reserve()   # pipelined: two in flight
    p1.token_ids[:3] = [7, 8, 9]          # stands in for tensor.copy_(non_blocking=True)
    p2.token_ids[:2] = [1, 2]
    with pytest.raises(ValueError, match="out of order"):
        w.stamp(p2, 11, Kind.DECODE, [0, 1], [0, 0], [0.0, 0.0])
    assert r.poll() is None  # reserved is not published
    w.stamp(p1, 10, Kind.DECODE, [4, 5, 6], [0, 0, 0])
    w.stamp(p2, 11, Kind.DECODE, [0, 1], [0, 0], np.array([-1.5, -2.5]))
    e1, e2 = r.poll(), r.poll()
    assert e1.token_ids.tolist() == [7, 8, 9] and e1.seq_ids.tolist() == [4, 5, 6]
    assert e2.step == 11 and e2.logprobs.tolist() == [-1.5, -2.5]


def test_publish_validates_inputs(arena):
    w = arena.token_writer()
    with pytest.raises(ValueError, match="nrows"):
        w.publish(0, Kind.DECODE, np.arange(41), np.arange(41), np.zeros(41, int))
    with pytest.raises(ValueError, match="seq_ids"):
        w.publish(0, Kind.DECODE, [-1], [1], [0])
    with pytest.raises(ValueError, match="flags"):
        w.publish(0, Kind.DECODE, [1, 2], [1, 2], [0])
    with pytest.raises(ValueError, match="token_ids"):
        w.publish(0, Kind.DECODE, [1], [1 << 31], [0])
    with pytest.raises(ValueError):
        w.publish(0, 7, [1], [1], [0])


def test_full_ring_blocks_times_out_and_aborts(arena):
    w, r = arena.token_writer(), arena.token_reader()
    for s in range(SMALL.ring_entries):
        assert w.try_publish(s, Kind.DECODE, [1], [1], [0]) == s
    assert not w.has_space()
    assert w.try_publish(99, Kind.DECODE, [1], [1], [0]) is None
    t = time.monotonic()
    with pytest.raises(RingTimeout):
        w.publish(99, Kind.DECODE, [1], [1], [0], timeout=0.1)
    assert 0.09 < time.monotonic() - t < 2
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(RingAborted):
        w.publish(99, Kind.DECODE, [1], [1], [0], abort=stop)
    # a consume from another thread wakes the blocked writer through the eventfd
    threading.Timer(0.1, lambda: (r.poll(), r.consume(0))).start()
    t = time.monotonic()
    assert w.publish(8, Kind.DECODE, [1], [1], [0], timeout=5) == 8
    assert time.monotonic() - t < 2 and w.blocked == 3
    with pytest.raises(ValueError):
        r.consume(5)  # cannot consume what was not polled


def test_wraparound_with_slow_reader_in_another_process(arena):
    """>= 10x capacity steps: no loss, no corruption, in order, and the writer
    really was held back while the ring was full."""
    n_steps = 12 * SMALL.ring_entries
    proc = spawn(arena, """
w = arena.token_writer()
for step in range(int(sys.argv[2])):
    kind, seq, tok, flags, lp = expected(step, arena.layout.max_rows)
    w.publish(step, kind, seq, tok, flags, lp, timeout=20)
print(json.dumps({"blocked": w.blocked, "sleeps": w.sleeps}))
""", str(n_steps))
    r = arena.token_reader()
    meta = arena.region("ring_meta")
    try:
        step = 0
        while step < n_steps:
            assert r.wait(timeout=10), f"no entry {step} within 10 s"
            e = r.poll()
            if e is None:
                continue
            assert e.position == step
            check_entry(e, step, SMALL.max_rows)
            time.sleep(0.002)  # slow reader: the ring fills up
            # the writer must not have reused the entry while we held it
            assert int(meta[e.position % SMALL.ring_entries, 2]) >> 32 == (e.position + 1)
            r.consume(e.position)
            step += 1
        stats = finish(proc)
    finally:
        proc.kill()
    assert r.poll() is None
    assert stats["blocked"] >= n_steps // 2, stats   # it waited for space ...
    assert stats["sleeps"] >= 1, stats                # ... and slept on the eventfd


def test_reader_sleeping_is_woken_by_publish_from_other_process(arena):
    proc = spawn(arena, """
time.sleep(0.4)
arena.token_writer().publish(42, Kind.DECODE, [1], [2], [0])
time.sleep(0.3)
rows = np.array([1, 5])
arena.mask_writer().write_rows(rows, 9, np.full((2, arena.layout.mask_words), -1, np.int32))
print(json.dumps({}))
""")
    try:
        r, m = arena.token_reader(), arena.mask_reader()
        t = time.monotonic()
        assert r.wait(timeout=20)
        woke = time.monotonic() - t
        assert 0.2 < woke < 10 and r.sleeps >= 1
        assert r.poll().step == 42
        assert m.wait_rows([1, 5], 9, timeout=20) and m.sleeps >= 1
        assert (m.read_rows([1, 5], 9) == -1).all()
        finish(proc)
    finally:
        proc.kill()


def test_tokens_eventfd_works_in_zmq_poller(arena):
    zmq = pytest.importorskip("zmq")
    w, r = arena.token_writer(), arena.token_reader()
    poller = zmq.Poller()
    poller.register(r.fileno(), zmq.POLLIN)
    assert poller.poll(10) == []
    w.publish(1, Kind.DECODE, [1], [1], [0])
    assert poller.poll(1000) == [(r.fileno(), zmq.POLLIN)]
    r.clear_wakeup()
    assert poller.poll(10) == []
    assert r.poll().step == 1


# --------------------------------------------------- tag validation / corruption
def entry_words(arena, entry):
    rows = arena.region("ring_rows")[entry]
    return [arena.region("ring_meta")[entry], rows[0], rows[1], rows[2], rows[3]]


def test_torn_row_is_not_ready_then_corrupt(arena):
    w, r = arena.token_writer(), arena.token_reader(corrupt_after_s=0.05)
    publish_expected(w, 1)
    meta, seq, *_ = entry_words(arena, 0)
    good = int(seq[0])
    seq[0] = (7 << 32) | (good & 0xFFFFFFFF)  # wrong tag on one row word
    assert r.poll() is None                     # not yet visible ...
    time.sleep(0.08)
    with pytest.raises(RingCorrupt, match="wrong tag"):
        r.poll()                                # ... and corrupt once it persists
    seq[0] = good                               # non-vacuity: restored -> accepted
    check_entry(r.poll(), 1, SMALL.max_rows)


def test_bad_commit_words_raise_or_wait(arena):
    w, r = arena.token_writer(), arena.token_reader()
    meta = arena.region("ring_meta")
    meta[0, 2] = (0xDEAD << 32) | 1            # tag of no occupant -> corrupt
    with pytest.raises(RingCorrupt, match="commit tag"):
        r.poll()
    meta[0, 2] = 0                              # never-written entry -> not ready
    assert r.poll() is None
    meta[0, 2] = (1 << 32) | SMALL.max_rows + 1  # too many rows -> corrupt
    with pytest.raises(RingCorrupt, match="invalid commit"):
        r.poll()
    meta[0, 2] = 0
    publish_expected(w, 0)
    check_entry(r.poll(), 0, SMALL.max_rows)


def test_mixed_old_and_new_words_are_never_accepted(arena):
    """Simulate ARM-style reordering: any mix of the previous occupant's words
    and the new entry's words is rejected; only the complete entry is returned."""
    rng = np.random.default_rng(0)
    cap = SMALL.ring_entries
    w, r = arena.token_writer(), arena.token_reader(corrupt_after_s=3600)
    for step in range(6 * cap):
        entry = step % cap
        before = [a.copy() for a in entry_words(arena, entry)]
        publish_expected(w, step)
        after = [a.copy() for a in entry_words(arena, entry)]
        n = 1 + (step * 5) % SMALL.max_rows
        # revert a random non-empty subset of the words the reader checks
        cells = [(0, i) for i in range(3)] + [(c, i) for c in range(1, 5) for i in range(n)]
        if expected(step, SMALL.max_rows)[4] is None:
            cells = [x for x in cells if x[0] != 4]
        pick = rng.choice(len(cells), size=int(rng.integers(1, min(5, len(cells)) + 1)), replace=False)
        live = entry_words(arena, entry)
        for k in pick:
            c, i = cells[k]
            live[c][i] = before[c][i]
        try:
            got = r.poll()
        except RingCorrupt:
            got = None
        assert got is None, f"step {step}: accepted an entry with stale words"
        for c in range(5):  # the late stores land
            live[c][:] = after[c]
        e = r.poll()
        check_entry(e, step, SMALL.max_rows)
        r.consume(e.position)


# ---------------------------------------------------------- header validation
def test_attach_validates_header(arena):
    a2 = Arena.attach(arena.fd, expect=SMALL, expect_generation=3)
    assert a2.layout == SMALL and a2.generation == 3
    with pytest.raises(LayoutMismatch, match="max_rows=40 \\(expected 41\\)"):
        Arena.attach(arena.fd, expect=Layout(vocab_size=1000, ring_entries=8, max_rows=41,
                                             max_batch_rows=16, ack_entries=8))
    with pytest.raises(LayoutMismatch, match="generation 3, expected 4"):
        Arena.attach(arena.fd, expect_generation=4)
    h = np.frombuffer(arena.buffer, np.uint64, 64, 0)
    h[1] = 99
    with pytest.raises(LayoutMismatch, match="version 99"):
        Arena.attach(arena.fd)
    h[1] = shm.LAYOUT_VERSION
    h[5] = 0  # max_rows 0
    with pytest.raises(LayoutMismatch, match="invalid layout"):
        Arena.attach(arena.fd)
    h[5] = 80  # valid but not the layout the file was sized for
    with pytest.raises(LayoutMismatch, match="does not match"):
        Arena.attach(arena.fd)
    h[5] = SMALL.max_rows
    Arena.attach(arena.fd)
    del h


def test_attach_rejects_non_arenas():
    fd = os.memfd_create("not-an-arena")
    try:
        os.ftruncate(fd, 100)
        with pytest.raises(LayoutMismatch, match="smaller than the header"):
            Arena.attach(fd)
        os.ftruncate(fd, 8192)
        with pytest.raises(LayoutMismatch, match="bad magic"):
            Arena.attach(fd)
    finally:
        os.close(fd)
    with pytest.raises(LayoutMismatch, match="not usable"):
        Arena.attach(987654)
    with pytest.raises(LayoutMismatch, match="spec"):
        Arena.attach_spec("3,x")


def test_pass_fds_and_heartbeats(arena):
    assert arena.pass_fds == (arena.fd, *arena.wake) and len(set(arena.pass_fds)) == 4
    peer = Arena.attach_spec(arena.fd_spec())
    assert not peer.is_alive(Side.WORKER, 10)
    peer.beat(Side.WORKER)
    assert arena.is_alive(Side.WORKER, 1.0) and not arena.is_alive(Side.FRONTEND, 1.0)
    stop = arena.start_heartbeat(Side.FRONTEND, 0.01)
    time.sleep(0.05)
    first = peer.last_beat_ns(Side.FRONTEND)
    time.sleep(0.05)
    assert peer.last_beat_ns(Side.FRONTEND) > first and peer.is_alive(Side.FRONTEND, 1.0)
    stop.set()
    time.sleep(0.03)
    assert not peer.is_alive(Side.FRONTEND, 0.0)


def test_close_stops_and_joins_the_heartbeat(monkeypatch):
    """Closing the arena while its heartbeat still runs (nobody set the event):
    the thread is joined first, so no beat lands on the dropped header."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    a = Arena.create(SMALL)
    a.start_heartbeat(Side.FRONTEND, 0.001)
    time.sleep(0.01)
    a.close()
    time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "heartbeat-frontend"]
    assert errors == []


# ------------------------------------------------------------------ mask rows
def test_mask_rows_exact_stamp_only(arena):
    mw, mr = arena.mask_writer(), arena.mask_reader(corrupt_after_s=0.05)
    words = arena.layout.mask_words
    rows = np.array([3, 0, 15])
    rng = np.random.default_rng(1)
    m5 = rng.integers(-2**31, 2**31, size=(3, words)).astype(np.int32)
    assert not mr.wait_rows(rows, 5, timeout=0.02)       # never written
    with pytest.raises(MaskNotReady):
        mr.read_rows(rows, 5)
    mw.write_rows(rows, 5, m5)
    assert mr.wait_rows(rows, 5, timeout=0)
    assert np.array_equal(mr.read_rows(rows, 5), m5)
    assert mr.read_rows(rows, 5).dtype == np.int32
    assert mr.stamped_each(rows, [5, 6, 5]).tolist() == [True, False, True]  # each row its own stamp
    assert not mr.wait_rows(rows, 6, timeout=0.02)       # stale stamp: never accepted
    assert not mr.wait_rows(rows, 4, timeout=0.02)       # newer than asked: not accepted
    with pytest.raises(MaskNotReady, match="stamped 6"):
        mr.read_rows(rows, 6)
    mw.write_rows(rows[:2], 6, m5[:2] ^ 1)               # only two rows advance
    assert not mr.wait_rows(rows, 6, timeout=0.02)
    assert mr.wait_rows(rows[:2], 6, timeout=0)
    assert np.array_equal(mr.read_rows(rows), np.vstack([m5[:2] ^ 1, m5[2:]]))  # own stamps


def test_mask_stamp_without_words_is_rejected(arena):
    """The stamp visible before the words (ARM reordering) never yields stale bits."""
    mw, mr = arena.mask_writer(), arena.mask_reader(corrupt_after_s=0.05)
    w = arena.layout.mask_words
    mw.write_rows([2], 1, np.zeros((1, w), np.int32))
    arena.region("mask_stamp")[2] = 2 + 1            # stamp for step 2, words still step 1
    assert mr.wait_rows([2], 2, timeout=0)
    with pytest.raises(RingCorrupt):
        mr.read_rows([2], 2)
    mw.write_rows([2], 2, np.ones((1, w), np.int32))  # non-vacuity: real write accepted
    assert (mr.read_rows([2], 2) == 1).all()


def test_mask_writer_validates(arena):
    mw = arena.mask_writer()
    with pytest.raises(ValueError):
        mw.write_rows([16], 1, np.zeros((1, mw.words_per_row), np.int32))
    with pytest.raises(ValueError):
        mw.write_rows([1], 1, np.zeros((1, mw.words_per_row + 1), np.int32))


# ------------------------------------------------------------------- ack ring
def test_ack_events_roundtrip_and_wrap(arena):
    aw, ar = arena.ack_writer(), arena.ack_reader()
    assert ar.poll() == []
    sent = []
    for i in range(50):  # > 6x the 8-event ring
        if i % 3 == 0:
            aw.push(i, FinishReason.CANCELLED)
            sent.append((i, FinishReason.CANCELLED))
        else:
            aw.push(0xFFFFFFFF - i, FinishReason.STOP if i % 2 else FinishReason.ERROR)
            sent.append((0xFFFFFFFF - i, FinishReason.STOP if i % 2 else FinishReason.ERROR))
        if i % 5 == 4:
            assert [tuple(e) for e in ar.poll()] == sent
            sent = []
    assert [tuple(e) for e in ar.poll()] == sent


def test_ack_ring_full_raises(arena):
    aw, ar = arena.ack_writer(), arena.ack_reader()
    for i in range(8):
        aw.push(i, FinishReason.CANCELLED)
    with pytest.raises(AckRingFull):
        aw.push(8, FinishReason.CANCELLED, timeout=0.01)
    with pytest.raises(ValueError):
        aw.try_push(9, FinishReason.NONE)  # not an end
    assert aw.pending() == 8
    assert [e.seq_id for e in ar.poll()] == list(range(8))
    aw.push(8, FinishReason.CANCELLED)
    assert ar.poll()[0].seq_id == 8


def test_ack_torn_and_corrupt_events(arena):
    aw, ar = arena.ack_writer(), arena.ack_reader(corrupt_after_s=0.05)
    ev = arena.region("ack_events")
    aw.push(1, FinishReason.STOP)
    aw.push(2, FinishReason.CANCELLED)
    ev[1, 0] = (9 << 32) | 2              # second event's body has a wrong tag
    assert [e.seq_id for e in ar.poll()] == [1]   # prefix only
    assert ar.poll() == []
    time.sleep(0.08)
    with pytest.raises(RingCorrupt):
        ar.poll()
    ev[1, 0] = (2 << 32) | 2
    assert [e.seq_id for e in ar.poll()] == [2]
    ev[2, 1] = (0xBEEF << 32)              # commit tag of no occupant
    with pytest.raises(RingCorrupt, match="commit tag"):
        ar.poll()


def test_tile_blocks_hold_each_image_until_released_and_the_reader_sees_the_same_tiles():
    layout = Layout(vocab_size=1000, ring_entries=8, max_rows=4, max_batch_rows=4, ack_entries=8,
                    tile_blocks=5, block_tiles=2, tile_size=4)
    arena = Arena.create(layout)
    try:
        writer, reader = arena.image_writer(), arena.image_reader()
        rng = np.random.default_rng(0)
        first, second = (rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8) for n in (3, 5))
        assert writer.blocks_needed([3, 5]) == 2 + 3
        a, b = writer.write(first), writer.write(second)
        assert len(a) == 2 and len(b) == 3 and not set(a) & set(b) and writer.num_free == 0
        assert writer.write(first[:1]) is None  # every block is held: the next image waits
        for blocks, tiles in ((a, first), (b, second)):
            views = reader.blocks(blocks, len(tiles))
            assert np.array_equal(np.concatenate(views), tiles)  # tiles in order, none lost at a block's end
        with pytest.raises(ValueError, match="tile blocks"):
            reader.blocks([a[0], a[0]], 3)  # a block named twice
        with pytest.raises(ValueError, match="tile blocks"):
            reader.blocks(a, 5)  # more tiles than the blocks hold
        writer.release(a)
        assert writer.num_free == 2 and sorted(writer.write(first)) == sorted(a)
    finally:
        arena.close()

"""The two-process service: frontend + GPU worker over shared memory."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from workload import BannedByLastToken, BannedMatcher, workload

from frontend.server.service import Service, ServiceConfig
from frontend.server.worker_handle import WorkerDown
from gpu_worker.engine import Engine, EngineConfig
from shared.control import ControlChannel
from shared.finish import FinishReason
from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

SIZES = dict(max_batch=32, prefill_budget=96, kv_pages=1200, page_size=8)


def make_service(on_progress=None, **kw) -> Service:
    return Service(ServiceConfig(**{"model": "tiny-random", "device": "cpu", **SIZES, **kw}), on_progress=on_progress)


def submit_all(svc, reqs, stops, stream_log=None):
    out = []
    for i, r in enumerate(reqs):
        kw = dict(r["params"])
        if i in stops:
            kw["stop_token_ids"] = [stops[i]]
        on_event = None
        if stream_log is not None:
            on_event = lambda req, kind, p: stream_log.append((req.seq_id, kind, p))  # noqa: E731
        out.append(svc.submit(r["prompt"], SamplingParams(**kw), on_event=on_event,
                              constraint=BannedMatcher() if r["constrained"] else None))
    return out


@pytest.fixture(scope="module")
def reference():
    """In-process engine outputs for the mixed workload (with stops at varied positions)."""
    reqs = workload(seed=3, n=48)
    eng = Engine(EngineConfig(model="tiny-random", device="cpu", **SIZES))
    masks = BannedByLastToken()
    base = [eng.submit(r["prompt"], SamplingParams(**r["params"]), constrained=r["constrained"]) for r in reqs]
    eng.run_until_idle(masks)
    rng = random.Random(2)
    stops = {i: s.output_ids[rng.randrange(len(s.output_ids))] for i, s in enumerate(base)
             if i % 3 == 0 and len(s.output_ids) > 1}
    seqs = []
    for i, r in enumerate(reqs):
        kw = dict(r["params"], **({"stop_token_ids": [stops[i]]} if i in stops else {}))
        seqs.append(eng.submit(r["prompt"], SamplingParams(**kw), constrained=r["constrained"]))
    eng.run_until_idle(masks)
    eng.close()
    return reqs, stops, [(s.output_ids, s.finish_reason) for s in seqs]


@pytest.fixture(scope="module")
def service():
    svc = make_service()
    yield svc
    svc.close()


@pytest.mark.parametrize("pipeline", [True, False])
def test_two_processes_equal_in_process(reference, service, pipeline):
    reqs, stops, expected = reference
    svc = service if pipeline else make_service(pipeline=False)
    try:
        log = []
        got = submit_all(svc, reqs, stops, log)
        svc.run_until(svc.idle, 120)
        assert [(r.token_ids, r.finish_reason) for r in got] == expected
        assert sum(reason == FinishReason.STOP for _, reason in expected) >= 5
        # Streaming: chunks in order, exactly one terminal event, concatenation == final text.
        for r in got:
            events = [(k, p) for sid, k, p in log if sid == r.seq_id]
            assert [k for k, _ in events].count("done") == 1 and events[-1][0] == "done"
            assert "".join(p["text"] for k, p in events if k == "chunk") == events[-1][1]["text"]
        stats = svc.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["rows_free"] == stats["rows_total"]
        assert len(svc.free_mask_rows) == SIZES["max_batch"]
    finally:
        if svc is not service:
            svc.close()


def test_non_vacuity_different_tokens_are_noticed(reference, service):
    reqs, stops, expected = reference
    changed = [dict(r, params=dict(r["params"], temperature=1.0, seed=7)) for r in reqs[:6]]
    got = submit_all(service, changed, {})
    service.run_until(service.idle, 60)
    assert [r.token_ids for r in got] != [e[0] for e in expected[:6]]


def test_ring_wraps_many_times_with_a_slow_reader():
    svc = make_service(ring_entries=4)
    try:
        eng = Engine(EngineConfig(model="tiny-random", device="cpu", **SIZES))
        prompts = [[11, 12, 13 + i] for i in range(3)]
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        expected = [s.output_ids for s in eng.generate(prompts, params)]
        eng.close()

        def slow(req, kind, payload):
            time.sleep(0.002)  # a frontend that cannot keep up

        got = [svc.submit(p, params, on_event=slow) for p in prompts]
        svc.run_until(svc.idle, 120)
        assert [r.token_ids for r in got] == expected  # no loss, no corruption, in order
        stats = svc.stats()
        assert stats["steps"] >= 10 * 4  # wrapped >= 10 times
        assert stats["ring_blocked"] > 0  # the worker waited while the ring was full
    finally:
        svc.close()


def test_stop_strings_end_requests_and_are_never_streamed(service):
    tok = service.tokenizer
    prompt = [101, 102, 103]
    base = service.submit(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    service.run_until(lambda: base.ended)
    text = base.text
    assert len(text) > 20
    cases = [
        [text[5:13]],  # spans several tokens
        [text[:3]],  # at the very first token
        [text[10:16], text[12:20]],  # overlapping candidates
        [text[8:12], text[8:30]],  # one a prefix of another
    ]
    for stops in cases:
        log = []
        req = service.submit(prompt, SamplingParams(max_tokens=40, ignore_eos=True), stop=stops,
                             on_event=lambda r, k, p, log=log: log.append((k, p)))
        service.run_until(lambda req=req: req.ended)
        chunks = [p["text"] for k, p in log if k == "chunk"]
        done = log[-1][1]
        assert log[-1][0] == "done" and done["finish_reason"] == "stop"
        assert "".join(chunks) == done["text"]
        first = min(text.find(s) + len(s) for s in stops)
        assert text.startswith(done["text"]) and len(done["text"]) < first
        for s in stops:
            assert s not in done["text"]
            assert not any(s in c for c in chunks)
        assert len(req.token_ids) < len(base.token_ids)  # ended early, not at max_tokens
    service.run_until(service.idle)
    assert tok is not None


def test_cancel_frees_worker_resources(service):
    reqs = [service.submit([7] * 20, SamplingParams(max_tokens=500, ignore_eos=True)) for _ in range(4)]
    service.run_until(lambda: all(len(r.token_ids) >= 3 for r in reqs))
    for r in reqs:
        service.cancel(r)
    assert all(r.finish_reason == FinishReason.CANCELLED for r in reqs)
    service.run_until(service.idle)
    stats = service.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_mask_stall_fails_only_constrained_requests():
    svc = make_service(mask_timeout_s=0.3)
    try:
        class Stalling(BannedMatcher):
            def accept(self, token):
                ok = super().accept(token)
                time.sleep(1.0)  # the frontend stops answering masks for a while
                return ok

        free = svc.submit([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
        stuck = svc.submit([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), constraint=Stalling())
        svc.run_until(lambda: free.ended and stuck.ended, 60)
        assert stuck.error is not None and "mask" in stuck.error[1]
        assert free.finish_reason == FinishReason.LENGTH and len(free.token_ids) == 20
        ok = svc.submit([4, 5], SamplingParams(max_tokens=5), constraint=BannedMatcher())
        svc.run_until(svc.idle, 30)
        assert ok.finish_reason == FinishReason.LENGTH
    finally:
        svc.close()


def test_malformed_control_messages_are_rejected_not_fatal(service):
    service.worker.channel.send_raw(b"\xc1 not msgpack")
    service.worker.channel.send_raw(b"\x81\xa4type\xa6submit")  # truncated / missing fields
    req = service.submit([1, 2, 3], SamplingParams(max_tokens=4))
    service.run_until(lambda: req.ended)
    assert req.finish_reason == FinishReason.LENGTH
    a, b = ControlChannel.pair()
    peer = ControlChannel(b)
    peer.send_raw(b"garbage")
    b_len = (1 << 30).to_bytes(4, "little")
    b.sendall(b_len + b"xx")
    time.sleep(0.05)
    assert a.receive() == [] and a.rejected == 2
    a.close()
    b.close()


def test_sends_to_a_worker_that_died_unnoticed_fail_their_requests_not_the_caller():
    """The worker is dead but the loop has not polled since: submit, cancel and the
    image pool's hand-over send on a broken control channel. The send must not
    raise into its caller (a client handler, the loop's image hand-over); the
    loop's next poll finds the dead worker, fails what was in flight and restarts."""
    svc = make_service()
    try:
        running = svc.submit([9] * 10, SamplingParams(max_tokens=2000, ignore_eos=True))
        svc.run_until(lambda: len(running.token_ids) > 2)
        os.kill(svc.worker_pid, signal.SIGKILL)
        svc.worker.proc.wait()  # dead, its socket closed: a send now fails with EPIPE
        late = svc.submit([1, 2], SamplingParams(max_tokens=3))
        assert late.submitted  # sent, as far as the frontend knows
        svc.cancel(running)
        svc.run_until(lambda: late.ended, 10)
        assert late.error[0] == "worker_failed"
        again = svc.submit([1, 2], SamplingParams(max_tokens=3))
        svc.run_until(lambda: again.ended, 120)
        assert again.finish_reason == FinishReason.LENGTH
    finally:
        svc.close()


def test_cancel_never_overtakes_its_submit():
    """A request cancelled while its Submit still waits in the control outbox (the
    worker is not reading) must never run: the cancel travels behind the Submit."""
    svc = make_service()
    try:
        os.kill(svc.worker_pid, signal.SIGSTOP)  # not reading (briefly: the heartbeat allows 5 s)
        try:
            while svc.worker.channel.unsent_bytes == 0:  # fill the socket: later sends wait in the outbox
                svc.worker.channel.send_raw(b"\xc1" * 65536)  # rejected by the worker, harmless
            req = svc.submit([3, 4], SamplingParams(max_tokens=1900, ignore_eos=True))
            svc.cancel(req)
            assert req.finish_reason == FinishReason.CANCELLED
        finally:
            os.kill(svc.worker_pid, signal.SIGCONT)
        svc.run_until(svc.idle, 30)
        assert svc.stats()["committed_tokens"] == 0  # the cancelled request never ran
    finally:
        svc.close()


def test_control_channel_sends_never_block():
    """Both ends send megabytes at once and neither reads: no send blocks (a blocking
    send on both sides is a deadlock). Then reading and flushing in turn delivers
    every message, in order."""
    from shared.messages import Cancel, Submit

    a, b_sock = ControlChannel.pair()
    b = ControlChannel(b_sock)
    try:
        big = list(range(2000))
        t0 = time.monotonic()
        for i in range(300):  # ~1.2 MB each way, far beyond the socket buffers
            a.send(Submit(seq_id=i, prompt_ids=big))
            b.send(Cancel(seq_id=i))
        assert time.monotonic() - t0 < 10 and a.unsent_bytes > 0  # queued, not blocked
        got_a, got_b = [], []
        deadline = time.monotonic() + 30
        while (len(got_a) < 300 or len(got_b) < 300) and time.monotonic() < deadline:
            got_b += b.receive()
            got_a += a.receive()
            a.flush()
            b.flush()
        assert [m.seq_id for m in got_b] == list(range(300)) and got_b[-1].prompt_ids == big
        assert [m.seq_id for m in got_a] == list(range(300))
        assert a.unsent_bytes == 0 and b.unsent_bytes == 0
    finally:
        a.close()
        b.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_kill_worker_mid_generation_fails_requests_and_restarts():
    progress = []  # the workers' start-up stages, through the control channel
    svc = make_service(on_progress=lambda msg: progress.append(msg.stage))
    try:
        assert len(progress) == 1 and re.fullmatch(r"loading \S*tiny-random\S* on cpu", progress[0]), progress
        old_pid, old_gen = svc.worker_pid, svc.generation
        events = []
        reqs = [svc.submit([9] * 10, SamplingParams(max_tokens=2000, ignore_eos=True),
                           on_event=lambda r, k, p: events.append((r.seq_id, k, p))) for _ in range(3)]
        svc.run_until(lambda: all(len(r.token_ids) > 2 for r in reqs))
        os.kill(old_pid, signal.SIGKILL)
        t0 = time.monotonic()
        svc.run_until(lambda: all(r.ended for r in reqs), 10)
        assert time.monotonic() - t0 < 5
        for r in reqs:
            assert r.error[0] == "worker_failed"
            assert [k for sid, k, _ in events if sid == r.seq_id].count("error") == 1
        assert svc.generation == old_gen + 1 and svc.worker_pid != old_pid
        assert not _alive(old_pid)  # reaped: no zombie
        # The restart does not block the frontend: the new worker is still loading (a
        # fresh interpreter importing torch takes seconds), requests wait for it.
        assert not svc.worker_ready
        again = svc.submit([1, 2], SamplingParams(max_tokens=3))
        dropped = svc.submit([1, 2], SamplingParams(max_tokens=3))
        assert not again.submitted and list(svc.unsent) == [again, dropped]
        with pytest.raises(TimeoutError):
            svc.stats()  # at once, not after its timeout
        svc.cancel(dropped)  # cancelled while waiting: never reaches the worker
        assert dropped.finish_reason == FinishReason.CANCELLED and list(svc.unsent) == [again]
        svc.run_until(lambda: again.ended)
        assert again.finish_reason == FinishReason.LENGTH and svc.worker_ready
        stats = svc.stats()
        assert stats["finished"] == 1 and stats["failed"] == 0  # the new worker saw only `again`
        assert svc.idle() and not svc.unsent
        assert progress == progress[:1] * 2  # the restarted worker reports too
    finally:
        svc.close()


def test_a_stalled_frontend_is_not_mistaken_for_a_hung_worker():
    """The frontend stops reading for longer than the worker heartbeat timeout: the
    token ring fills and the worker waits for space. That worker is healthy (it must
    keep beating while it waits), so nothing is restarted and nothing fails."""
    svc = make_service(worker_stale_s=1.0, ring_entries=4)
    try:
        reqs = [svc.submit([3, 4], SamplingParams(max_tokens=60, ignore_eos=True)) for _ in range(2)]
        svc.run_until(lambda: all(r.token_ids for r in reqs))
        time.sleep(2.5)  # no poll: the 4-entry ring is full long before this ends
        svc.run_until(lambda: all(r.ended for r in reqs), 30)
        assert svc.generation == 1, "the worker was declared dead"
        assert [(r.finish_reason, len(r.token_ids)) for r in reqs] == [(FinishReason.LENGTH, 60)] * 2
        assert svc.stats()["ring_blocked"] > 0  # non-vacuous: the worker did wait for ring space
    finally:
        svc.close()


def test_a_burst_of_large_submits_while_the_ring_is_full_does_not_deadlock():
    """The frontend sends a burst of large prompts (more bytes than the control socket
    buffers) without reading the full token ring in between, while the worker waits
    for ring space. With a blocking send on either side each would wait on the other
    forever (this test reproduced that deadlock)."""
    svc = make_service(ring_entries=4)
    try:
        running = svc.submit([3, 4], SamplingParams(max_tokens=400, ignore_eos=True))
        svc.run_until(lambda: running.token_ids)
        time.sleep(0.5)  # no poll: the 4-entry ring fills, the worker waits for space
        burst = []
        sender = threading.Thread(target=lambda: burst.extend(
            svc.submit([5 + i % 7] * 1900, SamplingParams(max_tokens=1)) for i in range(60)), daemon=True)
        sender.start()  # 60 x 1900 token ids: several times the socket buffer
        sender.join(30)
        if sender.is_alive():
            os.kill(svc.worker_pid, signal.SIGKILL)  # unblock the sender so the test can end
            sender.join(10)
            pytest.fail("deadlock: the frontend is blocked sending, the worker waits for ring space")
        svc.run_until(lambda: running.ended and all(r.ended for r in burst), 120)
        assert running.finish_reason == FinishReason.LENGTH and all(r.finish_reason == FinishReason.LENGTH for r in burst)
        assert len(burst) == 60 and svc.stats()["ring_blocked"] > 0
    finally:
        svc.close()


def test_hung_worker_is_detected_by_its_heartbeat():
    """A worker that stops (SIGSTOP: alive, not beating) is declared dead within the
    heartbeat timeout; its requests fail and a new generation serves."""
    svc = make_service(worker_stale_s=1.0)
    try:
        old_pid = svc.worker_pid
        req = svc.submit([3, 4], SamplingParams(max_tokens=1900, ignore_eos=True))
        svc.run_until(lambda: len(req.token_ids) > 2)
        os.kill(old_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        svc.run_until(lambda: req.ended, 10)
        assert req.error[0] == "worker_failed" and "heartbeat" in req.error[1]
        assert time.monotonic() - t0 < 5
        assert svc.generation == 2 and not _alive(old_pid)  # killed and reaped though stopped
        again = svc.submit([1, 2], SamplingParams(max_tokens=3))
        svc.run_until(lambda: again.ended, 60)
        assert again.finish_reason == FinishReason.LENGTH
    finally:
        svc.close()


def test_worker_that_cannot_start_is_not_restarted_in_a_loop():
    """A restarted worker that dies while loading raises WorkerDown (systemd restarts the server)."""
    svc = make_service()
    try:
        svc.config.ready_timeout_s = 0.0  # the next generation is "not ready in time" at once
        waiting = []
        os.kill(svc.worker_pid, signal.SIGKILL)
        svc.run_until(lambda: not svc.worker_ready, 10)
        waiting.append(svc.submit([1, 2], SamplingParams(max_tokens=3)))
        with pytest.raises(WorkerDown, match="not ready"):
            svc.run_until(lambda: False, 10)
        assert waiting[0].error[0] == "worker_failed"  # queued requests get their terminal error
    finally:
        svc.close()


def test_kill_frontend_makes_the_worker_exit():
    shm_before = set(os.listdir("/dev/shm"))
    code = textwrap.dedent("""
        import sys, time
        from frontend.server.service import Service, ServiceConfig
        from shared.sampling import SamplingParams
        svc = Service(ServiceConfig(model="tiny-random", device="cpu", max_batch=4, kv_pages=300, page_size=8))
        svc.submit([5, 6], SamplingParams(max_tokens=100000 // 100, ignore_eos=True))
        print(svc.worker_pid, flush=True)
        while True:
            svc.poll(0.05)
    """)
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker_pid = int(front.stdout.readline())
    assert _alive(worker_pid)
    with open(f"/proc/{worker_pid}/cmdline", "rb") as f:
        assert b"gpu_worker" in f.read()  # operators can tell the processes apart
    front.kill()
    front.wait()
    deadline = time.monotonic() + 5
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)
    # memfd: nothing named, nothing left. Only what appeared counts: another test's leftovers may
    # vanish meanwhile (Python's resource tracker unlinks a dead process's semaphores, a moment later).
    while set(os.listdir("/dev/shm")) - shm_before and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    assert not set(os.listdir("/dev/shm")) - shm_before

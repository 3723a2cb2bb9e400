"""The device layer's stream semantics, the same on both backends: work runs in
submission order; a failure is raised at the next event wait (as DeviceError),
later work is skipped until the error is cleared, and a stream that waits on a
failed one fails too. The CUDA stream's bookkeeping is checked here with a fake
torch.cuda (no GPU on CI); bench/gpu_check.py checks it on a real device."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from gpu_worker import device as D


class FakeCudaEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.stream = None

    def record(self, stream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.stream.fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def elapsed_time(self, other) -> float:
        return 1.0


class FakeCudaStream:
    def __init__(self, device=None) -> None:
        self.fault = False
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", FakeCudaStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def make_streams(kind: str):
    if kind == "cpu":
        return D.CpuStream("compute"), D.CpuStream("copy")
    if kind == "sim":  # the copy runs on the compute executor
        compute = D.CpuStream("compute", D.SimTiming.from_ms(1.0))
        return compute, D.SimCopyStream(compute)
    return D.CudaStream("compute", torch.device("cuda")), D.CudaStream("copy", torch.device("cuda"))


@pytest.mark.parametrize("kind", ["cpu", "sim", "cuda"])
def test_failure_is_raised_at_the_next_event_and_skips_later_work(kind, request):
    if kind == "cuda":
        request.getfixturevalue("fake_cuda")
    compute, copy = make_streams(kind)
    ran = []
    try:
        compute.submit(lambda: ran.append(1))
        ok = compute.record()
        compute.submit(lambda: 1 / 0)
        compute.submit(lambda: ran.append(2))  # skipped: the stream has failed
        bad = compute.record()
        copy.wait(bad)  # ordered after the failure: fails too
        copy.submit(lambda: ran.append(3))
        copied = copy.record()
        ok.synchronize()  # work before the failure is fine
        with pytest.raises(D.DeviceError, match="ZeroDivisionError"):
            bad.synchronize()
        with pytest.raises(D.DeviceError):
            copied.synchronize()
        assert ran == [1]
        assert isinstance(compute.clear_error(), ZeroDivisionError)
        assert copy.clear_error() is not None or kind == "sim"  # sim: one executor, cleared above
        compute.submit(lambda: ran.append(4))  # cleared: work runs again
        compute.record().synchronize()
        assert ran == [1, 4]
    finally:
        compute.close()
        copy.close()


def test_cuda_fault_at_the_event_is_a_device_error(fake_cuda):
    compute = D.CudaStream("compute", torch.device("cuda"))
    compute.stream.fault = True
    with pytest.raises(D.DeviceError, match="illegal memory access"):
        compute.record().synchronize()


def test_cuda_wait_orders_on_the_event(fake_cuda):
    compute, copy = make_streams("cuda")
    ev = compute.record(timing=True)
    copy.wait(ev)
    assert copy.stream.waited == [ev.event]
    assert ev.elapsed_time(compute.record(timing=True)) == 1.0


# ----------------------------------------------------------------------------- simulated device


class FakeClock:
    """Moves only when told: by work (``advance_to``) or by a host waiting for an event."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self.t

    def sleep_until(self, t: float) -> None:
        with self._lock:
            self.t = max(self.t, t)

    advance_to = sleep_until


MS = 2.6
STEP = MS / 1e3
FWD = D.SimTiming.from_ms(MS).forward_s
SAMPLE = D.SimTiming.from_ms(MS).sample_s


@pytest.fixture
def sim():
    clock = FakeClock(10.0)
    dev = D.Device(f"sim:{MS}", clock=clock)
    yield dev, clock
    dev.close()


def slow_forward(dev: D.Device, clock: FakeClock, until: float):
    """A forward whose real work ends at ``until``. It first waits until the host
    has enqueued the mark after it, so the host's view of time is the one before."""
    def fn():
        while dev.compute._queue.empty():
            time.sleep(1e-4)
        clock.advance_to(until)
        dev.pad_forward(0.0)
    return fn


def launch(dev: D.Device, work=None) -> list:
    """What Engine._launch enqueues: the forward between two marks."""
    marks = [dev.mark()]
    dev.compute.submit(work or (lambda: dev.pad_forward(0.0)))
    marks.append(dev.mark())
    return marks


def finalize(dev: D.Device, marks: list):
    """What Engine._finalize enqueues: sampling between two marks, buffer bookkeeping, the copy."""
    marks.append(dev.mark())
    dev.compute.submit(lambda: None)  # sampling
    marks.append(dev.mark())
    dev.compute.submit(lambda: None)  # release of the step buffer's arrays (bookkeeping)
    dev.copy.wait(dev.compute.record())
    dev.copy.submit(lambda: None)  # device -> host copy of the ids
    return dev.copy.record()


def commit(dev: D.Device, marks: list, done) -> None:
    done.synchronize()
    dev.account(marks, done)


def test_sim_step_is_released_exactly_ms_after_it_starts(sim):
    dev, clock = sim
    marks = launch(dev)
    done = finalize(dev, marks)
    done._done.wait()  # the real work is done...
    assert not done.query() and clock.now() == 10.0  # ...but the step is not, in device time
    commit(dev, marks, done)
    assert clock.now() == pytest.approx(10.0 + STEP)  # released at start + MS, not before
    assert [m.time for m in marks] == pytest.approx([10.0, 10.0 + FWD, 10.0 + FWD, 10.0 + STEP])
    assert done.time == pytest.approx(10.0 + STEP) and done.query()
    b = dev.bubble
    assert (b.steps, b.overruns) == (1, 0)
    assert b.busy_s == pytest.approx(STEP) and b.idle_s == 0


def test_overrun_counts_exactly_the_steps_whose_work_did_not_fit(sim):
    dev, clock = sim
    slow = {2, 5}
    durations = []
    for step in range(8):
        start = clock.now()
        work = slow_forward(dev, clock, start + 3 * STEP) if step in slow else None
        marks = launch(dev, work)
        done = finalize(dev, marks)
        commit(dev, marks, done)
        assert marks[1].late == (step in slow)
        durations.append(done.time - start)
    assert dev.bubble.steps == 8 and dev.bubble.overruns == len(slow)
    # A step that fit took MS; one that did not took its real work, then its sampling.
    expected = [3 * STEP + SAMPLE if s in slow else STEP for s in range(8)]
    assert durations == pytest.approx(expected)


def test_late_copy_is_an_overrun(sim):
    dev, clock = sim
    marks = launch(dev)
    marks.append(dev.mark())
    dev.compute.submit(lambda: None)
    marks.append(dev.mark())
    dev.copy.wait(dev.compute.record())
    dev.copy.submit(lambda: clock.advance_to(10.0 + 2 * STEP))  # a copy that ends after the step
    done = dev.copy.record()
    commit(dev, marks, done)
    assert not any(m.late for m in marks) and done.late
    assert dev.bubble.overruns == 1 and done.time == pytest.approx(10.0 + 2 * STEP)


def test_host_gap_before_sampling_is_device_idle(sim):
    """The host enqueues sampling 5 ms after the forward was enqueued (e.g. waiting
    for constraint masks): the device idles from the forward's end until then."""
    dev, clock = sim
    marks = launch(dev)
    marks[-1]._done.wait()
    clock.advance_to(10.005)
    done = finalize(dev, marks)
    commit(dev, marks, done)
    assert marks[2].time == pytest.approx(10.005)
    assert done.time == pytest.approx(10.005 + SAMPLE)
    b = dev.bubble
    assert b.idle_s == pytest.approx(0.005 - FWD) and b.busy_s == pytest.approx(STEP) and b.overruns == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_pipelined_hides_host_time_blocking_pays_it(sim, pipelined):
    """The cost model in miniature: the host spends HOST per step after each commit.
    Blocking: MS + HOST per step, HOST of it device idle. Pipelined: MS, never idle."""
    dev, clock = sim
    host = 0.4 * STEP
    ends = []

    def host_commit(marks, done):
        commit(dev, marks, done)
        ends.append(done.time)
        clock.advance_to(clock.now() + host)  # plan, bookkeeping

    steps = 6
    if pipelined:
        prev = launch(dev)
        prev_done = finalize(dev, prev)
        for _ in range(steps - 1):
            marks = launch(dev)  # launch t+1 ...
            host_commit(prev, prev_done)  # ... commit t ...
            prev, prev_done = marks, finalize(dev, marks)  # ... finalize t+1
        host_commit(prev, prev_done)
    else:
        for _ in range(steps):
            marks = launch(dev)
            host_commit(marks, finalize(dev, marks))
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    b = dev.bubble
    assert b.overruns == 0 and b.busy_s == pytest.approx(steps * STEP)
    if pipelined:
        assert gaps == pytest.approx([STEP] * (steps - 1)) and b.idle_s == 0
    else:
        assert gaps == pytest.approx([STEP + host] * (steps - 1))
        assert b.idle_s == pytest.approx((steps - 1) * host)


def test_sim_spec_is_checked():
    for bad in ("sim:", "sim:fast", "sim:-1", "sim:nan", "sim:inf"):
        with pytest.raises(ValueError, match="sim:MS"):
            D.Device(bad)


# ----------------------------------------------------------------------------- the engine on sim:MS


def engine_on_fake_clock(monkeypatch, pipelined: bool):
    from gpu_worker.engine import Engine, EngineConfig

    clock = FakeClock()
    monkeypatch.setattr(D, "SYSTEM_CLOCK", clock)
    eng = Engine(EngineConfig(model="tiny-random", device=f"sim:{MS}", pipeline=pipelined, max_batch=4,
                              kv_pages=64, page_size=8, dtype="float32"))
    return eng, clock


PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]


@pytest.mark.parametrize("pipelined", [False, True])
def test_engine_steps_take_exactly_ms_of_device_time(monkeypatch, pipelined):
    """Real work takes no time on the fake clock: every step fits, none overruns,
    and the device time of the run is steps * MS, whatever the host did."""
    from shared.sampling import SamplingParams

    eng, clock = engine_on_fake_clock(monkeypatch, pipelined)
    try:
        seqs = eng.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        st = eng.stats()
    finally:
        eng.close()
    assert all(len(s.output_ids) == 6 for s in seqs)
    assert st["device_overruns"] == 0 and st["steps"] == 6
    assert st["bubble_busy_s"] == pytest.approx(6 * STEP) and st["bubble_idle_s"] == 0
    assert clock.now() == pytest.approx(6 * STEP)


def test_engine_counts_the_steps_that_overran(monkeypatch):
    """Forwards 2 and 4 (decode steps) do real work past their device time:
    exactly those two steps are overruns, in the engine's stats."""
    from shared.sampling import SamplingParams

    eng, clock = engine_on_fake_clock(monkeypatch, pipelined=False)
    model, calls = eng.runner.model, []

    def forward(*args, **kw):
        calls.append(len(calls))
        if calls[-1] in (2, 4):
            while eng.device.compute._queue.empty():  # the host has enqueued the mark after it
                time.sleep(1e-4)
            clock.advance_to(clock.now() + 3 * STEP)
        return model(*args, **kw)

    eng.runner.model = forward
    try:
        eng.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        st = eng.stats()
    finally:
        eng.close()
    assert len(calls) == 6 and st["steps"] == 6
    assert st["device_overruns"] == 2

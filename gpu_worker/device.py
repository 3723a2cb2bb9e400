"""Device layer: streams, events, page-locked buffers and the bubble meter.

The engine is written once against this small interface:

- ``stream.submit(fn)`` enqueues work and returns at once. On CUDA, ``fn`` runs
  right away inside ``torch.cuda.stream(s)``, which only *enqueues* kernels. On
  the CPU, a stream is one executor thread running submitted functions in order,
  so launches are asynchronous exactly as on a GPU and the same pipelined code
  (event waits, step-buffer reuse, copy ordering) runs, and races show up, in CI.
- ``stream.record()`` returns an event; ``event.synchronize()`` blocks the host
  until the stream reached it; ``other.wait(event)`` orders a stream after it.
- ``mark()`` records a timestamped event on the compute stream. A step's work
  is bracketed by marks (forward, then sampling); the meter sums the gaps
  between consecutive busy intervals in stream order: the bubble. That counts
  both the gap between steps and, for constrained rows, a forward that finished
  before its masks arrived.

The simulated device (``sim:MS``) is the CPU streams on a *device clock*: a
decode step (forward + sampling + the copy of the ids to the host) takes MS ms
of device time, whatever the host does meanwhile, as on a GPU:

- Every piece of work starts, in device time, at max(its submission, the end of
  the stream's previous work). A forward lasts ``(1 - SIM_SAMPLE_SHARE) * MS``,
  each sampling launch (work inside a pair of marks other than the forward)
  ``SIM_SAMPLE_SHARE * MS``; the copy of the ids and bookkeeping outside marks
  (row parameters, buffer release) take none. The copy runs on the compute
  executor (``SimCopyStream``). A host that enqueues sampling late leaves the
  device idle in between, and the meter sees it, as on a GPU.
- The real CPU work runs on the executor threads as soon as it can (usually
  ahead of device time); an event records its device time and is released to
  the host (``synchronize``) no earlier than that. So the device does not slow
  down when the host thread works, and the host cannot see results early.
- When the real work before an event finished after the event's device time
  (the CPU could not keep up), the device clock moves to the real time and the
  event is *late*; the meter counts a step with a late mark or a late completion
  as an overrun. A table with overruns measured the CPU, not the simulated device.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("tandem.worker")


class DeviceError(RuntimeError):
    """Work that failed on a stream; raised on the host at the next event wait."""


# ----------------------------------------------------------------------------- CPU

def leave_openmp_to_the_streams() -> bool:
    """Run the calling (host) thread's OpenMP regions on one thread, leaving the cores to the CPU
    streams' threads, where the forward runs. libgomp keeps a pool of worker threads per thread
    that starts a parallel region, and once it manages more threads than there are CPUs its
    threads stop spinning between regions: each region then starts with futex wake-ups. On 2
    cores a one-row forward on the compute stream's thread took 21-41 ms after the host thread had
    run 2-thread regions (loading the model), 9 ms when it had not (BENCHMARKS.md "The host
    thread's OpenMP pool"); each more compute thread (another engine's) adds its pool too. For the
    worker process, and `bench.decode` on a CPU (its engines share one device), whose host thread
    computes little; other in-process callers (tests) keep their threads. Returns whether torch's
    OpenMP runtime (libgomp) was found."""
    torch.get_num_threads()  # torch's lazy per-thread init first: it would set the count back later
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # torch's runtime, only if loaded
    except OSError:
        log.info("host thread: torch's OpenMP runtime is not libgomp; its thread count stays")
        return False
    gomp.omp_set_num_threads(1)
    log.info("host thread: OpenMP regions on 1 thread; the streams' threads keep torch's count")
    return True


@contextlib.contextmanager
def openmp_left_to_the_streams():
    """:func:`leave_openmp_to_the_streams` for a block (a benchmark run inside a test process); the
    host thread's count is restored after it."""
    before = torch.get_num_threads()
    leave_openmp_to_the_streams()
    try:
        yield
    finally:
        torch.set_num_threads(before)


SIM_SAMPLE_SHARE = 0.1  # of a simulated step: each sampling launch; the forward takes the rest


class Clock:
    """Wall time for the CPU streams; tests inject a fake one."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def sleep_until(t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


SYSTEM_CLOCK = Clock()


@dataclass(frozen=True)
class SimTiming:
    """Device time of one simulated step (``sim:MS``), in seconds."""

    forward_s: float
    sample_s: float

    @classmethod
    def from_ms(cls, step_ms: float) -> "SimTiming":
        step = step_ms / 1e3
        return cls(step * (1 - SIM_SAMPLE_SHARE), step * SIM_SAMPLE_SHARE)


class CpuEvent:
    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._done = threading.Event()
        self._clock = clock
        self.error: BaseException | None = None
        self.time = 0.0  # when the stream reached the event (device time on sim:MS)
        self.late = False  # sim:MS: the real work before it ended after that time

    def set(self, error: BaseException | None, at: float, late: bool = False) -> None:
        self.error, self.time, self.late = error, at, late
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set() and self._clock.now() >= self.time

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("device event not reached in time")
        self._clock.sleep_until(self.time)  # never released before its device time
        if self.error is not None:
            raise DeviceError(f"device work failed: {self.error!r}") from self.error


class CpuStream:
    """One executor thread; functions run in submission order.

    With ``timing`` (sim:MS) the stream keeps a device clock (module docstring):
    its device work is what marks bracket, plus the copies (``SimCopyStream``);
    other work (row parameters, buffer release) is bookkeeping that takes no
    device time and whose real time is not checked.
    """

    def __init__(self, name: str, timing: SimTiming | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.name = name
        self.timing = timing
        self.clock = clock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        # Device clock (executor thread only).
        self._device_time = 0.0  # device time at which the stream's enqueued work ends
        self._real_end = 0.0  # real time at which the last checked work ended
        self._in_marks = False  # between a begin mark and its end mark
        self._work_s: float | None = None  # device time declared by the running work (a forward)
        self._thread = threading.Thread(target=self._run, name=f"tandem-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, obj, submitted = item
            if kind in ("work", "copy"):
                self._work(obj, submitted, kind == "copy")
            elif kind == "wait":
                self._wait(obj)
            else:
                self._reach(obj, submitted, kind == "mark")

    def _work(self, fn, submitted: float, is_copy: bool) -> None:
        start = max(self._device_time, submitted)
        self._work_s = None
        if self._error is None:  # after a failure, skip work until the error is seen
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported at the next event
                self._error = e
        if self.timing is None:
            return
        if self._work_s is not None:
            duration = self._work_s
        else:
            duration = self.timing.sample_s if self._in_marks else 0.0
        self._device_time = start + duration
        if self._in_marks or is_copy:
            self._real_end = self.clock.now()

    def _reach(self, event: CpuEvent, submitted: float, is_mark: bool) -> None:
        if self.timing is None:
            event.set(self._error, self.clock.now())
            return
        at = max(self._device_time, submitted)
        late = self._real_end > at
        if late:  # the CPU did not keep up: the device is behind by that much
            at = self._real_end
        self._device_time = at
        if is_mark:
            self._in_marks = not self._in_marks
        event.set(self._error, at, late)

    def _wait(self, event: CpuEvent) -> None:
        event._done.wait()
        self._device_time = max(self._device_time, event.time)
        if event.error is not None and self._error is None:  # work ordered after a failure fails too
            self._error = DeviceError(f"device work failed: {event.error!r}")

    def charge(self, seconds: float) -> None:
        """Called by work running on this stream: its device time (a simulated forward)."""
        self._work_s = seconds

    def submit(self, fn) -> None:
        self._queue.put(("work", fn, self.clock.now()))

    def record(self, mark: bool = False) -> CpuEvent:
        ev = CpuEvent(self.clock)
        self._queue.put(("mark" if mark else "event", ev, self.clock.now()))
        return ev

    def submit_copy(self, fn) -> None:
        self._queue.put(("copy", fn, self.clock.now()))

    def wait(self, event: CpuEvent) -> None:
        self._queue.put(("wait", event, 0.0))

    def clear_error(self) -> BaseException | None:
        err, self._error = self._error, None
        return err

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class SimCopyStream:
    """The copy stream of sim:MS. A copy takes no device time, so it runs on the
    compute executor, in order after the work it waits for: a copy thread would
    add a thread wake-up per step, late on a busy CPU, that no GPU has."""

    def __init__(self, compute: CpuStream) -> None:
        self.name = "copy"
        self.compute = compute

    def submit(self, fn) -> None:
        self.compute.submit_copy(fn)

    def record(self) -> CpuEvent:
        return self.compute.record()

    def wait(self, event: CpuEvent) -> None:
        self.compute.wait(event)  # an event of the compute stream itself is already reached

    def clear_error(self) -> BaseException | None:
        return self.compute.clear_error()

    def close(self) -> None:
        pass  # the compute stream's owner closes it


# ----------------------------------------------------------------------------- CUDA


class CudaEvent:
    """A CUDA event plus the error of the work enqueued before it, if any."""

    late = False  # a real device is never behind its own clock

    def __init__(self, event, error: BaseException | None) -> None:
        self.event, self.error = event, error

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        try:
            self.event.synchronize()
        except RuntimeError as e:  # a CUDA fault; sticky: recover() re-raises it
            raise DeviceError(f"device work failed: {e!r}") from e
        if self.error is not None:
            raise DeviceError(f"device work failed: {self.error!r}") from self.error

    def elapsed_time(self, other: "CudaEvent") -> float:
        return self.event.elapsed_time(other.event)


class CudaStream:
    """``submit`` enqueues kernels at once. An exception while enqueuing (out of
    memory, a bad shape) is kept and raised at the next event wait, as on the
    CPU stream, and later work is skipped until ``clear_error``: a failed launch
    fails the steps in flight, not the worker."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.stream = torch.cuda.Stream(device=device)
        self._error: BaseException | None = None

    def submit(self, fn) -> None:
        if self._error is not None:
            return
        try:
            with torch.cuda.stream(self.stream):
                fn()
        except Exception as e:  # noqa: BLE001 - reported at the next event
            self._error = e

    def record(self, timing: bool = False) -> CudaEvent:
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self.stream)
        return CudaEvent(ev, self._error)

    def wait(self, event: CudaEvent) -> None:
        self.stream.wait_event(event.event)
        if event.error is not None and self._error is None:
            self._error = event.error  # work ordered after a failure fails too

    def clear_error(self) -> BaseException | None:
        err, self._error = self._error, None
        return err

    def close(self) -> None:
        self.stream.synchronize()


# ----------------------------------------------------------------------------- meter


@dataclass
class BubbleStats:
    steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0  # gaps between consecutive steps while work was queued
    overruns: int = 0  # sim:MS: steps whose real CPU work did not fit in the simulated time

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


class Device:
    """Factory and holder of the two streams for one backend."""

    def __init__(self, spec: str = "cpu", clock: Clock | None = None) -> None:
        spec = spec or "cpu"
        if spec == "auto":
            spec = "cuda" if torch.cuda.is_available() else "cpu"
        self.spec = spec
        self.sim_ms = 0.0
        self.sim: SimTiming | None = None
        if spec.startswith("sim:"):
            try:
                self.sim_ms = float(spec.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"device {spec!r}: sim:MS needs a number of milliseconds, e.g. sim:2.6") from None
            if not self.sim_ms >= 0 or self.sim_ms == float("inf"):
                raise ValueError("sim:MS needs a finite MS >= 0")
            self.sim = SimTiming.from_ms(self.sim_ms)
            kind = "sim"
        elif spec in ("cpu", "cuda") or spec.startswith("cuda:"):
            kind = "cuda" if spec.startswith("cuda") else "cpu"
        else:
            raise ValueError(f"unknown device {spec!r}: use auto, cpu, cuda or sim:MS")
        self.kind = kind
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
            self.torch_device = torch.device(spec if ":" in spec else "cuda")
            self.compute = CudaStream("compute", self.torch_device)
            self.copy = CudaStream("copy", self.torch_device)
        else:
            self.torch_device = torch.device("cpu")
            self.compute = CpuStream("compute", self.sim, clock or SYSTEM_CLOCK)
            self.copy = SimCopyStream(self.compute) if self.sim else CpuStream("copy")
        self.bubble = BubbleStats()
        self._pending_marks: list = []  # (begin, end) events of recent steps (CUDA)
        self._last_end = None  # CPU: perf_counter of the previous step's end

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def page_lock(self, buffer, nbytes: int) -> bool:
        """cudaHostRegister ``nbytes`` of a writable buffer (e.g. the shared-memory
        arena's mmap) so device copies into it run as async DMA. False when not
        on CUDA or when the driver refuses; callers then copy on the host."""
        if not self.is_cuda:
            return False
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
            err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use the direct path
            log.warning("cudaHostRegister failed: %r", e)
            return False
        return int(err) == 0

    # -- bubble meter ----------------------------------------------------------
    def mark(self):
        """A timestamped event on the compute stream (reached even after a failure)."""
        if self.is_cuda:
            return self.compute.record(timing=True)
        return self.compute.record(mark=True)

    def account(self, marks: list, done=None) -> None:
        """Fold a finished step's marks [begin, end, begin, end, ...] and its
        completion event (what the host waited on) into the meter."""
        busy = idle = 0.0
        prev_end = self._last_end
        for begin, end in zip(marks[::2], marks[1::2]):
            busy += self._elapsed(begin, end)
            if prev_end is not None:
                idle += max(self._elapsed(prev_end, begin), 0.0)
            prev_end = end
        self.bubble.steps += 1
        self.bubble.busy_s += busy
        self.bubble.idle_s += idle
        self.bubble.overruns += any(ev.late for ev in marks) or (done is not None and done.late)
        self._last_end = prev_end

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.is_cuda else b.time - a.time

    def reset_chain(self) -> None:
        """The engine ran out of work: the next gap is not a bubble."""
        self._last_end = None

    def reset_meter(self) -> None:
        self.bubble = BubbleStats()
        self._last_end = None

    def pad_forward(self, t0: float) -> None:
        """Called by the forward's work on the compute stream: on sim:MS it lasts
        the forward's share of MS in device time (``t0``, its real start, is unused)."""
        if self.sim is not None:
            self.compute.charge(self.sim.forward_s)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)
        else:
            self.compute.record().synchronize()
            self.copy.record().synchronize()

    def recover(self) -> None:
        """After a failure: let both streams run dry, then accept work again."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)  # a real CUDA fault is sticky: this raises (worker restarts)
        else:
            for stream in (self.compute, self.copy):
                stream.record()._done.wait()
        for stream in (self.compute, self.copy):
            stream.clear_error()

    def close(self) -> None:
        self.compute.close()
        self.copy.close()

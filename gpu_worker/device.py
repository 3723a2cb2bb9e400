"""Device layer: streams, events, page-locked buffers and the bubble meter.

The engine is written once against this small interface:

- ``stream.submit(fn)`` enqueues work and returns at once. On CUDA, ``fn`` runs
  right away inside ``torch.cuda.stream(s)``, which only *enqueues* kernels. On
  the CPU, a stream is one executor thread running submitted functions in order,
  so launches are asynchronous exactly as on a GPU and the same pipelined code
  (event waits, slot reuse, copy ordering) runs, and races show up, in CI.
- ``stream.record()`` returns an event; ``event.synchronize()`` blocks the host
  until the stream reached it; ``other.wait(event)`` orders a stream after it.
- ``mark()`` records a timestamped event on the compute stream. A step's work
  is bracketed by marks (forward, then sampling); the meter sums the gaps
  between consecutive busy intervals in stream order: the bubble. That counts
  both the gap between steps and, for constrained rows, a forward that finished
  before its masks arrived.

The simulated device is the CPU stream plus a fixed time per forward (``sim:MS``):
each forward is padded with a sleep to take MS milliseconds, reproducing a given
GPU's regime on a CPU for the cost-model benchmark.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("tandem.worker")


class DeviceError(RuntimeError):
    """Work that failed on a stream; raised on the host at the next event wait."""


# ----------------------------------------------------------------------------- CPU


class CpuEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.time = 0.0  # perf_counter when the stream reached the event

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self.time = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("device event not reached in time")
        if self.error is not None:
            raise DeviceError(f"device work failed: {self.error!r}") from self.error


class CpuStream:
    """One executor thread; functions run in submission order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"tandem-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, event = item
            if event is not None:
                event.set(self._error)
                continue
            if self._error is None:  # after a failure, skip work until the error is seen
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - reported at the next event
                    self._error = e

    def submit(self, fn) -> None:
        self._queue.put((fn, None))

    def record(self) -> CpuEvent:
        ev = CpuEvent()
        self._queue.put((None, ev))
        return ev

    def wait(self, event: CpuEvent) -> None:
        self.submit(lambda: event.synchronize())

    def clear_error(self) -> BaseException | None:
        err, self._error = self._error, None
        return err

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


# ----------------------------------------------------------------------------- CUDA


class CudaEvent:
    """A CUDA event plus the error of the work enqueued before it, if any."""

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

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


class Device:
    """Factory and holder of the two streams for one backend."""

    def __init__(self, spec: str = "cpu") -> None:
        spec = spec or "cpu"
        if spec == "auto":
            spec = "cuda" if torch.cuda.is_available() else "cpu"
        self.spec = spec
        self.sim_ms = 0.0
        if spec.startswith("sim:"):
            self.sim_ms = float(spec.split(":", 1)[1])
            if self.sim_ms < 0:
                raise ValueError("sim:MS needs MS >= 0")
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
            self.compute = CpuStream("compute")
            self.copy = CpuStream("copy")
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
        return self.compute.record()

    def account(self, marks: list) -> None:
        """Fold a finished step's marks [begin, end, begin, end, ...] into the meter."""
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
        """Simulated device: make this forward take sim_ms (runs on the stream)."""
        if self.sim_ms > 0:
            remaining = self.sim_ms / 1e3 - (time.perf_counter() - t0)
            if remaining > 0:
                time.sleep(remaining)

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

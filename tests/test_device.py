"""The device layer's stream semantics, the same on both backends: work runs in
submission order; a failure is raised at the next event wait (as DeviceError),
later work is skipped until the error is cleared, and a stream that waits on a
failed one fails too. The CUDA stream's bookkeeping is checked here with a fake
torch.cuda (no GPU on CI); bench/gpu_check.py checks it on a real device."""
from __future__ import annotations

import contextlib

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
    return D.CudaStream("compute", torch.device("cuda")), D.CudaStream("copy", torch.device("cuda"))


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
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
        assert isinstance(compute.clear_error(), ZeroDivisionError) and copy.clear_error() is not None
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

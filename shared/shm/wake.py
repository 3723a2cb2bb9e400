"""Wakeups between the two processes: the eventfds (``WakeFds``), signalling
and draining them, and ``_Waiter`` (spin, then sleep on an eventfd until a
condition holds; see "Back-pressure" in the package docstring)."""
from __future__ import annotations

import math
import os
import select
import threading
import time
from typing import Callable, NamedTuple, Optional, Union

from .errors import RingAborted


class WakeFds(NamedTuple):
    """Eventfds (-1 = absent: waiters fall back to short sleeps)."""
    tokens: int  # worker -> frontend: an entry was published
    space: int   # frontend -> worker: entries were consumed
    masks: int   # frontend -> worker: mask rows were stamped


def _signal(fd: int) -> None:
    if fd >= 0:
        try:
            os.eventfd_write(fd, 1)
        except BlockingIOError:
            pass  # counter saturated: the waiter will wake anyway


def _drain(fd: int) -> None:
    if fd >= 0:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            pass


AbortFn = Union[Callable[[], bool], threading.Event, None]


def _abort_fn(abort: AbortFn) -> Optional[Callable[[], bool]]:
    return getattr(abort, "is_set", abort)


class _Waiter:
    """Spin for ``spin_s``, then sleep on an eventfd until a condition holds.

    The condition is re-checked after every wakeup (eventfd counts may be
    stale); the sleep is sliced so the abort callback is polled regularly.
    """

    def __init__(self, fd: int, spin_s: float, slice_s: float = 0.05):
        self.fd, self.spin_s, self.slice_s = fd, spin_s, slice_s
        self.sleeps = 0  # how often this waiter actually went to sleep
        self._poll = None
        if fd >= 0:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    def wait(self, cond: Callable[[], bool], timeout: Optional[float],
             abort: AbortFn = None) -> bool:
        if cond():
            return True
        now = time.perf_counter()
        deadline = math.inf if timeout is None else now + timeout
        spin_end = min(now + self.spin_s, deadline)
        while time.perf_counter() < spin_end:
            if cond():
                return True
        aborted = _abort_fn(abort)
        while True:
            if aborted is not None and aborted():
                raise RingAborted("wait aborted")
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return cond()
            self.sleeps += 1
            nap = min(remaining, self.slice_s)
            if self._poll is not None:
                self._poll.poll(max(1, math.ceil(nap * 1000)))
                _drain(self.fd)
            else:
                time.sleep(min(nap, 0.0005))
            if cond():
                return True

"""The image pool: decoding and tiling in low-priority child processes.

``ImageIntake.start`` (``image_intake.py``) hands each request's encoded images to this pool;
a child process runs ``images.prepare_images`` (decode, validate, resize, tile,
hash) and sends back the ``PreparedImage`` list (uint8 tiles) or the
``ValueError`` that names the bad image. The result reaches the caller's
``on_done(result)`` on a thread of this process.

Why processes at nice 19, not threads (measured, BENCHMARKS.md "Text streams
while large images arrive"): pool threads share the frontend's GIL with the
service loop, and a pool thread at low priority that holds the GIL when the
scheduler preempts it stalls the loop until it runs again (a 1.1 s stall was
measured on a busy two-core machine); at normal priority they take the cores
from the worker. Children at nice 19 yield the CPU to the worker and the
loop, and hold no lock they need. What crosses the pipe is the encoded bytes
in and uint8 tiles out (no float arrays).

A child that dies (killed, or crashed in a decoder) breaks the executor: the
requests it held get ``BrokenProcessPool``, and the next submit starts a fresh
pool. ``close()`` waits for the running preparations (at most one image each),
cancels the queued ones and joins every child and helper thread; a frontend
that is killed takes its children with it (each watches its parent). The
spawn start method also starts multiprocessing's resource tracker, one helper
process per frontend that ends when the frontend does; and, as with any
spawned child, a script that creates a ``Service`` of a vision model needs the
``if __name__ == "__main__":`` guard (each child imports the main module).
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait
from typing import Callable

from shared.vision_config import ImageProcessorParams

from frontend.images.idefics3 import prepare_images

PREPARE_NICENESS = 19  # the lowest priority a normal user may set (and set back) without privileges


def default_workers() -> int:
    """The cores this process may use, less two (the service loop and the worker's host thread); 1 to 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) - 2))


def _start_child() -> None:
    """Child initializer: nice 19 for its working thread (on Linux, ``who=0`` is the caller), and exit
    when the frontend does: killed, it never closes the pipe the child waits on (every child holds
    its write end), so without this watch the children would outlive it."""
    os.setpriority(os.PRIO_PROCESS, 0, PREPARE_NICENESS)
    parent = multiprocessing.parent_process().sentinel  # readable once the frontend has exited
    threading.Thread(target=lambda: (wait([parent]), os._exit(1)), name="exit-with-frontend", daemon=True).start()


class ImagePool:
    def __init__(self, params: ImageProcessorParams | None, workers: int | None = None, prepare=prepare_images) -> None:
        """``prepare(images, params)``: the model family's preparation (a module-level function)."""
        if workers is not None and workers < 1:
            raise ValueError(f"image workers must be >= 1, got {workers}")
        self.params = params
        self.prepare = prepare
        self.workers = workers or default_workers()
        self._executor = self._start()

    def _start(self) -> ProcessPoolExecutor:
        # spawn: a child never inherits the frontend's threads, sockets or shared memory
        # (fork would), and no fork server outlives the pool.
        executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_start_child)
        # Start every child now (each submit to a pool without an idle child starts one), so that they
        # import Pillow and numpy while the worker loads, not beside the first images.
        for _ in range(self.workers):
            executor.submit(self.prepare, [], self.params)
        return executor

    def submit(self, images: list[bytes], on_done: Callable[[object], None]) -> Future:
        """Prepare ``images`` in a child. ``on_done`` gets the list of ``PreparedImage`` or the exception
        (``ValueError`` for bad input, ``CancelledError`` if cancelled before it started,
        ``BrokenProcessPool`` if its child died), exactly once, on a pool thread or the cancelling thread."""
        try:
            future = self._executor.submit(self.prepare, images, self.params)
        except BrokenProcessPool:  # a child died earlier: its requests have failed; start afresh
            self._executor.shutdown(wait=True)
            self._executor = self._start()
            future = self._executor.submit(self.prepare, images, self.params)
        future.add_done_callback(lambda f: on_done(_outcome(f)))
        return future

    def close(self) -> None:
        """Cancel what has not started, wait for what has, and join every child and helper thread."""
        self._executor.shutdown(wait=True, cancel_futures=True)


def _outcome(future: Future) -> object:
    if future.cancelled():
        return CancelledError()
    return future.exception() or future.result()

"""Spawning, talking to and supervising one GPU worker process.

The frontend creates the worker's arena (memfd + eventfds) and control
socketpair, then spawns ``python -m gpu_worker.worker`` (a fresh interpreter:
never a fork of a process that may have touched CUDA) with those fds inherited.
Nothing is created on the filesystem, so a kill -9 of either side leaks nothing.
Each (re)start gets a new generation number and a new arena.

The worker's stderr is a pipe that one thread reads: each of its log records is logged here
as the frontend's own (``shared/worker_log.py``), any other line at WARNING under
``tandem.worker``; the last lines are kept for the report of a worker that fails to start.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from shared.control import ChannelClosed, ControlChannel
from shared.messages import Progress, Ready, Shutdown
from shared.models.info import ModelInfo
from shared.shm import Arena, Layout, Side
from shared.worker_log import decode

TAIL_LINES = 50  # of the worker's stderr, for a failure's report

if TYPE_CHECKING:
    from frontend.server.service import ServiceConfig


class WorkerDown(RuntimeError):
    """The worker died or could not start (the server's own signal; clients see ``worker_failed``)."""


class WorkerHandle:
    def __init__(self, config: "ServiceConfig", model: ModelInfo, generation: int, on_progress=None,
                 image_region: tuple[int, int, int] = (0, 1, 0)) -> None:
        """Spawn generation ``generation`` of the worker for ``config`` (its engine fields
        travel to the worker as JSON, with the resolved model directory). ``image_region``:
        (tile blocks, tiles per block, tile side) of the arena's image region."""
        engine_config = dict(config.engine_fields(), model=str(model.path))
        self.generation = generation
        self.stale_s = config.worker_stale_s
        self.ready_timeout_s = config.ready_timeout_s
        self.started = time.monotonic()
        self.on_progress = on_progress  # called with each Progress the worker sends while starting
        max_batch = config.max_batch
        self.arena = Arena.create(Layout(vocab_size=model.vocab_size, ring_entries=config.ring_entries,
                                         max_rows=max_batch, max_batch_rows=max_batch, tile_blocks=image_region[0],
                                         block_tiles=image_region[1], tile_size=image_region[2]),
                                  generation=generation)
        self._beating = self.arena.start_heartbeat(Side.FRONTEND)
        self.channel, child_end = ControlChannel.pair()
        cmd = [sys.executable, "-m", "gpu_worker.worker", "--arena", self.arena.fd_spec(),
               "--control", str(child_end.fileno()), "--config", json.dumps(engine_config),
               "--generation", str(generation), "--parent-pid", str(os.getpid()),
               "--mask-timeout", str(config.mask_timeout_s), "--log-level", config.log_level]
        self.proc = subprocess.Popen(cmd, pass_fds=(*self.arena.pass_fds, child_end.fileno()),
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        child_end.close()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._relay = threading.Thread(target=self._relay_stderr, name=f"worker-{generation}-stderr", daemon=True)
        self._relay.start()
        self.tokens = self.arena.token_reader()
        self.acks = self.arena.ack_writer()
        self.masks = self.arena.mask_writer()
        self.images = self.arena.image_writer()  # a new arena per generation: every tile block starts free
        self.info: dict = {}
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll_ready(self) -> bool:
        """Non-blocking: has the worker loaded and warmed up (``Ready`` received)?
        Whether it died or timed out while starting is ``failure()``'s to say."""
        if self.ready or self.proc.poll() is not None:
            return self.ready
        try:
            messages = self.channel.receive()
        except ChannelClosed:
            return False  # the exit is reported by failure()
        for msg in messages:
            if isinstance(msg, Ready):
                self.info, self.ready = dict(msg.info), True
            elif isinstance(msg, Progress) and self.on_progress is not None:
                self.on_progress(msg)
        return self.ready

    def wait_ready(self) -> dict:
        """Block until the worker is ready; returns its info (raises WorkerDown)."""
        while not self.poll_ready():
            why = self.failure()
            if why is not None:
                self.kill()
                raise WorkerDown(why)
            select.select([self.channel], [], [], 0.1)
        return self.info

    def failure(self) -> str | None:
        """Why the worker is unusable, or None while it is healthy (or still starting in time)."""
        code = self.proc.poll()
        if code is not None:
            if not self.ready:
                return f"worker exited with code {code} while starting: {self.stderr_tail()}"
            return f"worker exited with code {code}"
        if self.ready and not self.arena.is_alive(Side.WORKER, self.stale_s):
            return f"worker heartbeat stale for more than {self.stale_s:.0f} s"
        if not self.ready and time.monotonic() - self.started > self.ready_timeout_s:
            return f"worker not ready after {self.ready_timeout_s:.0f} s"
        return None

    def _relay_stderr(self) -> None:
        """Until the pipe's end (the worker and whatever inherited its stderr exited): each line logged."""
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            record = decode(line) or logging.makeLogRecord(
                {"name": "tandem.worker", "msg": line, "levelno": logging.WARNING, "levelname": "WARNING"})
            self._tail.append(record.getMessage())
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)
        self.proc.stderr.close()

    def stderr_tail(self, limit: int = 2000) -> str:
        """The worker's last lines on stderr (all it wrote, once it has exited)."""
        if self.proc.poll() is not None:
            self._relay.join(timeout=2.0)  # the pipe's last lines (longer only if a child still holds it)
        return "\n".join(tuple(self._tail))[-limit:].strip()

    def shutdown(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            self.channel.send(Shutdown())
            while self.proc.poll() is None and time.monotonic() < deadline:
                self.channel.flush()  # what the worker has not read yet, Shutdown last
                time.sleep(0.01)
        except ChannelClosed:
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()  # reaped: no zombie process
        self._beating.set()
        self.channel.close()
        self.arena.close()
        self._relay.join(timeout=2.0)

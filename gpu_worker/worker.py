"""The GPU worker process: computes, and nothing else.

Started by the frontend (``python -m gpu_worker.worker ...``, spawned, never
forked after CUDA init) with three inherited file descriptors: the shared-memory
arena (memfd + eventfds) and one end of the control socketpair. It loads the
model, warms up (CUDA graphs), sends ``Ready`` and runs the engine loop with the
token ring as its output. Its commit is minimal: EOS / stop-token / length
finalization, ``inflight_refs``, releases. No detokenization, no text, no
client I/O: stop strings, grammars and cancellation arrive as acknowledgements
from the frontend.

It exits promptly when the frontend is gone (parent changed, control channel
closed, or the frontend's heartbeat stale), so no orphan holds a GPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import sys
import threading
import time
from collections import deque

import numpy as np

from shared import worker_log
from shared.config import EngineConfig
from shared.control import ChannelClosed, ControlChannel
from shared.finish import FinishReason
from shared.messages import (Cancel, ImagesCopied, Progress, Ready, Released, RequestFailed, Shutdown, Stats,
                             StatsRequest, Submit, to_sampling_params)
from shared.moondream_config import COORD_ID, SIZE_ID
from shared.shm import CACHED_SHIFT, Arena, Kind, RingTimeout, Side, TokenFlag, mask_stamp

from .device import leave_openmp_to_the_streams
from .engine import Engine
from .image_prefill import ImageInput
from .moondream_skills import SkillTask
from .sequence import Sequence
from .step import Tick

log = logging.getLogger("tandem.worker")

FRONTEND_STALE_S = 5.0  # the frontend beats every 100 ms; this long without one means it is gone
# While the host waits for one launch (a long prefill: images on a CPU), a thread keeps the
# heartbeat fresh for up to this long; a launch that takes longer is a hung device.
DEVICE_WAIT_LIMIT_S = 300.0
IDLE_WAIT_S = 0.05
INPUT_WAIT_S = 0.002  # one wait for masks or ring space, between two reads of the control channel


class FrontendGone(SystemExit):
    pass


class Worker:
    """The worker's tick: read every input from the frontend in one place
    (``_gather_inputs``: control messages, acks, the masks and ring space the
    next step needs), run one engine step with them, publish its result
    (``_publish``: ring entry, releases, failures)."""

    def __init__(self, arena: Arena, channel: ControlChannel, config: EngineConfig, generation: int,
                 parent_pid: int, mask_timeout_s: float = 5.0) -> None:
        self.arena = arena
        self.channel = channel
        self.generation = generation
        self.parent_pid = parent_pid
        self.mask_timeout_s = mask_timeout_s
        self.engine = Engine(config)
        device = self.engine.device
        # The copy stream writes sampled ids straight into reserved ring entries
        # (page-locked on CUDA); else the host copies them in at commit.
        self.direct_copy = not device.is_cuda or device.page_lock(arena.buffer, arena.layout.total_bytes)
        if not self.direct_copy:
            log.warning("could not page-lock the arena: sampled ids are copied into the ring by the host")
        self.ring = arena.token_writer()
        self.acks = arena.ack_reader()
        self.masks = arena.mask_reader()
        self.images = arena.image_reader()
        self.seqs: dict[int, Sequence] = {}  # seq_id -> Sequence, until released
        self.mask_rows: dict[int, int] = {}  # seq_id -> its row in the mask region
        self.ended: set[int] = set()  # ended by the frontend (an ack or a cancel), not yet released
        self.spare: deque = deque()  # reserved ring entries, oldest first, for the next copies/commits
        self.entries: dict = {}  # step -> the ring entry its device copy wrote into
        self.mask_requests: list[Sequence] = []  # the previous step's constrained rows
        self._failed: list[RequestFailed] = []
        self._released: list[int] = []
        self._copied: list[int] = []  # tile blocks the frontend may reuse
        self.running = True

    # ------------------------------------------------------------------ liveness
    def frontend_gone(self) -> bool:
        return os.getppid() != self.parent_pid or not self.arena.is_alive(Side.FRONTEND, FRONTEND_STALE_S)

    def _beat(self) -> None:
        self.arena.beat(Side.WORKER)

    def _progress(self, stage: str, done: int = 0, total: int = 0) -> None:
        self.channel.send(Progress(stage=stage, done=done, total=total))
        self.channel.flush()

    # ------------------------------------------------------------------ main loop
    def _beat_while_device_works(self) -> None:
        """Daemon thread: beat while the main loop waits for a launch still within its limit."""
        while self.running:
            since = self.engine.device_wait_since
            if since is not None and time.monotonic() - since < DEVICE_WAIT_LIMIT_S:
                self._beat()
            time.sleep(0.1)

    def run(self) -> None:
        try:
            self._run()
        except ChannelClosed:  # wherever the control channel is read or flushed: the frontend is gone
            raise FrontendGone(3) from None

    def _run(self) -> None:
        threading.Thread(target=self._beat_while_device_works, name="worker-wait-heartbeat", daemon=True).start()
        self.engine.runner.warmup(progress=lambda done, total: self._progress("capturing CUDA graphs", done, total))
        self._beat()
        info = {"model": self.engine.config.model, "device": self.engine.device.spec,
                "max_batch": self.engine.config.max_batch, "max_model_len": self.engine.max_model_len,
                "max_model_len_reason": self.engine.runner.context_reason,
                "pipeline": self.engine.pipelined, "vocab_size": self.engine.vocab_size,
                "kv_pages": self.engine.alloc.pages.capacity, "pid": os.getpid(),
                "vision": self.engine.runner.vision is not None}
        self.channel.send(Ready(generation=self.generation, info=info))
        while self.running:
            words, missing = self._gather_inputs()
            if self.engine.has_work:
                copy_into = [p.token_ids for p in self.spare] if self.direct_copy else None
                self._publish(self.engine.tick(masks=words, masks_missing=missing, copy_into=copy_into))
            self._flush()

    # ------------------------------------------------------------------ inputs
    def _gather_inputs(self):
        """Everything the next step needs from the frontend, read in one place.

        Applies control messages and acks to the engine, reserves the ring
        entries the step's copies and commit write into, and waits for the
        masks of the previous step's constrained rows (stamped for exactly the
        token being sampled; rows of requests the frontend ended are not waited
        for; a row still missing at the timeout fails that request only). While
        it waits it beats and keeps the control channel moving both ways, so a
        slow frontend neither deadlocks nor gets this worker killed as hung.
        Returns (mask words, missing) for ``engine.step``.
        """
        deadline = time.monotonic() + self.mask_timeout_s
        while True:
            self._beat()
            if self.frontend_gone():
                raise FrontendGone(3)
            self._read_control()
            for ev in self.acks.poll():
                self._end(ev.seq_id, ev.reason)
            if not self.engine.has_work:
                select.select([self.channel], [self.channel] if self.channel.unsent_bytes else [], [], IDLE_WAIT_S)
                return None, None
            ring_ready = self._reserve_entries()
            pending = self._pending_masks()
            if ring_ready and (not pending or time.monotonic() > deadline):
                return self._read_masks(pending)
            self.channel.flush()
            if not ring_ready:
                try:
                    self.spare.append(self.ring.reserve(timeout=INPUT_WAIT_S))
                except RingTimeout:
                    pass
            else:
                seq = self.mask_requests[pending[0]]
                row = np.array([self.mask_rows[seq.seq_id]])
                self.masks.wait_rows(row, mask_stamp(seq.seq_id, len(seq.output_ids)), timeout=INPUT_WAIT_S)

    def _read_control(self) -> None:
        messages = self.channel.receive()
        if self.channel.last_error:
            log.error("rejected a control message: %s", self.channel.last_error)
            self.channel.last_error = None
        for msg in messages:
            if isinstance(msg, Submit):
                self._submit(msg)
            elif isinstance(msg, Cancel):
                self._end(msg.seq_id, FinishReason.CANCELLED)
            elif isinstance(msg, StatsRequest):
                stats = {k: v for k, v in self.engine.stats().items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)}
                stats["ring_blocked"] = self.ring.blocked
                loaded = self.engine.lora_stats().get("adapters_loaded", [])
                self.channel.send(Stats(values=stats, adapters_loaded=loaded))
            elif isinstance(msg, Shutdown):
                self.running = False
            else:
                log.error("unexpected control message %s", type(msg).__name__)

    def _submit(self, msg: Submit) -> None:
        try:
            if msg.seq_id in self.seqs:
                raise ValueError(f"seq_id {msg.seq_id} is already live")
            if msg.constrained and not 0 <= msg.mask_row < self.arena.layout.max_batch_rows:
                raise ValueError(f"mask_row {msg.mask_row} is out of range")
            images = [ImageInput(im.hash, self.images.blocks(im.blocks, im.num_tiles), tag=im.blocks,
                                 tiling=tuple(im.tiling) if im.tiling else None)
                      for im in msg.images]
            seq = self.engine.submit(msg.prompt_ids, to_sampling_params(msg), constrained=msg.constrained,
                                     logprobs=msg.logprobs, seq_id=msg.seq_id, adapter=msg.adapter,
                                     top_logprobs=msg.top_logprobs > 0,
                                     images=images, task=skill_task(msg.skill, msg.prompt_ids))
        except ValueError as e:
            self._failed.append(RequestFailed(seq_id=msg.seq_id, code="bad_request", message=str(e)))
            self._released.append(msg.seq_id)
            for im in msg.images:
                self._copied += im.blocks
            return
        self.seqs[msg.seq_id] = seq
        if msg.constrained:
            self.mask_rows[msg.seq_id] = msg.mask_row

    def _end(self, seq_id: int, reason: FinishReason) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finalized:
            self.ended.add(seq_id)
            self.engine.cancel(seq, reason)

    def _reserve_entries(self) -> bool:
        """Hold as many reserved ring entries as the next step may write: one per
        copy (two when a constrained step is finished and the next launched in
        one pipelined tick), or one for the commit when the host copies the ids."""
        need = 2 if self.direct_copy and self.engine.pipelined and self.engine.awaiting_masks else 1
        while len(self.spare) < need:
            p = self.ring.try_reserve()
            if p is None:
                return False
            self.spare.append(p)
        return True

    def _pending_masks(self) -> list[int]:
        """Indices of mask requests whose row is not yet stamped for their next token (one vectorised
        check over the rows, not a shared-memory read per row)."""
        seqs = self.mask_requests
        if not seqs:
            return []
        rows = np.fromiter((self.mask_rows[s.seq_id] for s in seqs), np.int64, len(seqs))
        stamps = np.fromiter((mask_stamp(s.seq_id, len(s.output_ids)) for s in seqs), np.uint64, len(seqs))
        ready = self.masks.stamped_each(rows, stamps)
        return [i for i, s in enumerate(seqs) if not ready[i] and s.seq_id not in self.ended]

    def _read_masks(self, missing_rows: list[int]):
        if not self.mask_requests:
            return None, None
        seqs = self.mask_requests
        words = np.full((len(seqs), self.masks.words_per_row), -1, dtype=np.int32)
        missing = np.zeros(len(seqs), dtype=bool)
        missing[missing_rows] = True
        ready = [i for i, s in enumerate(seqs) if not missing[i] and s.seq_id not in self.ended]
        if ready:
            words[ready] = self.masks.read_rows(np.array([self.mask_rows[seqs[i].seq_id] for i in ready]))
        return words, missing

    # ------------------------------------------------------------------ outputs
    def _publish(self, tick: Tick) -> None:
        """Publish one tick: the committed step's ring entry (token ids already in it when the
        device copied them there), then the releases and failures it produced."""
        for step in tick.copied_steps:
            self.entries[step] = self.spare.popleft()
        for step in tick.dropped_steps:  # a device failure: their entries go out empty
            p = self.entries.pop(step, None)
            if p is not None:
                self.ring.stamp(p, step, Kind.DECODE, [], [])
        c = tick.committed
        if c is not None and c.rows:
            p = self.entries.pop(c.step) if self.direct_copy else self.spare.popleft()
            flags = np.where(c.live, c.finish.astype(np.uint32) | (c.cached.astype(np.uint32) << CACHED_SHIFT),
                             np.uint32(TokenFlag.ZOMBIE))
            seq_ids = np.fromiter((s.seq_id for s in c.seqs), np.uint32, c.rows)
            self.ring.stamp(p, c.step, Kind.PREFILL if c.prefill else Kind.DECODE, seq_ids, flags,
                             c.logprobs, None if self.direct_copy else c.tokens, c.values, c.top)
        self.mask_requests = tick.mask_requests
        for image in tick.tiles_done:
            self._copied += image.tag
        for seq in tick.released:
            self.seqs.pop(seq.seq_id, None)
            self.mask_rows.pop(seq.seq_id, None)
            ended_by_frontend = seq.seq_id in self.ended
            self.ended.discard(seq.seq_id)
            if seq.error and not ended_by_frontend:
                code, _, message = seq.error.partition(": ")
                self._failed.append(RequestFailed(seq_id=seq.seq_id, code=code, message=message))
            self._released.append(seq.seq_id)

    def _flush(self) -> None:
        for msg in self._failed:
            self.channel.send(msg)
        self._failed.clear()
        if self._copied:
            self.channel.send(ImagesCopied(blocks=self._copied))
            self._copied = []
        if self._released:
            self.channel.send(Released(seq_ids=self._released))
            self._released = []
        self.channel.flush()


def skill_task(skill, prompt_ids: list[int]) -> SkillTask | None:
    """A Submit's Moondream skill as the engine's task: the values laid out on the prompt's coord
    and size tokens (ValueError, a bad request, when they do not match)."""
    if skill is None:
        return None
    coord = size = None
    if skill.coords or skill.sizes:
        ids = np.asarray(prompt_ids)
        at_coord, at_size = np.flatnonzero(ids == COORD_ID), np.flatnonzero(ids == SIZE_ID)
        if len(at_coord) != len(skill.coords) or len(at_size) != len(skill.sizes):
            raise ValueError(f"spatial_refs: {len(skill.coords)} coordinates and {len(skill.sizes)} sizes for "
                             f"{len(at_coord)} coord and {len(at_size)} size tokens")
        coord, size = np.zeros(len(ids), np.float32), np.zeros((len(ids), 2), np.float32)
        coord[at_coord] = skill.coords
        size[at_size] = np.asarray(skill.sizes, np.float32).reshape(-1, 2)
    return SkillTask(skill.phase, skill.detect, skill.limit, skill.answer_limit, coord, size)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="gpu_worker", description="Tandem GPU worker (started by the frontend)")
    ap.add_argument("--arena", required=True, help="arena fd spec from Arena.fd_spec()")
    ap.add_argument("--control", type=int, required=True, help="control socket fd")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--generation", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--mask-timeout", type=float, default=5.0)
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    records = logging.StreamHandler()  # stderr: the frontend logs each record as its own
    records.setFormatter(worker_log.Formatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[records])
    arena = Arena.attach_spec(args.arena, expect_generation=args.generation)
    channel = ControlChannel.from_fd(args.control)
    config = EngineConfig(**json.loads(args.config))
    if not config.device.startswith("cuda"):
        leave_openmp_to_the_streams()
    channel.send(Progress(stage=f"loading {config.model} on {config.device}"))
    worker = Worker(arena, channel, config, args.generation, args.parent_pid or os.getppid(), args.mask_timeout)
    try:
        worker.run()
    except FrontendGone:
        log.warning("frontend is gone; exiting")
        sys.exit(3)
    finally:
        worker.engine.device.close()


if __name__ == "__main__":
    main()

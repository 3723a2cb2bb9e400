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
import time

import numpy as np

from shared.control import ChannelClosed, ControlChannel
from shared.messages import (Cancel, Progress, Ready, Released, RequestFailed, Shutdown, Stats, StatsRequest,
                             Submit, to_sampling_params)
from shared.shm import AckKind, Arena, Kind, RingAborted, Side, TokenFlag, mask_stamp

from shared.config import EngineConfig

from .engine import Engine
from .sampler import FLAG_STOP

log = logging.getLogger("tandem.worker")

FRONTEND_STALE_S = 5.0  # the frontend beats every 100 ms; this long without one means it is gone
IDLE_WAIT_S = 0.05


class FrontendGone(SystemExit):
    pass


class Worker:
    def __init__(self, arena: Arena, channel: ControlChannel, config: EngineConfig, generation: int,
                 parent_pid: int, mask_timeout_s: float = 5.0) -> None:
        self.arena = arena
        self.channel = channel
        self.generation = generation
        self.parent_pid = parent_pid
        self.mask_timeout_s = mask_timeout_s
        self.engine = Engine(config, mask_provider=self.masks_for)
        self.engine.on_commit = self._publish
        self.engine.on_release = self._on_release
        device = self.engine.device
        if device.is_cuda and not device.page_lock(arena.buffer, arena.layout.total_bytes):
            log.warning("could not page-lock the arena: sampled ids are copied into the ring by the host")
        else:  # the copy stream writes sampled ids straight into the ring entry
            self.engine.token_sink = self._reserve_entry
        self.eos_ids = np.asarray(self.engine.runner.eos_ids or (-1,), dtype=np.int64)
        self.ring = arena.token_writer()
        self.acks = arena.ack_reader()
        self.masks = arena.mask_reader()
        self.seqs: dict = {}  # seq_id -> Sequence, until released
        self.mask_slots: dict[int, int] = {}
        self.ended: set[int] = set()  # finalize/cancel acks seen, not yet applied by the engine
        self._released: list[int] = []
        self._entries: dict = {}  # step -> reserved ring entry the copy stream writes into
        self._failed: list[RequestFailed] = []
        self._control_inbox: list = []  # control messages read while waiting, applied by the main loop
        self.running = True

    # ------------------------------------------------------------------ liveness
    def frontend_gone(self) -> bool:
        return os.getppid() != self.parent_pid or not self.arena.is_alive(Side.FRONTEND, FRONTEND_STALE_S)

    def _beat(self) -> None:
        self.arena.beat(Side.WORKER)

    def _progress(self, stage: str, done: int = 0, total: int = 0) -> None:
        self.channel.send(Progress(stage=stage, done=done, total=total))
        self.channel.flush()

    def _waiting(self) -> bool:
        """Called while the worker waits on the frontend (ring space, masks). It is
        healthy, so it beats (a stalled frontend must not get it killed as hung), and
        it keeps the control channel moving both ways (messages read now are applied
        by the main loop). True (stop waiting) when the frontend is gone."""
        self._beat()
        try:
            self._control_inbox += self.channel.receive()
            self.channel.flush()
        except ChannelClosed:
            return True
        return self.frontend_gone()

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        self.engine.runner.warmup(progress=lambda done, total: self._progress("capturing CUDA graphs", done, total))
        self._beat()
        info = {"model": self.engine.config.model, "device": self.engine.device.spec,
                "max_batch": self.engine.config.max_batch, "max_model_len": self.engine.max_model_len,
                "pipeline": self.engine.pipelined, "vocab_size": self.engine.vocab_size,
                "kv_pages": self.engine.blocks.pages.capacity, "pid": os.getpid()}
        self.channel.send(Ready(generation=self.generation, info=info))
        while self.running:
            self._beat()
            if self.frontend_gone():
                raise FrontendGone(3)
            self._control()
            self._absorb_acks()
            if self.engine.has_work:
                self.engine.step()
            else:
                select.select([self.channel], [self.channel] if self.channel.unsent_bytes else [], [], IDLE_WAIT_S)
            self._flush()

    def _control(self) -> None:
        try:
            messages = self._control_inbox + self.channel.receive()
        except ChannelClosed:
            raise FrontendGone(3) from None
        self._control_inbox = []
        if self.channel.last_error:
            log.error("rejected a control message: %s", self.channel.last_error)
            self.channel.last_error = None
        for msg in messages:
            if isinstance(msg, Submit):
                self._submit(msg)
            elif isinstance(msg, Cancel):
                self._end(msg.seq_id, "cancelled")
            elif isinstance(msg, StatsRequest):
                stats = {k: v for k, v in self.engine.stats().items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)}
                stats["ring_blocked"] = self.ring.blocked
                self.channel.send(Stats(values=stats))
            elif isinstance(msg, Shutdown):
                self.running = False
            else:
                log.error("unexpected control message %s", type(msg).__name__)

    def _submit(self, msg: Submit) -> None:
        try:
            if msg.seq_id in self.seqs:
                raise ValueError(f"seq_id {msg.seq_id} is already live")
            if msg.constrained and not 0 <= msg.mask_slot < self.arena.layout.max_batch_rows:
                raise ValueError(f"mask_slot {msg.mask_slot} is out of range")
            seq = self.engine.submit(msg.prompt_ids, to_sampling_params(msg), constrained=msg.constrained,
                                     logprobs=msg.logprobs, seq_id=msg.seq_id)
        except ValueError as e:
            self._failed.append(RequestFailed(seq_id=msg.seq_id, code="bad_request", message=str(e)))
            self._released.append(msg.seq_id)
            return
        self.seqs[msg.seq_id] = seq
        if msg.constrained:
            self.mask_slots[msg.seq_id] = msg.mask_slot

    def _end(self, seq_id: int, reason: str) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finalized:
            self.ended.add(seq_id)
            self.engine.cancel(seq, reason)

    def _absorb_acks(self) -> None:
        for ev in self.acks.poll():
            self._end(ev.seq_id, "cancelled" if ev.kind == AckKind.CANCEL else "stop")

    def _flush(self) -> None:
        if self._failed:
            for msg in self._failed:
                self.channel.send(msg)
            self._failed.clear()
        if self._released:
            self.channel.send(Released(seq_ids=self._released))
            self._released = []
        self.channel.flush()

    # ------------------------------------------------------------------ engine hooks
    def _reserve_entry(self, rec):
        """Token sink: reserve step t's ring entry at its finalize, so the copy stream
        writes the sampled ids straight into it (page-locked on CUDA)."""
        self._flush_stale(rec.step)
        p = self._reserve(rec)
        self._entries[rec.step] = p
        return p.token_ids

    def _reserve(self, rec):
        n = len(rec.sample_seqs)
        kind = Kind.PREFILL if rec.kind == "prefill" else Kind.DECODE
        try:
            p = self.ring.reserve(rec.step, kind, n, logprobs=any(s.logprobs for s in rec.sample_seqs),
                                  abort=self._waiting)
        except RingAborted:
            raise FrontendGone(3) from None
        return p

    def _flush_stale(self, step: int) -> None:
        """Entries of steps dropped after a device failure: publish them as all-zombie rows."""
        for old in sorted(k for k in self._entries if k < step):
            p = self._entries.pop(old)
            p.token_ids[:] = 0
            self.ring.commit(p, np.zeros(p.nrows, np.uint32), np.full(p.nrows, int(TokenFlag.ZOMBIE), np.uint32),
                             np.zeros(p.nrows, np.float32) if p.logprobs else None)

    def _publish(self, rec, tokens, flags, logprobs, committed) -> None:
        """Commit hook: stamp the step's ring entry (its token ids are already there).
        Rows of sequences that ended before this commit are flagged ZOMBIE."""
        self._flush_stale(rec.step)
        seqs = rec.sample_seqs
        if not seqs:
            return
        p = self._entries.pop(rec.step, None)
        token_ids = None
        if p is None:  # no direct device copy into the ring: copy the ids here
            p = self._reserve(rec)
            token_ids = tokens[:len(seqs)].astype(np.int32)
        n = len(seqs)
        live = np.zeros(n, dtype=bool)
        live[committed] = True
        stop = (flags & FLAG_STOP) != 0
        eos = stop & np.isin(tokens, self.eos_ids)
        first = np.fromiter((len(s.output_ids) == 1 for s in seqs), bool, n)
        length = np.fromiter((s.finish_reason == "length" for s in seqs), bool, n)
        out = (eos * int(TokenFlag.EOS) | (stop & ~eos) * int(TokenFlag.STOP_TOKEN)
               | first * int(TokenFlag.FIRST) | length * int(TokenFlag.LENGTH)).astype(np.uint32)
        out = np.where(live, out, np.uint32(TokenFlag.ZOMBIE)).astype(np.uint32)
        seq_ids = np.fromiter((s.seq_id for s in seqs), np.uint32, n)
        self.ring.commit(p, seq_ids, out, logprobs[:n].astype(np.float32) if p.logprobs else None, token_ids)

    def _on_release(self, seq) -> None:
        ended_by_frontend = seq.seq_id in self.ended
        self.seqs.pop(seq.seq_id, None)
        self.mask_slots.pop(seq.seq_id, None)
        self.ended.discard(seq.seq_id)
        if seq.error and not ended_by_frontend:
            code, _, message = seq.error.partition(": ")
            self._failed.append(RequestFailed(seq_id=seq.seq_id, code=code, message=message))
        self._released.append(seq.seq_id)

    def masks_for(self, seqs, step):
        """Mask provider: wait for the frontend's rows stamped for exactly the token being sampled.

        Rows of requests the frontend has already ended (an ack arrived) stop
        being waited for. A row still missing at the timeout fails that request
        only; rows of unconstrained requests never come here.
        """
        rows = np.fromiter((self.mask_slots[s.seq_id] for s in seqs), np.int64, len(seqs))
        stamps = [mask_stamp(s.seq_id, len(s.output_ids)) for s in seqs]
        pending = list(range(len(seqs)))
        deadline = time.monotonic() + self.mask_timeout_s
        while True:
            pending = [i for i in pending
                       if not self.masks.stamped(rows[i:i + 1], stamps[i]) and seqs[i].seq_id not in self.ended]
            if not pending or time.monotonic() > deadline:
                break
            self._absorb_acks()
            if self._waiting():
                raise FrontendGone(3)
            i = pending[0]
            self.masks.wait_rows(rows[i:i + 1], stamps[i], timeout=0.002)
        words = np.full((len(seqs), self.masks.words_per_row), -1, dtype=np.int32)
        ready = [i for i in range(len(seqs)) if i not in pending and seqs[i].seq_id not in self.ended]
        if ready:
            words[ready] = self.masks.read_rows(rows[ready])
        failed = np.zeros(len(seqs), dtype=bool)
        failed[pending] = True
        return words, failed


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
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s gpu_worker %(levelname)s %(message)s")
    arena = Arena.attach_spec(args.arena, expect_generation=args.generation)
    channel = ControlChannel.from_fd(args.control)
    config = EngineConfig(**json.loads(args.config))
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

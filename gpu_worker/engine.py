"""The decode loop: blocking or pipelined from the same code.

One tick, pipelined (DESIGN.md 3.2):
    1. launch forward t+1   (inputs gathered on the device from pending tokens)
    2. commit step t        (the only host wait: step t's ids copied to pinned memory)
    3. finalize t+1         (masks that depend on commit t, sample, copy ids to host)
Blocking is the same engine with the order launch t -> finalize t -> commit t,
so the device idles while the host commits and plans.

Invariants (tests/test_engine.py proves them):
- pipelined and blocking produce the same tokens for every request;
- no token of a finalized sequence is delivered (zombie rows are skipped);
- a sequence's row and KV pages are released exactly once, when it is
  finalized and no launched step references it; at idle everything is free;
- ``max_tokens = k`` costs exactly k sampling rows; an EOS at most one zombie row;
- a constrained row is sampled with a mask built after its last commit.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from shared.config import EngineConfig
from shared.sampling import SamplingParams

from .block_manager import BlockManager
from .device import Device, DeviceError
from .model_runner import LaunchInputs, ModelRunner
from .pipeline import Pipeline
from .sampler import FLAG_STOP
from .scheduler import Plan, Scheduler
from .sequence import Sequence

log = logging.getLogger("tandem.engine")

# (constrained sequences, step) -> (int32 bitmask words [n, ceil(V/32)], failed [n] bool or None).
# Called after commit t for the rows sampled at t+1; a failed row ends its request only.
MaskProvider = Callable[[list[Sequence], int], tuple[np.ndarray, "np.ndarray | None"]]


@dataclass
class StepRecord:
    step: int
    slot: int
    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]  # every sequence in the launch
    sample_seqs: list[Sequence]  # one per logits row, in row order
    inputs: LaunchInputs
    marks: list = field(default_factory=list)  # compute-stream marks: forward begin/end, sampling begin/end
    copy_done: object = None
    dropped: bool = False  # discarded after a device failure


@dataclass
class EngineStats:
    steps: int = 0  # committed launches
    decode_steps: int = 0
    prefill_steps: int = 0
    sample_rows: int = 0  # logits rows sampled (useful + zombie)
    zombie_rows: int = 0
    prefill_tokens: int = 0
    committed_tokens: int = 0
    host_s: float = 0.0  # host time inside step(), excluding waits on the device
    wait_s: float = 0.0
    finished: int = 0
    failed: int = 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, mask_provider: MaskProvider | None = None,
                 llama=None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.max_batch < 1 or cfg.page_size < 1 or cfg.prefill_budget < 1:
            raise ValueError("max_batch, page_size and prefill_budget must be >= 1")
        self.device = Device(cfg.device)
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        self.runner = ModelRunner(cfg.model, self.device, cfg.max_batch, cfg.max_model_len, cfg.page_size,
                                  cfg.kv_pages, cfg.kv_memory_fraction, dtype, cfg.cuda_graphs, cfg.debug, llama)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.blocks = BlockManager(self.runner.num_pages, cfg.page_size, cfg.max_batch)
        self.scheduler = Scheduler(self.blocks, cfg.prefill_budget)
        self.pipeline = Pipeline(2)
        self.pipelined = cfg.pipeline
        self.mask_provider = mask_provider
        self.records: deque[StepRecord] = deque()
        self.stats_ = EngineStats()
        self.on_commit: Callable[[StepRecord, np.ndarray, np.ndarray, np.ndarray, list[int]], None] | None = None
        self.on_release: Callable[[Sequence], None] | None = None
        # Optional: where the copy stream should also write a step's sampled ids (int32 [rows]),
        # e.g. straight into a shared-memory ring entry (called at finalize, in step order).
        self.token_sink: Callable[[StepRecord], np.ndarray | None] | None = None
        self._inbox: list[tuple[str, Sequence]] = []
        self._lock = threading.Lock()
        self._next_id = 0

    # ------------------------------------------------------------------ public API
    def submit(self, prompt_ids, params: SamplingParams | None = None, *, constrained: bool = False,
               logprobs: bool = False, on_token=None, seq_id: int | None = None) -> Sequence:
        """Queue a request (thread-safe). Invalid input raises ValueError naming the field."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt)} tokens do not fit the context of {self.max_model_len} "
                             "(prompt + at least one generated token)")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt))
        if self.blocks.pages_for(len(prompt) + max_tokens) > self.blocks.pages.capacity:
            raise ValueError(f"max_tokens: prompt + max_tokens needs more KV pages than the cache has "
                             f"({self.blocks.pages.capacity}); lower max_tokens")
        with self._lock:
            if seq_id is None:
                seq_id = self._next_id
            self._next_id = max(self._next_id, seq_id) + 1
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            seq = Sequence(seq_id, prompt, params, max_tokens, seed, constrained, logprobs, on_token)
            self._inbox.append(("submit", seq))
        return seq

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a request early (thread-safe): cancellation, or a stop the frontend saw."""
        with self._lock:
            self._inbox.append((reason, seq))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 **kw) -> list[Sequence]:
        """Submit every prompt and run until all are done (convenience for tests and the CLI)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.submit(p, sp, **kw) for p, sp in zip(prompts, plist)]
        self.run_until_idle()
        return seqs

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work or not self.pipeline.drained

    @property
    def idle(self) -> bool:
        return not self.has_work and self.blocks.idle

    def stats(self) -> dict:
        s = self.stats_
        b = self.device.bubble
        return {
            **s.__dict__,
            "device": self.device.spec,
            "pipeline": self.pipelined,
            "bubble_idle_s": b.idle_s,
            "bubble_busy_s": b.busy_s,
            "device_idle_fraction": b.idle_fraction,
            "device_overruns": b.overruns,
            "kv_pages_free": self.blocks.pages.num_free,
            "kv_pages_total": self.blocks.pages.capacity,
            "rows_free": self.blocks.rows.num_free,
            "rows_total": self.blocks.rows.capacity,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
        }

    def reset_stats(self) -> None:
        self.stats_ = EngineStats()
        self.device.reset_meter()

    def close(self) -> None:
        try:
            self.device.synchronize()
        finally:
            self.device.close()

    # ------------------------------------------------------------------ the tick
    def step(self) -> bool:
        """One tick. Returns False when there was nothing to do."""
        t0 = time.perf_counter()
        wait0 = self.stats_.wait_s
        self._drain_inbox()
        launched = self._launch() if self.pipeline.can_launch() else None
        committed = False
        if self.pipelined:
            if self.pipeline.in_flight > (1 if launched else 0):
                self._commit()
                committed = True
            if launched and not launched.dropped:
                self._finalize(launched)
        elif launched:
            self._finalize(launched)
            self._commit()
            committed = True
        if not (launched or committed):
            self.device.reset_chain()  # idle: the next gap is not a bubble
            return False
        self.stats_.host_s += (time.perf_counter() - t0) - (self.stats_.wait_s - wait0)
        return True

    def _drain_inbox(self) -> None:
        if not self._inbox:
            return
        with self._lock:
            items, self._inbox = self._inbox, []
        for kind, seq in items:
            if kind == "submit":
                self.scheduler.add(seq)
            elif seq.finalize(kind):
                self._maybe_release(seq)

    # ------------------------------------------------------------------ launch
    def _launch(self) -> StepRecord | None:
        plan, admitted = self.scheduler.plan()
        for seq in admitted:
            self.runner.set_row(seq.row, seq.params, seq.seed, seq.pages)
        if not plan:
            return None
        step, slot = self.pipeline.launch()
        inp, sample_seqs = self._inputs(plan)
        seqs = plan.decode + [c.seq for c in plan.prefill]
        for seq in seqs:
            seq.inflight_refs += 1
        rec = StepRecord(step, slot, "prefill" if plan.prefill else "decode", seqs, sample_seqs, inp)
        rec.marks.append(self.device.mark())
        self.runner.enqueue_forward(slot, inp)
        rec.marks.append(self.device.mark())
        self.records.append(rec)
        return rec

    def _inputs(self, plan: Plan) -> tuple[LaunchInputs, list[Sequence]]:
        """Host metadata of a launch, and the counters it advances."""
        decode = plan.decode
        sample_seqs = list(decode)
        decode_pos = np.fromiter((s.next_position for s in decode), np.int64, len(decode))
        for seq in decode:
            seq.num_dispatched += 1
        sample_pos = list(decode_pos + 1)  # the position of the token each row samples
        logits_index = list(range(len(decode)))
        prefill_ids, chunks = [], []
        offset = len(decode)
        for c in plan.prefill:
            seq = c.seq
            chunks.append((c.start, c.length, seq.pages))
            prefill_ids.extend(seq.prompt_ids[c.start:c.start + c.length])
            offset += c.length
            seq.num_prefilled += c.length
            self.stats_.prefill_tokens += c.length
            if c.final:
                logits_index.append(offset - 1)
                sample_seqs.append(seq)
                sample_pos.append(seq.prompt_len)
                seq.num_dispatched += 1
        params = [s.params for s in sample_seqs]
        inp = LaunchInputs(
            decode_rows=np.fromiter((s.row for s in decode), np.int64, len(decode)),
            decode_pos=decode_pos,
            prefill_ids=np.asarray(prefill_ids, dtype=np.int64),
            prefill_chunks=chunks,
            logits_index=np.asarray(logits_index, dtype=np.int64),
            sample_rows=np.fromiter((s.row for s in sample_seqs), np.int64, len(sample_seqs)),
            sample_pos=np.asarray(sample_pos, dtype=np.int64),
            any_random=any(p.temperature > 0 for p in params),
            any_filter=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            want_logprobs=any(s.logprobs for s in sample_seqs),
        )
        return inp, sample_seqs

    # ------------------------------------------------------------------ finalize sampling
    def _finalize(self, rec: StepRecord) -> None:
        if not rec.sample_seqs:  # a launch of non-final prefill chunks samples nothing
            rec.copy_done = rec.marks[-1]
            return
        sink = self.token_sink(rec) if self.token_sink is not None else None
        constrained = []
        if self.mask_provider is not None:
            # Zombie rows (already finalized) are never queried.
            constrained = [i for i, s in enumerate(rec.sample_seqs) if s.constrained and not s.finalized]
        rec.marks.append(self.device.mark())
        if not constrained:
            self.runner.enqueue_sample(rec.slot, rec.inputs)
        else:
            # Unconstrained rows are sampled first: they never wait for a mask.
            free = np.setdiff1d(np.arange(len(rec.sample_seqs)), constrained)
            if len(free):
                self.runner.enqueue_sample(rec.slot, rec.inputs, free)
                rec.marks.append(self.device.mark())
            # Built now, after the commit of the previous step: never a stale mask.
            words, failed = self.mask_provider([rec.sample_seqs[i] for i in constrained], rec.step)
            if failed is not None:
                for i, bad in zip(constrained, failed):
                    if bad:
                        self._fail(rec.sample_seqs[i], "mask_timeout",
                                   "the constraint mask for this request did not arrive in time")
            if len(free):
                rec.marks.append(self.device.mark())
            self.runner.enqueue_sample(rec.slot, rec.inputs, np.asarray(constrained, dtype=np.int64),
                                       np.ascontiguousarray(words, dtype=np.int32))
        rec.marks.append(self.device.mark())
        rec.copy_done = self.runner.enqueue_copy(rec.slot, rec.inputs, sink)

    # ------------------------------------------------------------------ commit
    def _commit(self) -> None:
        step, slot = self.pipeline.pop_commit()
        rec = self.records.popleft()
        assert rec.step == step, (rec.step, step)
        t = time.perf_counter()
        try:
            rec.copy_done.synchronize()
            error = None
        except DeviceError as e:
            error = e
        self.stats_.wait_s += time.perf_counter() - t
        for seq in rec.seqs:
            seq.inflight_refs -= 1
            assert seq.inflight_refs >= 0, "inflight_refs underflow"
        if error is not None:
            self._device_failed(rec, error)
            return
        self.device.account(rec.marks, rec.copy_done)
        self.stats_.steps += 1
        if rec.kind == "decode":
            self.stats_.decode_steps += 1
        else:
            self.stats_.prefill_steps += 1
        n = len(rec.sample_seqs)
        self.stats_.sample_rows += n
        tokens, flags, logprobs = self.runner.read_step(slot, n)
        now = time.perf_counter()
        committed = []
        for i, seq in enumerate(rec.sample_seqs):
            if seq.finalized:  # a zombie: launched before its end was known
                seq.zombie_rows += 1
                self.stats_.zombie_rows += 1
                continue
            token = int(tokens[i])
            seq.output_ids.append(token)
            if seq.logprobs:
                seq.output_logprobs.append(float(logprobs[i]))
            if seq.t_first_token is None:
                seq.t_first_token = now
            committed.append(i)
            if flags[i] & FLAG_STOP:
                seq.finalize("stop")
            elif len(seq.output_ids) >= seq.max_tokens:
                seq.finalize("length")
            if seq.on_token is not None:
                seq.on_token(seq, token)
        self.stats_.committed_tokens += len(committed)
        if self.on_commit is not None:
            self.on_commit(rec, tokens, flags, logprobs, committed)
        for seq in rec.seqs:
            self._maybe_release(seq)
        self.pipeline.release(step)

    # ------------------------------------------------------------------ release and failure
    def _maybe_release(self, seq: Sequence) -> None:
        """Release a finalized sequence once no launched step references it (exactly once)."""
        if seq.released or not seq.finalized or seq.inflight_refs:
            return
        seq.released = True
        if seq.admitted:
            self.blocks.release(seq.row, seq.pages)
            self.scheduler.remove(seq)
            self.runner.poison_row(seq.row)
        else:  # ended while still queued: it holds nothing but its place in the queue
            self.scheduler.drop_waiting(seq)
        if seq.error is None:
            self.stats_.finished += 1
        if self.on_release is not None:
            self.on_release(seq)

    def _fail(self, seq: Sequence, code: str, message: str) -> None:
        if seq.finalize("error", f"{code}: {message}"):
            self.stats_.failed += 1
            log.warning("request %d failed: %s: %s", seq.seq_id, code, message)

    def _device_failed(self, rec: StepRecord, error: BaseException) -> None:
        """Device work failed: fail the requests of every outstanding step, keep serving."""
        log.error("device work failed at step %d: %r", rec.step, error)
        victims = list(rec.seqs)
        for other in self.records:
            victims += other.seqs
        self.pipeline.release(rec.step)
        while self.records:  # later steps ran on a failed stream: drop them too
            later = self.records.popleft()
            later.dropped = True
            if later.copy_done is not None:
                try:
                    later.copy_done.synchronize()
                except DeviceError:
                    pass
            s, _ = self.pipeline.pop_commit()
            for seq in later.seqs:
                seq.inflight_refs -= 1
            self.pipeline.release(s)
        self.device.recover()
        for seq in victims:
            self._fail(seq, "internal", f"device error: {error}")
        for seq in victims:
            self._maybe_release(seq)

"""The decode loop: blocking or pipelined from the same code.

``Engine.tick(...)`` is one tick: it launches at most one *step* (a forward
and its sampling, numbered from 0) and commits at most one. Its inputs are
explicit arguments (the masks of the constrained rows it samples, the host
arrays its device copies write sampled ids into); its output is a ``Tick``
(``step.py``: the ``CommittedStep``'s tokens and finish reasons, the sequences
released) that the caller publishes.
The engine never calls back into its caller.

One tick, pipelined (docs/DESIGN.md §4.1), each phase a method that returns
what it produced:
    1. ``_sample_constrained``: sample the constrained rows of the step launched
       last tick, with the masks the caller brought (built after the last
       commit), and copy that step's ids to the host
    2. ``_launch``: launch forward t+1 (inputs gathered on the device from
       pending tokens)
    3. ``_commit``: commit step t (the only host wait: step t's ids copied to host)
    4. ``_sample_unconstrained``: sample the rows of t+1 that need no mask at
       once; if it has constrained rows, it is the launch awaiting masks (their
       sequences go out as ``mask_requests``; phase 1 of the next tick samples
       them), else copy its ids now
The device sees [fwd t][sample t][copy t][fwd t+1]...; the host is one forward
ahead. Blocking is the same code with ``pipeline=False``: a tick launches,
samples and commits one step (a constrained step is committed by the next
tick, once its masks have come), so the device idles while the host commits,
publishes and plans.

Images are one room of their own (``image_prefill.py``): the engine calls it
once per event (submit, admission, prefill chunk, commit, release, device
failure) and returns the host tiles it hands back (``tiles_done``).

A Moondream model's skill state and region values are per-row device state
(``moondream_skills.py``): set at admission from the request's ``SkillTask``,
advanced by the sampling phases on the device (no phase waits for the host),
and copied back with the tokens, so the commit returns them beside the tokens
(``CommittedStep.values``).

Invariants (tests/engine/test_engine.py proves them):
- pipelined and blocking produce the same tokens for every request;
- no token of a finalized sequence is delivered (zombie rows are skipped);
- a sequence's row, KV pages and LoRA slot reference are released exactly
  once, when it is finalized and no launched step references it; at idle
  everything is free;
- ``max_tokens = k`` costs exactly k sampling rows; an EOS at most one zombie row;
- a constrained row is sampled with a mask built after its last commit.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable

import numpy as np

from shared.config import EngineConfig
from shared.finish import FinishReason
from shared.sampling import SamplingParams

from .allocator import Allocator
from .device import Device, DeviceError
from .image_prefill import ImageInput, ImagePrefill
from .lora_slots import LoraSlots, token_lora_slots
from .model_runner import LaunchInputs, ModelRunner
from .moondream_skills import SkillTask
from .pipeline import NUM_STEP_BUFFERS, Pipeline
from .sampler import FLAG_LENGTH, FLAG_STOP
from .scheduler import Plan, Scheduler
from .sequence import Sequence
from .stats import EngineStats
from .step import CommittedStep, Launch, Tick

log = logging.getLogger("tandem.engine")

# For in-process use (tests, benchmarks): (sequences needing masks, step) ->
# (int32 bitmask words [n, ceil(V/32)], missing [n] bool or None).
MaskFn = Callable[[list[Sequence], int], tuple[np.ndarray, "np.ndarray | None"]]


class Engine:
    def __init__(self, config: EngineConfig | None = None, llama=None, vision=None, image_params=None,
                 device: Device | None = None) -> None:
        """``device``: streams shared with the process's other engines, which then run one at a time
        (benchmarks on a CPU: one OpenMP thread pool in the process; see ``leave_openmp_to_the_streams``);
        the caller closes it. Else the engine's own, for ``config.device``."""
        self.config = cfg = config or EngineConfig()
        if cfg.max_batch < 1 or cfg.page_size < 1 or cfg.prefill_budget < 1:
            raise ValueError("max_batch, page_size and prefill_budget must be >= 1")
        self._own_device = device is None
        self.device = Device(cfg.device) if device is None else device
        self.runner = ModelRunner(cfg, self.device, llama, vision, image_params)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.alloc = Allocator(self.runner.num_pages, cfg.page_size, cfg.max_batch, cfg.prefix_cache)
        # LoRA adapters (None without --lora): device slots, referenced by sequences like their KV pages.
        self.lora_slots = LoraSlots(cfg.max_loras, self.runner.load_lora) if self.runner.lora else None
        self.scheduler = Scheduler(self.alloc, cfg.prefill_budget, self.lora_slots)
        self.pipeline = Pipeline(NUM_STEP_BUFFERS)  # holds each Launch from launch to commit
        self.pipelined = cfg.pipeline
        self.awaiting_masks: Launch | None = None  # its constrained rows are sampled by the next tick()
        self.stats_ = EngineStats()
        self.images = ImagePrefill(self.runner.vision, self.runner.image_params, self.runner.feature_row_bytes,
                                   int(cfg.encoder_cache_mb * (1 << 20)))
        # monotonic time the host began waiting for a launch (None: not waiting). A long
        # prefill (an image on a CPU) is a wait, not a hang: the worker reads this to keep beating.
        self.device_wait_since: float | None = None
        self._inbox: list[tuple[FinishReason | None, Sequence]] = []  # (None = submit | reason to end)
        self._lock = threading.Lock()
        self._next_id = 0

    # ------------------------------------------------------------------ public API
    def submit(self, prompt_ids, params: SamplingParams | None = None, *, constrained: bool = False,
               logprobs: bool = False, seq_id: int | None = None, adapter: str | None = None,
               images: list[ImageInput] | None = None, task: SkillTask | None = None,
               top_logprobs: bool = False) -> Sequence:
        """Queue a request (thread-safe). Invalid input raises ValueError naming the field.

        ``images``: one per image of the prompt, in prompt order; its ``<image>``
        tokens (as many as the image has feature rows) take their features.
        ``task``: a Moondream model's skill (default: caption/query rules); with an image, the
        prompt's first positions are the image block (its ids are placeholders).
        ``top_logprobs``: also the most likely tokens' logprobs (``CommittedStep.top``)."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)  # its stop ids against this vocabulary (the ranges, again)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt)} tokens do not fit the context of {self.max_model_len} "
                             "(prompt + at least one generated token)")
        room = self.max_model_len - len(prompt)
        kv_room = self.alloc.pages.capacity * self.alloc.page_size - len(prompt)
        if params.max_tokens is None:  # the rest of the context, as far as the KV cache can hold it
            if kv_room < 1:
                raise ValueError(f"prompt: {len(prompt)} tokens need more KV pages than the cache has "
                                 f"({self.alloc.pages.capacity})")
            max_tokens = min(room, kv_room)
        else:
            max_tokens = min(params.max_tokens, room)
            if max_tokens > kv_room:
                raise ValueError(f"max_tokens: prompt + max_tokens needs more KV pages than the cache has "
                                 f"({self.alloc.pages.capacity}); lower max_tokens")
        if self.runner.skills is not None:  # a Moondream model: the caption/query rules by default
            task = (task or SkillTask()).checked(len(prompt), params.temperature)
        elif task is not None:
            raise ValueError("skill: this model has no skills")
        seq_images, positions, whole_spans = self.images.check(prompt, images or [])
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter: unknown adapter {adapter!r}; this server has "
                             f"{', '.join(self.adapters) or 'none'}")
        with self._lock:
            if seq_id is None:
                seq_id = self._next_id
            self._next_id = max(self._next_id, seq_id) + 1
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            seq = Sequence(seq_id, prompt, params, max_tokens, seed, constrained, logprobs or top_logprobs,
                           top_logprobs=top_logprobs, images=seq_images,
                           image_positions=positions, whole_spans=whole_spans, adapter=adapter, task=task)
            self._inbox.append((None, seq))
        return seq

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End a request early (thread-safe): cancellation, or a stop the frontend saw."""
        with self._lock:
            self._inbox.append((FinishReason(reason), seq))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 masks: MaskFn | None = None, **kw) -> list[Sequence]:
        """Submit every prompt and run until all are done (convenience for tests and tools)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.submit(p, sp, **kw) for p, sp in zip(prompts, plist)]
        self.run_until_idle(masks)
        return seqs

    def run_until_idle(self, masks: MaskFn | None = None) -> None:
        """Tick until nothing is left; ``masks`` answers the mask requests of constrained rows
        (without it they are sampled unconstrained)."""
        words = missing = None
        while self.has_work:
            tick = self.tick(masks=words, masks_missing=missing)
            words = missing = None
            if tick.mask_requests:
                if masks is not None:
                    words, missing = masks(tick.mask_requests, tick.mask_step)
                else:
                    words = np.full((len(tick.mask_requests), self.runner.mask_words), -1, dtype=np.int32)

    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work or not self.pipeline.drained

    @property
    def idle(self) -> bool:
        return not self.has_work and self.alloc.idle and (self.lora_slots is None or self.lora_slots.idle)

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters this engine serves."""
        return list(self.runner.lora.specs) if self.runner.lora else []

    def lora_stats(self) -> dict:
        if self.lora_slots is None:
            return {}
        return {**self.lora_slots.stats(), "adapters": self.adapters,
                "adapters_loaded": sorted(self.lora_slots.slot_of)}

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
            "device_overruns": b.overruns,  # sim: steps whose real CPU work did not fit the simulated time
            **self.alloc.stats(),
            "cuda_graphs": len(self.runner.graphs),
            "graphs_in_place": sum(g.in_place for g in self.runner.graphs.values()),
            "graph_capture_s": self.runner.graph_capture_s,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            **self.images.stats(),
            **self.lora_stats(),
        }

    def reset_stats(self) -> None:
        self.stats_ = EngineStats()
        self.images.reset_stats()
        self.device.reset_meter()

    def close(self) -> None:
        try:
            self.device.synchronize()
        finally:
            if self._own_device:
                self.device.close()

    # ------------------------------------------------------------------ the tick
    def tick(self, masks: np.ndarray | None = None, masks_missing: np.ndarray | None = None,
             copy_into: list[np.ndarray] | None = None) -> Tick:
        """One tick.

        Inputs:
        - ``masks``: int32 bitmask words, one row per sequence of the previous
          tick's ``mask_requests`` (built after that tick's commit);
          ``masks_missing`` (bool per row) fails the rows whose mask never came.
        - ``copy_into``: int32 host arrays (``max_batch`` long or more) that the
          tick's device->host copies also write sampled ids into, used in order
          (at most two per tick): the worker passes reserved token-ring entries,
          so sampled ids land in shared memory with no host copy.
          ``tick.copied_steps`` says which step used which.
        """
        t0 = time.perf_counter()
        wait0 = self.stats_.wait_s
        targets = list(copy_into or ())
        tick = Tick(released=self._take_inbox())
        finished = launched = commit = None
        if self.awaiting_masks is not None:  # 1.
            finished = self._sample_constrained(masks, masks_missing, targets)
        if self.pipelined:
            launched = self._launch() if self.pipeline.can_launch() else None  # 2.
            if self.pipeline.in_flight > (launched is not None):
                commit = self._commit()  # 3.
            if launched is not None and not launched.dropped:
                self.awaiting_masks = self._sample_unconstrained(launched, targets)  # 4.
        elif finished is not None:  # blocking: the constrained step is committed now, the next launch waits a tick
            commit = self._commit()
        else:
            launched = self._launch() if self.pipeline.can_launch() else None
            if launched is not None:
                self.awaiting_masks = self._sample_unconstrained(launched, targets)
                if self.awaiting_masks is None:
                    commit = self._commit()
        if commit is not None:
            tick.committed, released, tick.dropped_steps = commit
            tick.released += released
        tick.copied_steps = [launch.step for launch in (finished, launched)
                             if launch is not None and launch.copy_into is not None]
        if self.awaiting_masks is not None:
            tick.mask_requests = [self.awaiting_masks.sample_seqs[i] for i in self.awaiting_masks.constrained]
            tick.mask_step = self.awaiting_masks.step
        tick.tiles_done = self.images.take_handed_back()
        if not (finished or launched or tick.committed or tick.released or tick.dropped_steps):
            self.device.reset_chain()  # idle: the next gap is not a bubble
        self.stats_.host_s += (time.perf_counter() - t0) - (self.stats_.wait_s - wait0)
        return tick

    def _take_inbox(self) -> list[Sequence]:
        """Submits join the queue; ends are applied. Returns the sequences released by them."""
        if not self._inbox:
            return []
        with self._lock:
            items, self._inbox = self._inbox, []
        released = []
        for reason, seq in items:
            if reason is None:
                self.scheduler.add(seq)
            elif seq.finalize(reason) and self._release_if_done(seq):
                released.append(seq)
        return released

    # ------------------------------------------------------------------ launch
    def _launch(self) -> Launch | None:
        plan, admitted = self.scheduler.plan()
        for seq in admitted:
            self.runner.set_row(seq.row, seq.params, seq.seed, seq.pages, seq.task, seq.prompt_ids)
            if seq.kv_copy is not None:
                self.runner.copy_kv_rows(*seq.kv_copy)
            self.stats_.prefix_query_tokens += seq.prompt_len
            self.stats_.prefix_hit_tokens += seq.cached_tokens
            if seq.images:
                self.images.admit(seq)
        if not plan:
            return None
        seqs = plan.decode + [c.seq for c in plan.prefill]
        launch = Launch(bool(plan.prefill), seqs, [])
        launch.inputs, launch.sample_seqs = inp, _ = self._inputs(plan, launch)
        launch.kv_ends = [int(p) + 1 for p in inp.decode_pos] + [c.start + c.length for c in plan.prefill]
        launch.step, launch.step_buffer = self.pipeline.launch(launch)
        for seq in seqs:
            seq.inflight_refs += 1
        if self.lora_slots is not None:
            self.lora_slots.launched(s.lora_slot for s in seqs)
        if self.config.debug:
            self.alloc.check_exclusive(seqs, inp.decode_pos, plan.prefill)
        launch.marks.append(self.device.mark())
        self.runner.enqueue_forward(launch.step_buffer, inp)
        launch.marks.append(self.device.mark())
        return launch

    def _inputs(self, plan: Plan, launch: Launch) -> tuple[LaunchInputs, list[Sequence]]:
        """Host metadata of a launch, and the counters it advances."""
        decode = plan.decode
        sample_seqs = list(decode)
        decode_pos = np.fromiter((s.next_position for s in decode), np.int64, len(decode))
        for seq in decode:
            seq.num_dispatched += 1
        sample_pos = list(decode_pos + 1)  # the position of the token each row samples
        logits_index = list(range(len(decode)))
        prefill_ids, chunks = [], []
        ref_values = []  # Moondream: (first prefill token, coord, size) of the chunks with spatial refs
        offset = len(decode)
        for c in plan.prefill:
            seq = c.seq
            chunks.append((c.start, c.length, seq.pages))
            prefill_ids.extend(seq.prompt_ids[c.start:c.start + c.length])
            if seq.task is not None and seq.task.prompt_coord is not None:
                ref_values.append((len(prefill_ids) - c.length, seq.task.prompt_coord[c.start:c.start + c.length],
                                   seq.task.prompt_size[c.start:c.start + c.length]))
            if seq.images:
                launch.images = self.images.add_chunk(launch.images, c, offset)
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
            any_filter=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0) for p in params),
            want_logprobs=any(s.logprobs for s in sample_seqs),
            want_top=any(s.top_logprobs for s in sample_seqs),
            any_bias=any(p.logit_bias for p in params),
            any_penalty=any(p.penalized for p in params),
            seen_width=max(sample_pos, default=0) or None,  # a row has seen at most the tokens before it
            any_min_tokens=any(pos < s.prompt_len + s.params.min_tokens for s, pos in zip(sample_seqs, sample_pos)),
            token_lora=token_lora_slots(plan) if self.lora_slots is not None else None,
            **(launch.images.inputs() if launch.images else {}),
        )
        if ref_values:
            inp.prefill_coord = np.zeros(len(prefill_ids), np.float32)
            inp.prefill_size = np.zeros((len(prefill_ids), 2), np.float32)
            for start, coord, size in ref_values:
                inp.prefill_coord[start:start + len(coord)] = coord
                inp.prefill_size[start:start + len(size)] = size
        return inp, sample_seqs

    # ------------------------------------------------------------------ sampling
    def _sample_constrained(self, words: np.ndarray | None, missing: np.ndarray | None,
                            targets: list[np.ndarray]) -> Launch:
        """Phase 1: sample the rows of the launch awaiting masks (built after the previous
        commit), then copy its step. Returns that launch."""
        launch, self.awaiting_masks = self.awaiting_masks, None
        rows = launch.constrained
        if words is None or len(words) != len(rows):
            raise ValueError(f"step {launch.step} needs masks for {len(rows)} constrained rows")
        if missing is not None:
            for i, gone in zip(rows, missing):
                if gone:
                    self._fail(launch.sample_seqs[i], "mask_timeout",
                               "the constraint mask for this request did not arrive in time")
        launch.marks.append(self.device.mark())
        self.runner.enqueue_sample(launch.step_buffer, launch.inputs, rows, np.ascontiguousarray(words, dtype=np.int32))
        launch.marks.append(self.device.mark())
        self._enqueue_copy(launch, targets)
        return launch

    def _sample_unconstrained(self, launch: Launch, targets: list[np.ndarray]) -> Launch | None:
        """Phase 4: sample the rows that need no mask now and, if none waits for a mask, copy the
        step. Returns the launch if some of its rows await the caller's masks, else None."""
        if not launch.sample_seqs:  # a launch of non-final prefill chunks samples nothing
            launch.copy_done = launch.marks[-1]
            return None
        # Zombie rows (already finalized) never wait for a mask.
        constrained = np.fromiter((i for i, s in enumerate(launch.sample_seqs) if s.constrained and not s.finalized),
                                  np.int64)
        launch.marks.append(self.device.mark())
        if not len(constrained):
            self.runner.enqueue_sample(launch.step_buffer, launch.inputs)
            launch.marks.append(self.device.mark())
            self._enqueue_copy(launch, targets)
            return None
        free = np.setdiff1d(np.arange(len(launch.sample_seqs)), constrained)
        if len(free):
            self.runner.enqueue_sample(launch.step_buffer, launch.inputs, free)
        launch.marks.append(self.device.mark())
        launch.constrained = constrained
        return launch

    def _enqueue_copy(self, launch: Launch, targets: list[np.ndarray]) -> None:
        """The step's ids to the host, and into the caller's next host array if one is left."""
        launch.copy_into = targets.pop(0) if targets else None
        launch.copy_done = self.runner.enqueue_copy(launch.step_buffer, launch.inputs, launch.copy_into)

    # ------------------------------------------------------------------ commit
    def _commit(self) -> tuple[CommittedStep | None, list[Sequence], list[int]]:
        """Phase 3: commit the oldest launched step. Returns it (None if its device work failed),
        the sequences released, and the steps dropped after a device failure."""
        step, step_buffer, launch = self.pipeline.pop_commit()
        assert launch.copy_done is not None, step
        t = time.perf_counter()
        self.device_wait_since = time.monotonic()
        try:
            launch.copy_done.synchronize()
            error = None
        except DeviceError as e:
            error = e
        finally:
            self.device_wait_since = None
        self.stats_.wait_s += time.perf_counter() - t
        self._unref(launch)
        if error is not None:
            return (None, *self._device_failed(launch, error))
        self.device.account(launch.marks, launch.copy_done)
        self._count(launch)
        if launch.images:
            self.images.committed(launch.images)
        n = len(launch.sample_seqs)
        tokens, flags, logprobs, values, top = self.runner.read_step(step_buffer, n, launch.inputs.want_top)
        live, finish, cached = self._commit_rows(launch.sample_seqs, tokens, flags, logprobs, values)
        committed = CommittedStep(step, launch.prefill, launch.sample_seqs, tokens.astype(np.int32), finish, live,
                                  cached, logprobs.astype(np.float32) if launch.inputs.want_logprobs else None,
                                  values, top)
        released = []
        for seq, end in zip(launch.seqs, launch.kv_ends):
            seq.kv_committed = max(seq.kv_committed, end)
            if self.alloc.pages.caching:
                self.alloc.name_full_pages(seq)
            if self._release_if_done(seq):
                released.append(seq)
        self.pipeline.release(step)
        return committed, released, []

    def _unref(self, launch: Launch) -> None:
        """The launch is committed or dropped: it no longer references its sequences or LoRA slots."""
        for seq in launch.seqs:
            seq.inflight_refs -= 1
            assert seq.inflight_refs >= 0, "inflight_refs underflow"
        if self.lora_slots is not None:
            self.lora_slots.committed(s.lora_slot for s in launch.seqs)

    def _count(self, launch: Launch) -> None:
        s = self.stats_
        s.steps += 1
        if launch.prefill:
            s.prefill_steps += 1
        else:
            s.decode_steps += 1
        s.sample_rows += len(launch.sample_seqs)

    def _commit_rows(self, seqs: list[Sequence], tokens, flags, logprobs, values):
        """Append each live row's token to its sequence and end it on a stop or its length cap.
        Returns (live, finish reason, cached prompt tokens on first tokens) per row."""
        n = len(seqs)
        live = np.ones(n, dtype=bool)
        finish = np.zeros(n, dtype=np.uint8)
        cached = np.zeros(n, dtype=np.int32)
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            if seq.finalized:  # a zombie: launched before its end was known
                live[i] = False
                seq.zombie_rows += 1
                continue
            seq.output_ids.append(int(tokens[i]))
            if seq.logprobs:
                seq.output_logprobs.append(float(logprobs[i]))
            if values is not None:
                seq.output_values.append(tuple(float(v) for v in values[i]))
            if seq.t_first_token is None:
                seq.t_first_token = now
                cached[i] = seq.cached_tokens
            if flags[i] & FLAG_STOP:
                seq.finalize(FinishReason.STOP)
            elif flags[i] & FLAG_LENGTH or len(seq.output_ids) >= seq.max_tokens:
                seq.finalize(FinishReason.LENGTH)
            finish[i] = seq.finish_reason
        zombies = n - int(live.sum())
        self.stats_.zombie_rows += zombies
        self.stats_.committed_tokens += n - zombies
        return live, finish, cached

    # ------------------------------------------------------------------ release and failure
    def _release_if_done(self, seq: Sequence) -> bool:
        """Release a finalized sequence once no launched step references it (exactly once).
        Returns whether it was released now."""
        if seq.released or not seq.finalized or seq.inflight_refs:
            return False
        seq.released = True
        if seq.images:
            self.images.release(seq)
        if seq.admitted:
            self.alloc.release(seq.row, seq.pages)
            if seq.lora_slot:
                self.lora_slots.release(seq.lora_slot)
            self.scheduler.remove(seq)
            self.runner.poison_row(seq.row)
        else:  # ended while still queued: it holds nothing but its place in the queue
            self.scheduler.drop_waiting(seq)
        if seq.error is None:
            self.stats_.finished += 1
        return True

    def _fail(self, seq: Sequence, code: str, message: str) -> None:
        if seq.finalize(FinishReason.ERROR, f"{code}: {message}"):
            self.stats_.failed += 1
            log.warning("request %d failed: %s: %s", seq.seq_id, code, message)

    def _device_failed(self, launch: Launch, error: BaseException) -> tuple[list[Sequence], list[int]]:
        """Device work failed: fail the requests of every outstanding step, keep serving.
        Returns the sequences released and the steps dropped."""
        log.error("device work failed at step %d: %r", launch.step, error)
        victims, dropped = list(launch.seqs), [launch.step]
        self.pipeline.release(launch.step)
        self.awaiting_masks = None
        while self.pipeline.in_flight:  # later steps ran on a failed stream: drop them too
            step, _, later = self.pipeline.pop_commit()
            later.dropped = True
            victims += later.seqs
            if later.copy_done is not None:
                try:
                    later.copy_done.synchronize()
                except DeviceError:
                    pass
            self._unref(later)
            self.pipeline.release(step)
            dropped.append(step)
        self.device.recover()
        victims += self.images.device_failed(self.scheduler.running)
        for seq in victims:
            self._fail(seq, "internal", f"device error: {error}")
        return [seq for seq in victims if self._release_if_done(seq)], dropped

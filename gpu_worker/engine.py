"""The decode loop: blocking or pipelined from the same code.

``Engine.step(...)`` is one tick. Its inputs are explicit arguments (the
masks of the constrained rows it samples, the host arrays its device copies
write sampled ids into); its output is a ``StepResult`` (the committed step's
tokens and finish reasons, the sequences released) that the caller publishes.
The engine never calls back into its caller.

One tick, pipelined (docs/DESIGN.md §4.1):
    1. sample the constrained rows of the step launched last tick, with the
       masks the caller brought (built after the last commit), and copy that
       step's ids to the host
    2. launch forward t+1   (inputs gathered on the device from pending tokens)
    3. commit step t        (the only host wait: step t's ids copied to host)
    4. sample the unconstrained rows of t+1 at once; if it has constrained rows,
       return them as ``mask_requests`` (step 1 of the next tick samples them),
       else copy its ids now
The device sees [fwd t][sample t][copy t][fwd t+1]...; the host is one forward
ahead. Blocking is the same code with ``pipeline=False``: a tick launches,
samples and commits one step (a constrained step is committed by the next
tick, once its masks have come), so the device idles while the host commits,
publishes and plans.

Images (DESIGN.md §6a): a request may carry images (``submit(images=...)``).
At admission each takes a reference to its encoder-cache entry (a hit, or a
new entry on a miss). A launch encodes only the tiles its prefill chunks reach
that no launch has enqueued yet (a chunk whose image rows end inside tile t
needs tiles up to t), on the compute stream, before its text forward (one
vision forward for all of the launch's tiles), so the prefill budget bounds
the encoder work too: at most ceil(budget / tokens_per_tile) + 1 tiles per
chunk. The tiles come from the host tiles of the request whose chunk reaches
them first; their rows land in the entry's preallocated features, and stream
order makes them readable by every later launch. A chunk may split an image
span; the reference keeps the features until the request's last prefill
chunk has been committed. Host tiles are handed back (``StepResult.tiles_done``)
once the engine will never read them: every tile the request still needs is
enqueued (by it or by another request) and no uncommitted launch copies from
them, checked at admission, when a chunk reaches the image and when a launch
that copied them commits; or at the request's release.

Invariants (tests/test_engine.py proves them):
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
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from shared.config import EngineConfig
from shared.finish import FinishReason
from shared.sampling import SamplingParams

from .allocator import Allocator
from .device import Device, DeviceError
from .encoder_cache import EncoderCache
from .lora_slots import LoraSlots
from .model_runner import LaunchInputs, ModelRunner
from .pipeline import NUM_SLOTS, Pipeline
from .prefix_cache import ROOT, chain
from .moondream_skills import ANSWER_FIRST, DECIDE, REASON, SkillTask
from .sampler import FLAG_LENGTH, FLAG_STOP
from .scheduler import Plan, Scheduler
from .sequence import ImageInput, SeqImage, Sequence
from .vision import image_rows_in_chunk

log = logging.getLogger("tandem.engine")

# For in-process use (tests, benchmarks): (sequences needing masks, step) ->
# (int32 bitmask words [n, ceil(V/32)], missing [n] bool or None).
MaskFn = Callable[[list[Sequence], int], tuple[np.ndarray, "np.ndarray | None"]]


@dataclass
class Launch:
    """One launched step, from launch to commit."""
    step: int
    slot: int
    prefill: bool  # the launch holds prefill chunks (else pure decode)
    seqs: list[Sequence]  # every sequence in the launch
    kv_ends: list[int]  # per sequence of ``seqs``: the end of the positions whose KV this launch writes
    sample_seqs: list[Sequence]  # one per logits row, in row order
    inputs: LaunchInputs
    marks: list = field(default_factory=list)  # compute-stream marks: forward begin/end, sampling begin/end
    constrained: np.ndarray | None = None  # sampling rows still waiting for their masks
    copy_done: object = None  # the device->host copy's event: what the commit waits on
    dropped: bool = False  # discarded after a device failure
    encoded: list = field(default_factory=list)  # (SeqImage, tiles) encoded from its host tiles by this launch
    prefill_ended: list[Sequence] = field(default_factory=list)  # sequences whose last prefill chunk is in it


@dataclass
class StepResult:
    """What one tick produced. Row arrays are aligned with ``seqs``."""
    step: int | None = None  # the committed step; None when this tick committed nothing
    prefill: bool = False
    seqs: list[Sequence] = field(default_factory=list)  # one per sampled row
    tokens: np.ndarray | None = None  # int32
    finish: np.ndarray | None = None  # uint8 FinishReason of the row's token (NONE: the request runs on)
    live: np.ndarray | None = None  # bool; False = a zombie row (its request ended before this commit)
    cached: np.ndarray | None = None  # int32: on a request's first token, its prompt tokens from the prefix cache
    logprobs: np.ndarray | None = None  # float32, when any row asked for them
    values: np.ndarray | None = None  # float32 [rows, 3], Moondream: each token's region values (coord, w, h)
    released: list[Sequence] = field(default_factory=list)  # resources freed this tick (exactly once each)
    copied_steps: list[int] = field(default_factory=list)  # the steps whose ids went into ``copy_into``, in order
    dropped_steps: list[int] = field(default_factory=list)  # steps discarded after a device failure
    mask_requests: list[Sequence] = field(default_factory=list)  # the next step() must bring their masks
    mask_step: int | None = None  # the step those masks are for
    tiles_done: list[ImageInput] = field(default_factory=list)  # host tiles never read again (free their memory)

    @property
    def rows(self) -> int:
        return len(self.seqs)


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
    prefix_query_tokens: int = 0  # prompt tokens of admitted requests
    prefix_hit_tokens: int = 0  # ... of which mapped from the prefix cache
    encoder_launches: int = 0  # vision forwards (one per launch that encodes tiles)
    encoded_images: int = 0  # images whose last missing tile was enqueued
    encoded_tiles: int = 0
    image_tokens: int = 0  # prompt positions filled by image features


class Engine:
    def __init__(self, config: EngineConfig | None = None, llama=None, vision=None, image_params=None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.max_batch < 1 or cfg.page_size < 1 or cfg.prefill_budget < 1:
            raise ValueError("max_batch, page_size and prefill_budget must be >= 1")
        self.device = Device(cfg.device)
        self.runner = ModelRunner(cfg, self.device, llama, vision, image_params)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.alloc = Allocator(self.runner.num_pages, cfg.page_size, cfg.max_batch, cfg.prefix_cache)
        # LoRA adapters (None without --lora): device slots, referenced by sequences like their KV pages.
        self.lora_slots = LoraSlots(cfg.max_loras, self.runner.load_lora) if self.runner.lora else None
        self.scheduler = Scheduler(self.alloc, cfg.prefill_budget, self.lora_slots)
        self.pipeline = Pipeline(NUM_SLOTS)
        self.pipelined = cfg.pipeline
        self.launches: deque[Launch] = deque()  # launched, not yet committed, in step order
        self.awaiting_masks: Launch | None = None  # its constrained rows are sampled by the next step()
        self.stats_ = EngineStats()
        self.encoder_cache = EncoderCache(int(cfg.encoder_cache_mb * (1 << 20)))
        # monotonic time the host began waiting for a launch (None: not waiting). A long
        # prefill (an image on a CPU) is a wait, not a hang: the worker reads this to keep beating.
        self.device_wait_since: float | None = None
        self._inbox: list[tuple[FinishReason | None, Sequence]] = []  # (None = submit | reason to end)
        self._lock = threading.Lock()
        self._next_id = 0

    # ------------------------------------------------------------------ public API
    def submit(self, prompt_ids, params: SamplingParams | None = None, *, constrained: bool = False,
               logprobs: bool = False, seq_id: int | None = None, adapter: str | None = None,
               images: list[ImageInput] | None = None, task: SkillTask | None = None) -> Sequence:
        """Queue a request (thread-safe). Invalid input raises ValueError naming the field.

        ``images``: one per image of the prompt, in prompt order; its ``<image>``
        tokens (``num_tiles * tokens_per_tile`` each) take their features.
        ``task``: a Moondream model's skill (default: caption/query rules); with an image, the
        prompt's first ``prefix_len`` positions are the image block (its ids are placeholders)."""
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
        if self.alloc.pages_for(len(prompt) + max_tokens) > self.alloc.pages.capacity:
            raise ValueError(f"max_tokens: prompt + max_tokens needs more KV pages than the cache has "
                             f"({self.alloc.pages.capacity}); lower max_tokens")
        task = self._check_task(task, prompt, params)
        seq_images, positions = self._check_images(prompt, images or [])
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter: unknown adapter {adapter!r}; this server has "
                             f"{', '.join(self.adapters) or 'none'}")
        with self._lock:
            if seq_id is None:
                seq_id = self._next_id
            self._next_id = max(self._next_id, seq_id) + 1
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            seq = Sequence(seq_id, prompt, params, max_tokens, seed, constrained, logprobs, seq_images, positions,
                           adapter, task)
            self._inbox.append((None, seq))
        return seq

    def _check_task(self, task: SkillTask | None, prompt: list[int], params: SamplingParams) -> SkillTask | None:
        if self.runner.moondream is None:
            if task is not None:
                raise ValueError("skill: this model has no skills")
            return None
        task = task or SkillTask()
        if task.phase not in (ANSWER_FIRST, REASON, DECIDE) or min(task.limit, task.answer_limit) < 0:
            raise ValueError(f"skill: phase {task.phase} / limits {task.limit}, {task.answer_limit} are invalid")
        if task.phase == DECIDE and params.temperature != 0:
            raise ValueError("temperature: point and detect are greedy (temperature 0)")
        for name, values, shape in (("coord", task.prompt_coord, (len(prompt),)),
                                    ("size", task.prompt_size, (len(prompt), 2))):
            if values is not None and (values.dtype != np.float32 or values.shape != shape):
                raise ValueError(f"spatial_refs: {name} values must be float32 {list(shape)}")
        return task

    def _check_moondream_images(self, prompt: list[int], images: list[ImageInput]):
        """One image at most, its crops uint8 [1 + t_h·t_w, 3, S, S] (in blocks) with its tiling; it is
        one "tile" of the encoder cache (the crops are encoded together); its block is the prompt's
        first positions."""
        if not images:
            return [], None
        crop = self.runner.moondream.spec.vision.crop_size
        if len(images) > 1:
            raise ValueError("images: Moondream takes one image per request")
        image = images[0]
        t_h, t_w = image.tiling or (0, 0)
        if (image.tiling is None or image.num_tiles != 1 + t_h * t_w
                or any(b.dtype != np.uint8 or b.shape[1:] != (3, crop, crop) for b in image.tiles)):
            raise ValueError(f"images[0]: a Moondream image is 1 + rows x columns uint8 crops [3, {crop}, {crop}] "
                             "with its tiling")
        rows = self.runner.tokens_per_tile
        if len(prompt) <= rows:
            raise ValueError(f"prompt: an image prompt starts with the {rows}-position image block")
        return [SeqImage(image, 0, rows)], np.arange(rows)

    def _check_images(self, prompt: list[int], images: list[ImageInput]) -> tuple[list[SeqImage], np.ndarray | None]:
        if self.runner.moondream is not None:
            return self._check_moondream_images(prompt, images)
        vision, ip = self.runner.vision, self.runner.image_params
        if vision is None:
            if images:
                raise ValueError("images: this model takes no images")
            return [], None
        positions = np.flatnonzero(np.asarray(prompt) == ip.image_token_id)
        side = ip.tile_size
        seq_images, row = [], 0
        for i, image in enumerate(images):
            for block in image.tiles:
                if block.dtype != np.uint8 or block.ndim != 4 or block.shape[1:] != (3, side, side):
                    raise ValueError(f"images[{i}]: tiles must be uint8 [n, 3, {side}, {side}], "
                                     f"got {block.dtype} {list(block.shape)}")
            if image.num_tiles < 1:
                raise ValueError(f"images[{i}]: no tiles")
            rows = image.num_tiles * vision.tokens_per_tile
            seq_images.append(SeqImage(image, row, rows))
            row += rows
        if row != len(positions):
            raise ValueError(f"images: the prompt has {len(positions)} image tokens but the images have {row} "
                             "feature rows")
        return seq_images, (positions if images else None)

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
            result = self.step(masks=words, masks_missing=missing)
            words = missing = None
            if result.mask_requests:
                if masks is not None:
                    words, missing = masks(result.mask_requests, result.mask_step)
                else:
                    words = np.full((len(result.mask_requests), self.runner.mask_words), -1, dtype=np.int32)

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
            "kv_pages_free": self.alloc.pages.num_free,  # free or cached: what an allocation can take
            "kv_pages_total": self.alloc.pages.capacity,
            "kv_pages_cached": self.alloc.pages.num_cached,
            "prefix_cache_evictions": self.alloc.pages.evictions,
            "rows_free": self.alloc.rows.num_free,
            "rows_total": self.alloc.rows.capacity,
            "cuda_graphs": len(self.runner.graphs),
            "graph_capture_s": self.runner.graph_capture_s,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            **self.encoder_cache.stats(),
            **self.lora_stats(),
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
    def step(self, masks: np.ndarray | None = None, masks_missing: np.ndarray | None = None,
             copy_into: list[np.ndarray] | None = None) -> StepResult:
        """One tick.

        Inputs:
        - ``masks``: int32 bitmask words, one row per sequence of the previous
          result's ``mask_requests`` (built after that result's commit);
          ``masks_missing`` (bool per row) fails the rows whose mask never came.
        - ``copy_into``: int32 host arrays (``max_batch`` long or more) that the
          tick's device->host copies also write sampled ids into, used in order
          (at most two per tick): the worker passes reserved token-ring entries,
          so sampled ids land in shared memory with no host copy.
          ``result.copied_steps`` says which step used which.
        """
        t0 = time.perf_counter()
        wait0 = self.stats_.wait_s
        result = StepResult()
        self._result = result
        self._copy_into = list(copy_into or ())
        self._drain_inbox()
        finished_launch = False
        if self.awaiting_masks is not None:
            self._sample_constrained(self.awaiting_masks, masks, masks_missing)
            finished_launch = True
        if self.pipelined:
            launched = self._launch() if self.pipeline.can_launch() else None
            if self.pipeline.in_flight > (1 if launched else 0):
                self._commit()
            if launched is not None and not launched.dropped:
                self._sample_unconstrained(launched)
        elif finished_launch:  # blocking: the constrained step is committed now, the next launch waits a tick
            self._commit()
            launched = None
        else:
            launched = self._launch() if self.pipeline.can_launch() else None
            if launched is not None:
                self._sample_unconstrained(launched)
                if self.awaiting_masks is None:
                    self._commit()
        if not (launched or finished_launch or result.step is not None or result.released
                or result.dropped_steps):
            self.device.reset_chain()  # idle: the next gap is not a bubble
        self.stats_.host_s += (time.perf_counter() - t0) - (self.stats_.wait_s - wait0)
        self._result = None
        return result

    def _drain_inbox(self) -> None:
        if not self._inbox:
            return
        with self._lock:
            items, self._inbox = self._inbox, []
        for reason, seq in items:
            if reason is None:
                self.scheduler.add(seq)
                self.stats_.image_tokens += seq.image_tokens
            elif seq.finalize(reason):
                self._maybe_release(seq)

    # ------------------------------------------------------------------ launch
    def _launch(self) -> Launch | None:
        plan, admitted = self.scheduler.plan()
        for seq in admitted:
            self.runner.set_row(seq.row, seq.params, seq.seed, seq.pages, seq.task)
            self.stats_.prefix_query_tokens += seq.prompt_len
            self.stats_.prefix_hit_tokens += seq.cached_tokens
            for image in seq.images:
                if int(seq.image_positions[image.row_end - 1]) < seq.cached_tokens:
                    self._tiles_done(image)  # wholly in the prefix-cache hit: its KV is there already
                else:
                    self._acquire_features(seq, image)
        if not plan:
            return None
        step, slot = self.pipeline.launch()
        launch = Launch(step, slot, bool(plan.prefill), [], [], [], None)
        launch.inputs, launch.sample_seqs = inp, sample_seqs = self._inputs(plan, launch)
        launch.seqs = seqs = plan.decode + [c.seq for c in plan.prefill]
        launch.kv_ends = [int(p) + 1 for p in inp.decode_pos] + [c.start + c.length for c in plan.prefill]
        for seq in seqs:
            seq.inflight_refs += 1
        if self.lora_slots is not None:
            self.lora_slots.launched(s.lora_slot for s in seqs)
        if self.config.debug:
            self._check_exclusive(seqs, inp.decode_pos, plan)
        launch.marks.append(self.device.mark())
        self.runner.enqueue_forward(slot, launch.inputs)
        launch.marks.append(self.device.mark())
        self.launches.append(launch)
        return launch

    def _acquire_features(self, seq: Sequence, image: SeqImage) -> None:
        """Admission: a reference to the image's cache entry; a hit on features
        already computed (or enqueued) never reads this request's tiles."""
        num_tiles = image.input.cache_tiles
        image.entry, _hit = self.encoder_cache.acquire(image.input.hash, self.runner.feature_bytes(num_tiles),
                                                       num_tiles)
        # A prefix-cache hit may end inside the image: its earlier tiles are never read.
        first_row = int(np.searchsorted(seq.image_positions, seq.cached_tokens)) - image.row_start
        image.first_tile = max(first_row, 0) // self.runner.tokens_per_tile
        self._maybe_tiles_done(image)

    def _maybe_tiles_done(self, image: SeqImage) -> None:
        """Hand the tiles back if every tile the request still needs is enqueued
        and no uncommitted launch copies from them."""
        if not image.copies and (image.entry is None or image.entry.complete(image.first_tile)):
            self._tiles_done(image)

    def _tiles_done(self, image: SeqImage) -> None:
        if image.holds_tiles:
            image.holds_tiles = False
            self._result.tiles_done.append(image.input)

    def _release_features(self, seq: Sequence) -> None:
        for image in seq.images:
            if image.entry is not None:
                self.encoder_cache.release(image.entry)
                image.entry = None

    def _image_inputs(self, seq: Sequence, start: int, length: int, offset: int, launch: Launch, encode: list,
                      index: list, segments: list) -> None:
        """A prefill chunk's image rows: encode the tiles they need that nobody has
        enqueued yet, say where each row's features are."""
        offsets, rows = image_rows_in_chunk(seq.image_positions, start, length)
        if not len(rows):
            return
        lo, hi = int(rows[0]), int(rows[-1]) + 1  # a chunk's image rows are contiguous
        index.append(offsets + offset)
        per_tile = self.runner.tokens_per_tile
        for image in seq.images:
            if image.row_end <= lo or image.row_start >= hi:
                continue
            entry = image.entry
            first, end = max(lo, image.row_start) - image.row_start, min(hi, image.row_end) - image.row_start
            missing = entry.missing(first // per_tile, -(-end // per_tile))
            if len(missing):
                assert image.holds_tiles, "tiles to encode without the host tiles"
                entry.enqueued[missing] = True
                entry.pending += len(missing)
                image.copies += 1
                launch.encoded.append((image, len(missing)))
                for run in np.split(missing, np.flatnonzero(np.diff(missing) > 1) + 1):  # contiguous runs
                    a, b = int(run[0]), int(run[-1]) + 1
                    blocks = image.input.tiles if image.input.tiling else image.input.tile_blocks(a, b)
                    encode.append((blocks, entry.holder, a, entry.num_tiles, image.input.tiling))
                self.stats_.encoded_tiles += len(missing)
                self.stats_.encoded_images += entry.complete()
            self._maybe_tiles_done(image)  # e.g. another request enqueued the rest
            segments.append((entry.holder, first, end))

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
        encode, image_index, image_segments = [], [], []
        coord, size = [], []  # Moondream: the prefill tokens' spatial-ref values, when any chunk has some
        offset = len(decode)
        for c in plan.prefill:
            seq = c.seq
            chunks.append((c.start, c.length, seq.pages))
            prefill_ids.extend(seq.prompt_ids[c.start:c.start + c.length])
            if seq.task is not None and seq.task.prompt_coord is not None:
                coord.append((len(prefill_ids) - c.length, seq.task.prompt_coord[c.start:c.start + c.length],
                              seq.task.prompt_size[c.start:c.start + c.length]))
            if seq.images:
                self._image_inputs(seq, c.start, c.length, offset, launch, encode, image_index, image_segments)
            offset += c.length
            seq.num_prefilled += c.length
            self.stats_.prefill_tokens += c.length
            if c.final:
                launch.prefill_ended.append(seq)
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
            encode=encode,
            image_index=np.concatenate(image_index) if image_index else None,
            image_segments=image_segments,
            token_lora=self._token_lora(plan),
        )
        if coord:
            inp.prefill_coord = np.zeros(len(prefill_ids), np.float32)
            inp.prefill_size = np.zeros((len(prefill_ids), 2), np.float32)
            for start, c_values, s_values in coord:
                inp.prefill_coord[start:start + len(c_values)] = c_values
                inp.prefill_size[start:start + len(s_values)] = s_values
        if encode:
            self.stats_.encoder_launches += 1
        return inp, sample_seqs

    def _token_lora(self, plan: Plan) -> np.ndarray | None:
        """The LoRA slot of each token of a launch (decode rows, then prefill chunks); None if no adapter."""
        if self.lora_slots is None:
            return None
        slots = [s.lora_slot for s in plan.decode] + [c.seq.lora_slot for c in plan.prefill]
        if not any(slots):
            return None
        return np.repeat(np.asarray(slots, dtype=np.int64), [1] * len(plan.decode) + [c.length for c in plan.prefill])

    # ------------------------------------------------------------------ sampling
    def _sample_unconstrained(self, launch: Launch) -> None:
        """Sample the rows that need no mask now; constrained rows wait for the caller's masks."""
        if not launch.sample_seqs:  # a launch of non-final prefill chunks samples nothing
            launch.copy_done = launch.marks[-1]
            return
        # Zombie rows (already finalized) never wait for a mask.
        constrained = np.fromiter((i for i, s in enumerate(launch.sample_seqs) if s.constrained and not s.finalized),
                                  np.int64)
        launch.marks.append(self.device.mark())
        if not len(constrained):
            self.runner.enqueue_sample(launch.slot, launch.inputs)
            launch.marks.append(self.device.mark())
            self._enqueue_copy(launch)
            return
        free = np.setdiff1d(np.arange(len(launch.sample_seqs)), constrained)
        if len(free):
            self.runner.enqueue_sample(launch.slot, launch.inputs, free)
        launch.marks.append(self.device.mark())
        launch.constrained = constrained
        self.awaiting_masks = launch
        self._result.mask_requests = [launch.sample_seqs[i] for i in constrained]
        self._result.mask_step = launch.step

    def _sample_constrained(self, launch: Launch, words: np.ndarray | None, missing: np.ndarray | None) -> None:
        """Sample the rows that waited for masks (built after the previous commit), then copy the step."""
        self.awaiting_masks = None
        rows = launch.constrained
        if words is None or len(words) != len(rows):
            raise ValueError(f"step {launch.step} needs masks for {len(rows)} constrained rows")
        if missing is not None:
            for i, gone in zip(rows, missing):
                if gone:
                    self._fail(launch.sample_seqs[i], "mask_timeout",
                               "the constraint mask for this request did not arrive in time")
        launch.marks.append(self.device.mark())
        self.runner.enqueue_sample(launch.slot, launch.inputs, rows, np.ascontiguousarray(words, dtype=np.int32))
        launch.marks.append(self.device.mark())
        self._enqueue_copy(launch)

    def _enqueue_copy(self, launch: Launch) -> None:
        dest = None
        if self._copy_into:
            dest = self._copy_into.pop(0)
            self._result.copied_steps.append(launch.step)
        launch.copy_done = self.runner.enqueue_copy(launch.slot, launch.inputs, dest)

    # ------------------------------------------------------------------ commit
    def _commit(self) -> None:
        step, slot = self.pipeline.pop_commit()
        launch = self.launches.popleft()
        assert launch.step == step and launch.copy_done is not None, (launch.step, step)
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
        for seq in launch.seqs:
            seq.inflight_refs -= 1
            assert seq.inflight_refs >= 0, "inflight_refs underflow"
        if self.lora_slots is not None:
            self.lora_slots.committed(s.lora_slot for s in launch.seqs)
        if error is not None:
            self._device_failed(launch, error)
            return
        self.device.account(launch.marks, launch.copy_done)
        self._count(launch)
        for image, tiles in launch.encoded:  # the host-to-device copies of their tiles are done
            image.copies -= 1
            if image.entry is not None:
                image.entry.pending -= tiles
            self._maybe_tiles_done(image)
        for seq in launch.prefill_ended:  # no later launch reads their features
            self._release_features(seq)
        n = len(launch.sample_seqs)
        tokens, flags, logprobs, values = self.runner.read_step(slot, n)
        live, finish, cached = self._commit_rows(launch.sample_seqs, tokens, flags, logprobs, values)
        r = self._result
        r.step, r.prefill, r.seqs, r.live, r.finish = step, launch.prefill, launch.sample_seqs, live, finish
        r.cached = cached
        r.tokens = tokens.astype(np.int32)
        r.logprobs = logprobs.astype(np.float32) if launch.inputs.want_logprobs else None
        r.values = values
        for seq, end in zip(launch.seqs, launch.kv_ends):
            seq.kv_committed = max(seq.kv_committed, end)
            if self.alloc.pages.caching:
                self._register_full_pages(seq)
            self._maybe_release(seq)
        self.pipeline.release(step)

    def _register_full_pages(self, seq: Sequence) -> None:
        """Name the sequence's pages whose KV is complete and committed (prompt and generated
        tokens alike, so a follow-up turn hits): from now on other requests may map them."""
        size = self.alloc.page_size
        full = min(seq.kv_committed, seq.cacheable_len) // size
        names = seq.page_names
        if len(names) < full:
            tokens = seq.prompt_ids + seq.output_ids
            names += chain(tokens[len(names) * size:], size, full - len(names), seq.page_salt,
                           parent=names[-1] if names else ROOT, page_salts=seq.image_salts(len(names), full, size))
        for i in range(seq.pages_registered, full):
            self.alloc.pages.register(seq.pages[i], names[i])
        seq.pages_registered = max(seq.pages_registered, full)

    def _check_exclusive(self, seqs: list[Sequence], decode_pos: np.ndarray, plan: Plan) -> None:
        """Debug: a launch writes KV only into pages no other request reads (never a cached page)."""
        size, pool = self.alloc.page_size, self.alloc.pages
        spans = [(int(p), int(p) + 1) for p in decode_pos] + [(c.start, c.start + c.length) for c in plan.prefill]
        for seq, (start, end) in zip(seqs, spans):
            for page in seq.pages[start // size:(end - 1) // size + 1]:
                if not pool.exclusive(page):
                    raise AssertionError(f"request {seq.seq_id} would write shared or cached kv page {page}")

    def _count(self, launch: Launch) -> None:
        s = self.stats_
        s.steps += 1
        if launch.prefill:
            s.prefill_steps += 1
        else:
            s.decode_steps += 1
        s.sample_rows += len(launch.sample_seqs)

    def _commit_rows(self, seqs: list[Sequence], tokens, flags, logprobs, values=None):
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
    def _maybe_release(self, seq: Sequence) -> None:
        """Release a finalized sequence once no launched step references it (exactly once)."""
        if seq.released or not seq.finalized or seq.inflight_refs:
            return
        seq.released = True
        for image in seq.images:
            self._tiles_done(image)
        self._release_features(seq)
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
        self._result.released.append(seq)

    def _fail(self, seq: Sequence, code: str, message: str) -> None:
        if seq.finalize(FinishReason.ERROR, f"{code}: {message}"):
            self.stats_.failed += 1
            log.warning("request %d failed: %s: %s", seq.seq_id, code, message)

    def _device_failed(self, launch: Launch, error: BaseException) -> None:
        """Device work failed: fail the requests of every outstanding step, keep serving."""
        log.error("device work failed at step %d: %r", launch.step, error)
        victims = list(launch.seqs)
        self._result.dropped_steps.append(launch.step)
        self.pipeline.release(launch.step)
        self.awaiting_masks = None
        while self.launches:  # later steps ran on a failed stream: drop them too
            later = self.launches.popleft()
            later.dropped = True
            victims += later.seqs
            if later.copy_done is not None:
                try:
                    later.copy_done.synchronize()
                except DeviceError:
                    pass
            s, _ = self.pipeline.pop_commit()
            for seq in later.seqs:
                seq.inflight_refs -= 1
            if self.lora_slots is not None:
                self.lora_slots.committed(s.lora_slot for s in later.seqs)
            self.pipeline.release(s)
            self._result.dropped_steps.append(s)
        self.device.recover()
        # Features whose encode never completed are garbage: forget them, and fail every
        # request that would read them (a request admitted later hit on them).
        broken = {e for e in self.encoder_cache.entries.values() if e.pending}
        for entry in broken:
            self.encoder_cache.invalidate(entry)
        if broken:
            victims += [s for s in self.scheduler.running if any(i.entry in broken for i in s.images)]
        for seq in victims:
            self._fail(seq, "internal", f"device error: {error}")
        for seq in victims:
            self._maybe_release(seq)

"""The frontend's delivery side: requests in, worker tokens out, text to clients.

``Service`` owns one GPU worker (``WorkerHandle``) and every live request. It
reads the token ring in order and, per row, does the work the worker must not:
incremental detokenization, stop strings (the final answer goes out at once and
a finalize goes back to the worker), constraint masks for the next token, and
the final output. It acknowledges consumed ring entries, and frees a request's
state only when the worker reports the sequence released.

Invariants:
- a row of an unknown or already-ended request is skipped: a stale or zombie
  row never recreates per-request state, and nothing is sent after a terminal
  event;
- every request gets exactly one terminal event (done or error: ``Request.end``,
  ``request.py``);
- a constrained request's mask for token k is written only after token k-1
  was committed here, stamped (request, k), so the worker can never sample
  with an older one;
- if the worker dies, every in-flight request fails with ``worker_failed``
  within the heartbeat timeout, and a new generation is started (or
  ``WorkerDown`` is raised, with ``restart=False``, for systemd to act on).
  The restart does not block: while the new worker loads, ``poll`` keeps
  running and new requests wait in ``unsent`` (a failed restart raises
  ``WorkerDown``: a worker that cannot start is not retried in a loop).

Images (``submit_images``) are one room of their own (``image_intake.py``:
the image pool, the prompt rendering once the tiling is known, the wait for
tile blocks and the hand-over); the service calls it once per event.

Single-threaded: call ``poll()`` from one thread (the server loop); only the
image pool's helper threads run beside it, and they hand results back through
an eventfd that is among ``fds()``.
"""
from __future__ import annotations

import logging
import select
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from shared.config import EngineConfig
from shared.finish import FinishReason
from shared.lora_config import read_adapters
from shared.messages import (Cancel, ImagesCopied, Released, RequestFailed, Sampling, Stats, StatsRequest, Submit,
                             SubmitSkill)
from shared.models.info import ModelInfo
from shared.models.registry import load_tokenizer
from shared.sampling import MAX_TOP_LOGPROBS, SamplingParams
from shared.shm import CACHED_SHIFT, RingCorrupt, TokenFlag, mask_stamp
from shared.vision_config import read_config

from frontend.moondream import skills as moondream_skills
from frontend.protocol.wire import SKILL_SAMPLING
from frontend.server.detokenizer import IncrementalDetokenizer
from frontend.images.intake import ImageIntake, Render, intake_family
from frontend.server.request import Request
from frontend.server.tokenization import decode_ids
from frontend.server.worker_handle import WorkerDown, WorkerHandle

log = logging.getLogger("tandem.frontend")

# Plain ints for the per-token loop (IntFlag operators cost a Python call each).
_ZOMBIE, _FINISH_MASK, _STOP = int(TokenFlag.ZOMBIE), int(TokenFlag.FINISH_MASK), int(FinishReason.STOP)

# While tokens flow, the worker's health (its exit code, its heartbeat's age) is read at most this
# often, not at every wake-up: a waitpid and the arena's header were ~15% of the loop's time at one
# stream (every call runs cold after a CPU forward). A worker's death still shows at once, as the
# end of its control channel.
HEALTH_CHECK_S = 0.05

PROTOCOL_CODES = {"bad_request", "too_long", "context_length_exceeded", "overloaded", "worker_failed", "internal"}


@dataclass
class ServiceConfig(EngineConfig):
    """The engine's configuration (carried to the worker) plus the frontend's own settings."""

    restart: bool = True  # restart a dead worker (False: raise WorkerDown, e.g. under systemd)
    mask_timeout_s: float = 5.0
    worker_stale_s: float = 5.0
    ready_timeout_s: float = 900.0
    ring_entries: int = 64
    log_level: str = "WARNING"
    tile_blocks: int | None = None  # arena tile blocks; None: room for one request of the largest images
    block_tiles: int = 1  # tiles per tile block
    image_workers: int | None = None  # processes that decode and tile images; None: cores - 2, 1 to 4
    served_model_name: str | None = None  # the name clients see (HTTP /v1/models, requests' model); None: model
    chat_template: str | None = None  # a Jinja chat template's text, in place of the tokenizer's


def served_name(config: ServiceConfig) -> str:
    """The model's name for clients: ``--served-model-name``, else ``--model`` as given."""
    return config.served_model_name or config.model


class Service:
    def __init__(self, config: ServiceConfig | None = None, tokenizer=None, on_progress=None) -> None:
        """``on_progress(msg)`` sees the worker's start-up ``Progress`` messages (stage, done, total)."""
        self.config = cfg = config or ServiceConfig()
        self.model = ModelInfo.load(cfg.model, cfg.generation_config)  # converts once, with progress, before the worker starts
        self.model_path = self.model.path
        # LoRA adapters are checked against the model here, so a bad one fails before a worker starts.
        self.adapters = read_adapters(cfg.loras, read_config(self.model_path))
        self.tokenizer = tokenizer or load_tokenizer(self.model_path)
        if cfg.chat_template is not None:  # every rendering reads tokenizer.chat_template (tokenization.py)
            self.tokenizer.chat_template = cfg.chat_template
        self.vocab_size = self.model.vocab_size
        self.generation = 0
        self.requests: dict[int, Request] = {}  # by seq_id, until the worker releases it
        # Accepted but not sent to the worker: it is (re)starting, or no mask row is free.
        self.unsent: deque[Request] = deque()
        self.free_mask_rows = list(range(cfg.max_batch - 1, -1, -1))
        self._next_seq = 1
        self._stats: dict | None = None
        self._health_due = 0.0  # time.monotonic() of the next health check (HEALTH_CHECK_S)
        family = intake_family(self.model)  # Idefics3's tiles or Moondream's overlap crops; None: text only
        self.images = (ImageIntake(family, cfg.tile_blocks, cfg.block_tiles, cfg.image_workers)
                       if family is not None else None)
        self.image_params = self.images.params if self.images else None  # Idefics3's, for its renderers
        self.worker: WorkerHandle | None = None
        self.on_progress = on_progress
        self._start_worker()
        self.info = self.worker.wait_ready()  # the first start blocks: serve only a warmed-up worker
        log.info("worker generation %d ready: %s", self.generation, self.info)

    # ------------------------------------------------------------------ worker lifecycle
    def _start_worker(self) -> None:
        """Spawn a worker generation; ``poll`` notices when it is ready."""
        self.generation += 1
        self.worker = WorkerHandle(self.config, self.model, self.generation, on_progress=self._progress,
                                   image_region=self.images.region if self.images else (0, 1, 0))

    def _progress(self, msg) -> None:
        log.info("worker generation %d: %s%s", self.generation, msg.stage,
                 f" {msg.done}/{msg.total}" if msg.total else "")
        if self.on_progress is not None:
            self.on_progress(msg)

    @property
    def worker_ready(self) -> bool:
        return self.worker is not None and self.worker.ready

    def _worker_died(self, why: str) -> None:
        was_ready = self.worker.ready  # (its stderr is in the log already: worker_handle relays it)
        log.error("worker generation %d failed: %s", self.generation, why)
        self.worker.kill()
        for req in list(self.requests.values()):
            self._end(req, error=("worker_failed", f"the GPU worker failed ({why}); retry the request"))
        self.requests.clear()
        self.unsent.clear()
        self.free_mask_rows = list(range(self.config.max_batch - 1, -1, -1))
        if not (self.config.restart and was_ready):
            raise WorkerDown(why)
        self._start_worker()

    @property
    def worker_pid(self) -> int:
        return self.worker.pid

    # ------------------------------------------------------------------ requests
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *, stop=(), constraint=None,
               logprobs: bool = False, on_event=None, user_data=None, adapter: str | None = None,
               top_logprobs: int = 0) -> Request:
        """``top_logprobs``: also that many most likely tokens with their logprobs, for each token."""
        req = self._new_request(prompt_ids, params, stop, constraint, logprobs, on_event, user_data, adapter,
                                top_logprobs)
        self._ready_to_send(req)
        return req

    def _new_request(self, prompt_ids, params, stop, constraint, logprobs, on_event, user_data,
                     adapter: str | None, top_logprobs: int = 0) -> Request:
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter: unknown adapter {adapter!r}; this server has "
                             f"{', '.join(self.adapters) or 'none'}")
        seq_id = self._next_seq
        self._next_seq = self._next_seq % 0xFFFFFFFF + 1
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        req = Request(seq_id, list(prompt_ids or ()), params, tuple(s for s in stop if s), constraint,
                      logprobs or top_logprobs > 0, on_event, user_data, adapter, top_logprobs=top_logprobs)
        self.requests[seq_id] = req
        return req

    def submit_images(self, images: list[bytes], render: Render, params: SamplingParams | None = None, *,
                      stop=(), constraint=None, logprobs: bool = False, on_event=None, user_data=None,
                      adapter: str | None = None, top_logprobs: int = 0) -> Request:
        """A request with images, decoded and tiled in the image pool; then
        ``render(prepared images) -> prompt ids`` (e.g. ``images.image_prompt_ids`` of the
        rendered text) runs on the loop thread (``tokenizer`` is used on that thread only; the HTTP
        thread decodes with a copy of its own).
        Bad images (or a ``ValueError`` from ``render``) end the request with
        ``bad_request`` naming the field; ``ValueError`` at once for what needs no decoding."""
        if self.images is None:
            raise ValueError("images: this model takes no images (it has no vision encoder)")
        self.images.check(images)
        req = self._new_request(None, params, stop, constraint, logprobs, on_event, user_data, adapter, top_logprobs)
        req.images = self.images.start(req, images, render)
        return req

    def submit_skill(self, skill: dict, images: list[bytes] = (), *, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                     on_event=None, user_data=None) -> Request:
        """A Moondream skill request (``moondream_skills.plan``): the model's own prompt, the task its
        row runs on the device, and (at ``done``) its answer. ValueError names a bad field."""
        if not self.model.family.native_skills:
            raise ValueError("skill: this model has no Moondream skills; send a prompt")
        if len(images) > 1:
            raise ValueError("images: a skill takes one image")
        encode = lambda text: [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]  # noqa: E731
        rules = self.model.family.skill_rules
        plan = moondream_skills.plan(skill, encode, bool(images), max_tokens, rules=rules)
        greedy = plan.phase == moondream_skills.DECIDE  # point / detect
        params = SamplingParams(
            max_tokens=plan.max_tokens, seed=seed,
            temperature=0.0 if greedy else SKILL_SAMPLING["temperature"] if temperature is None else temperature,
            top_p=1.0 if greedy else rules.top_p if top_p is None else top_p)
        if images:
            prefix = [0] * moondream_skills.PREFIX_LEN
            req = self.submit_images(list(images), lambda prepared: prefix + plan.prompt_ids, params,
                                     on_event=on_event, user_data=user_data)
            req.skill = plan
            return req
        req = self._new_request(plan.prompt_ids, params, (), None, False, on_event, user_data, None)
        req.skill = plan
        self._ready_to_send(req)
        return req

    def decode(self, ids: list[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    def _take_prepared(self) -> None:
        """Loop thread: requests whose images the pool finished go on to the worker."""
        max_len = int(self.info["max_model_len"])  # the first worker's; a restarted one has the same config
        for req, error in self.images.take_prepared(max_len, self.worker.images):
            if error is not None:
                self._end(req, error=error)
                self._forget(req)
            else:
                self._ready_to_send(req)

    def _start_detokenizer(self, req: Request) -> None:
        p = req.params
        req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids_tail=req.prompt_ids[-8:], stop=list(req.stop),
                                           skip_special_tokens=p.skip_special_tokens,
                                           include_stop=p.include_stop_str_in_output, min_tokens=p.min_tokens)

    def _ready_to_send(self, req: Request) -> None:
        self._start_detokenizer(req)
        if self._can_send(req):
            self._send_submit(req)
        else:
            self.unsent.append(req)

    def _can_send(self, req: Request) -> bool:
        """The worker is ready, and a mask row / enough tile blocks are free if the request needs them."""
        if not self.worker.ready or (req.constraint is not None and not self.free_mask_rows):
            return False
        return req.images is None or self.images.fits(req, self.worker.images)

    def _send_unsent(self) -> None:
        """Send what waited: everything once the worker is ready, requests needing a mask row
        or tile blocks while those last (the others are not held up behind them)."""
        if not self.worker.ready:
            return
        waiting = self.unsent
        self.unsent = deque()
        for req in waiting:  # (a cancel removes its request from unsent)
            if self._can_send(req):
                self._send_submit(req)
            else:
                self.unsent.append(req)

    def _send_submit(self, req: Request) -> None:
        if req.constraint is not None:
            req.mask_row = self.free_mask_rows.pop()
            self._write_mask(req)  # the initial mask exists before the first token can be sampled
        images = self.images.hand_over(req, self.worker.images) if req.images else []
        req.submitted = True
        self.worker.channel.send(Submit(seq_id=req.seq_id, prompt_ids=req.prompt_ids,
                                        sampling=Sampling.from_params(req.params),
                                        constrained=req.constraint is not None, logprobs=req.logprobs,
                                        top_logprobs=req.top_logprobs,
                                        mask_row=req.mask_row, adapter=req.adapter, images=images,
                                        skill=SubmitSkill(**req.skill.task()) if req.skill else None))

    def cancel(self, req: Request) -> None:
        """Client cancel or disconnect: terminal ``done`` (cancelled) now, resources freed in the worker."""
        if req.ended:
            return
        self._end(req, reason=FinishReason.CANCELLED)
        if req.images is not None:
            self.images.cancel(req)
        self._stop_worker_side(req, FinishReason.CANCELLED)

    def _stop_worker_side(self, req: Request, reason: FinishReason) -> None:
        if not req.submitted:
            if req in self.unsent:
                self.unsent.remove(req)
            self._forget(req)
        elif reason == FinishReason.CANCELLED or not self.worker.acks.try_push(req.seq_id, reason):
            # A client cancel may come before the worker has read the request's Submit, so it
            # travels behind it on the control channel (an ack could overtake it and be
            # dropped as unknown). Stops come after a committed token: the ack ring is safe,
            # and the channel takes over when the ring is full.
            self.worker.channel.send(Cancel(seq_id=req.seq_id))

    # ------------------------------------------------------------------ the loop
    def fds(self) -> list[int]:
        """File descriptors that become readable when poll() has work (for external pollers)."""
        return [self.worker.tokens.fileno(), self.worker.channel.fileno(), *(self.images.fds() if self.images else ())]

    def poll(self, timeout: float = 0.0) -> int:
        """Process what the worker sent; wait up to ``timeout`` if there was nothing. Returns entries processed."""
        # Drain the wakeup first, then read: a publish after this re-signals, so
        # nothing is missed, and an external poller never sees a stale readable fd.
        self.worker.tokens.clear_wakeup()
        n = self._process()
        if n == 0 and timeout > 0:
            if not self.worker.tokens.ready():
                select.select(self.fds(), [], [], timeout)
            self.worker.tokens.clear_wakeup()
            n = self._process()
        return n

    def _process(self) -> int:
        now = time.monotonic()
        if now >= self._health_due or not self.worker.ready:
            self._health_due = now + HEALTH_CHECK_S
            why = self.worker.failure()
            if why is not None:
                self._worker_died(why)
                return 0
        if self.images is not None:
            self._take_prepared()
        try:
            self.worker.channel.flush()  # submits the socket could not take at once
        except ConnectionError:
            self._worker_died(self.worker.failure() or "control channel closed")
            return 0
        if not self.worker.ready:
            if not self.worker.poll_ready():
                return 0
            log.info("worker generation %d ready", self.generation)
            self._send_unsent()
        try:
            messages = self.worker.channel.receive()
        except ConnectionError:
            self._worker_died(self.worker.failure() or "control channel closed")
            return 0
        # Drain the ring before applying the messages: the worker publishes a
        # sequence's last entry before it reports the sequence released.
        n = 0
        reader = self.worker.tokens
        try:
            while (entry := reader.poll()) is not None:
                self._deliver(entry)
                reader.consume(entry.position)
                n += 1
        except RingCorrupt as e:  # never deliver unvalidated tokens: treat as a failed worker
            self._worker_died(f"token ring corrupt: {e}")
            return n
        for msg in messages:
            self._control_message(msg)
        return n

    def _control_message(self, msg) -> None:
        if isinstance(msg, Released):
            for seq_id in msg.seq_ids:
                req = self.requests.pop(seq_id, None)
                if req is not None:
                    if not req.ended:
                        self._end(req, error=("internal", "the worker released a live request"))
                    self._forget(req)
        elif isinstance(msg, RequestFailed):
            req = self.requests.get(msg.seq_id)
            if req is not None and not req.ended:
                code = msg.code if msg.code in PROTOCOL_CODES else "internal"
                message = msg.message if code == msg.code else f"{msg.code}: {msg.message}"
                self._end(req, error=(code, message))
        elif isinstance(msg, ImagesCopied):
            self.worker.images.release(msg.blocks)
            if self.unsent:
                self._send_unsent()
        elif isinstance(msg, Stats):
            self._stats = {**msg.values, "adapters_loaded": list(msg.adapters_loaded)}

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.seq_id, None)
        if req.mask_row >= 0:
            self.free_mask_rows.append(req.mask_row)
            req.mask_row = -1
            if self.unsent:
                self._send_unsent()

    def _deliver(self, entry) -> None:
        """Deliver one committed step: every row, in order."""
        now = time.perf_counter()
        lps = entry.logprobs
        for i, (seq_id, token, flags) in enumerate(zip(entry.seq_ids.tolist(), entry.token_ids.tolist(),
                                                       entry.flags.tolist())):
            req = self.requests.get(seq_id)
            if req is None or req.ended or flags & _ZOMBIE:
                continue  # stale row: never recreates state, never reaches a client
            if req.t_first is None:
                req.t_first = now
                req.cached_tokens = flags >> CACHED_SHIFT
            req.token_ids.append(token)
            if req.skill is not None and entry.values is not None:
                req.values.append(tuple(entry.values[i].tolist()))
            if req.logprobs and lps is not None:
                req.token_logprobs.append(float(lps[i]))
            if req.top_logprobs and entry.top_ids is not None:
                k = req.top_logprobs
                req.token_top.append(list(zip(entry.top_ids[i, :k].tolist(), entry.top_logprobs[i, :k].tolist())))
            if req.constraint is not None and not req.constraint.accept(token):
                self._end(req, error=("internal", f"token {token} violated the request's constraint"))
                self._stop_worker_side(req, FinishReason.ERROR)
                continue
            finish = flags & _FINISH_MASK  # the worker's FinishReason for this token
            # As vLLM: the EOS or stop token that ended the answer is not part of its text, unless asked.
            silent = finish == _STOP and req.skill is None and not req.params.include_stop_str_in_output
            text = "" if silent else req.detok.add(token)
            if req.detok.stopped:
                finish = FinishReason.STOP
                self._stop_worker_side(req, FinishReason.STOP)  # the worker stops generating at once
            elif finish:
                text += req.detok.finish()
            self._emit_chunk(req, text, token)
            if finish:
                self._end(req, reason=FinishReason(finish))
            elif req.constraint is not None:
                self._write_mask(req)

    def _write_mask(self, req: Request) -> None:
        words = np.empty((1, self.worker.masks.words_per_row), dtype=np.int32)
        req.constraint.fill_mask(words[0])
        self.worker.masks.write_rows([req.mask_row], mask_stamp(req.seq_id, len(req.token_ids)), words)

    # ------------------------------------------------------------------ events
    def _emit_chunk(self, req: Request, text: str, token: int) -> None:
        if req.on_event is not None:
            payload = {"text": text, "token_ids": [token]}
            if req.logprobs:  # streamed with its token, not only in the terminal message
                payload["logprobs"] = req.token_logprobs[-1:]
            if req.top_logprobs:
                payload["top_logprobs"] = req.token_top[-1:]
            req.on_event(req, "chunk", payload)

    def _end(self, req: Request, reason: FinishReason = FinishReason.NONE,
             error: tuple[str, str] | None = None) -> None:
        """The request's one terminal event, with what only the service knows (its tokenizer, whether
        the model takes images)."""
        req.end(reason, error, decode=self.decode, image_usage=self.images is not None)

    # ------------------------------------------------------------------ helpers for tests and tools
    def run_until(self, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("service did not reach the condition in time")
            self.poll(0.05)

    def idle(self) -> bool:
        return not self.requests

    def stats(self, timeout: float = 10.0) -> dict:
        """The worker's engine statistics (TimeoutError while a worker is starting)."""
        if not self.worker.ready:
            raise TimeoutError(f"worker generation {self.generation} is starting")
        self._stats, generation = None, self.generation
        self.worker.channel.send(StatsRequest())
        self.run_until(lambda: self._stats is not None or self.generation != generation, timeout)
        if self._stats is None:  # the worker died meanwhile: its answer will never come
            raise TimeoutError(f"worker generation {generation} failed before answering")
        return self._stats

    def close(self) -> None:
        if self.images is not None:  # first: no pool thread hands back a result once it is closed
            self.images.close()
        if self.worker is not None:
            for req in list(self.requests.values()):
                self._end(req, error=("internal", "the server is shutting down"))
            self.worker.shutdown()
            self.worker = None

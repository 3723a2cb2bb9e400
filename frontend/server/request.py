"""One request as the frontend holds it, and its one terminal event.

``Service`` creates a ``Request`` when it accepts a generate and drops it when the worker
reports the sequence released (or at once for one that never reached the worker). Its
``on_event(request, kind, payload)`` receives ("chunk", {"text", "token_ids"}), then exactly
one of ("done", {...}) / ("error", {"code", "message"}): ``end`` is the only place that emits a
terminal event, and it emits nothing once ``ended`` is set, so nothing follows the terminal one.
(The worker's record of the same request is ``gpu_worker/sequence.py``'s ``Sequence``.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from shared.finish import FinishReason
from shared.sampling import SamplingParams

from frontend.moondream import skills as moondream_skills
from frontend.server.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from frontend.images.intake import RequestImages


@dataclass(eq=False)
class Request:
    """Frontend state of one request (``on_event``: see the module docstring)."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    constraint: Any  # a grammar matcher (fill_mask / accept / is_terminated / output) or None
    logprobs: bool
    on_event: Callable[["Request", str, dict], None] | None
    user_data: Any = None
    adapter: str | None = None  # a LoRA adapter's name, None = the base model
    detok: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: int = 0  # how many of each token's most likely alternatives it asked for
    token_top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, logprob), best first
    mask_row: int = -1  # its row in the shared mask region while it holds one
    images: RequestImages | None = None  # submit_images: its images until they are handed to the worker
    submitted: bool = False  # sent to the worker (else waiting for a mask row)
    ended: bool = False
    finish_reason: FinishReason = FinishReason.NONE
    error: tuple[str, str] | None = None
    output: Any = None
    text: str = ""
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prefix cache
    t_end: float | None = None
    skill: moondream_skills.Plan | None = None  # a Moondream skill request
    values: list = field(default_factory=list)  # its tokens' region values (coord, w, h), from the ring

    def end(self, reason: FinishReason = FinishReason.NONE, error: tuple[str, str] | None = None, *,
            decode: Callable[[list[int]], str], image_usage: bool) -> None:
        """The terminal event: ``error`` (code, message), else done with ``reason``; a no-op once ended.
        ``decode``: token ids to text (a skill's answer); ``image_usage``: the usage counts image tokens."""
        if self.ended:
            return
        self.ended = True
        self.t_end = time.perf_counter()
        self.text = self.detok.text if self.detok else ""
        if error is not None:
            self.error = error
            if self.on_event is not None:
                self.on_event(self, "error", {"code": error[0], "message": error[1]})
            return
        self.finish_reason = reason
        payload = {"finish_reason": reason.wire, "text": self.text, "token_ids": list(self.token_ids),
                   "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids),
                             "cached_tokens": self.cached_tokens,
                             **({"image_tokens": self.images.tokens if self.images else 0} if image_usage else {})},
                   "metrics": {"ttft_ms": _ms(self.t_submit, self.t_first),
                               "total_ms": _ms(self.t_submit, self.t_end)}}
        if self.skill is not None:
            payload |= moondream_skills.answer(self.skill, self.token_ids, self.values, decode)
        if self.constraint is not None and reason == FinishReason.STOP:
            try:
                self.output = self.constraint.output(self.text)
                payload["output"] = self.output
            except ValueError as e:  # incomplete structure: reported, never repaired
                payload["output_error"] = str(e)
        if self.logprobs:
            payload["logprobs"] = list(self.token_logprobs)
        if self.top_logprobs:
            payload["top_logprobs"] = [[list(pair) for pair in top] for top in self.token_top]
        if self.on_event is not None:
            self.on_event(self, "done", payload)


def _ms(t0: float, t1: float | None) -> float | None:
    return None if t1 is None else round((t1 - t0) * 1e3, 3)

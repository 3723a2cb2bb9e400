"""Moondream's decoding rules as per-row state on the device (MOONDREAM.md §4).

Every row of a Moondream model has a *phase* that says how its next step is sampled and what it
emits. The state lives in device tensors indexed by batch row and is advanced by the sampled
token on the device, vectorised over the step's rows, so no row ever waits for the host: the
host may fall behind by a step without stalling the device.

phases:
- ``ANSWER_FIRST`` (caption/query, first answer token): nothing suppressed  -> ANSWER
- ``ANSWER``: the answer token 3 is suppressed; eos stops; ``limit`` answer tokens stop (length)
- ``REASON``: eos and size suppressed but on the first step (the prefill's token may be eos and
  is kept); the sampled 3 (or the limit) ends the reasoning: 3 is emitted and fed, which is the
  reference's answer prompt                                              -> ANSWER_FIRST
- ``DECIDE`` (point/detect, after the prompt or an object): the full-vocabulary argmax (greedy)
  decides: eos (or ``limit`` objects done) stops; else the row emits ``coord`` with x  -> Y.
  Moondream 3 decides after an object between coord and eos alone (``Moondream.coord_over_eos``).
- ``Y``: emits ``coord`` with y                     -> SIZE (detect) / DECIDE (point, an object)
- ``SIZE``: emits ``size`` with (w, h)                                  -> DECIDE (an object)

Each step also computes, for every row, the region values of its pre-post_ln hidden state
(coordinate and size heads); they go into the row's pending value buffers, which the next
forward embeds for a ``coord`` / ``size`` input token (``Moondream.embed``), and they come back
to the host with the tokens: ``values[:, 0]`` the coordinate, ``values[:, 1:]`` (w, h).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared import moondream_config as cfg
from shared.moondream_config import ANSWER_ID, COORD_ID, EOS_ID, SIZE_ID

from .sampler import FLAG_LENGTH, FLAG_STOP

ANSWER_FIRST, ANSWER, REASON, DECIDE, Y, SIZE = range(6)
assert (ANSWER_FIRST, REASON, DECIDE) == (cfg.ANSWER_FIRST, cfg.REASON, cfg.DECIDE)  # what the frontend sends
VALUES = 3  # per emitted token: coordinate, width, height


@dataclass(frozen=True)
class SkillTask:
    """What a Moondream request asks the device to do (set at admission).

    ``prompt_coord`` [T] / ``prompt_size`` [T, 2]: the values of the prompt's coord / size
    positions (spatial refs), zeros elsewhere; None without refs."""
    phase: int = ANSWER_FIRST  # the first phase: ANSWER_FIRST, REASON or DECIDE
    detect: bool = False  # DECIDE rows: with a size step per object
    limit: int = 0  # answer tokens (text), reasoning tokens (REASON), objects (DECIDE); 0 = no limit
    answer_limit: int = 0  # after the reasoning: the answer's token limit
    prompt_coord: np.ndarray | None = None
    prompt_size: np.ndarray | None = None

    def checked(self, prompt_len: int, temperature: float) -> SkillTask:
        """This task, if it is valid for a prompt of ``prompt_len`` tokens; else ValueError naming the field."""
        if self.phase not in (ANSWER_FIRST, REASON, DECIDE) or min(self.limit, self.answer_limit) < 0:
            raise ValueError(f"skill: phase {self.phase} / limits {self.limit}, {self.answer_limit} are invalid")
        if self.phase == DECIDE and temperature != 0:
            raise ValueError("temperature: point and detect are greedy (temperature 0)")
        for name, values, shape in (("coord", self.prompt_coord, (prompt_len,)),
                                    ("size", self.prompt_size, (prompt_len, 2))):
            if values is not None and (values.dtype != np.float32 or values.shape != shape):
                raise ValueError(f"spatial_refs: {name} values must be float32 {list(shape)}")
        return self

    @property
    def values_in_output(self) -> bool:
        """Reasoning, point and detect emit coord / size tokens whose values the ids do not show."""
        return self.phase != ANSWER_FIRST


class SkillRows:
    """The per-row phase, counters and pending region values of every batch row, on the device."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        z = lambda: torch.zeros(max_rows, dtype=torch.int64, device=device)  # noqa: E731
        self.phase, self.count, self.limit, self.answer_limit, self.detect = z(), z(), z(), z(), z()
        self.coord = torch.zeros(max_rows, dtype=torch.float32, device=device)  # pending values
        self.size = torch.zeros(max_rows, 2, dtype=torch.float32, device=device)
        self._pinned = torch.device(device).type == "cuda"

    def set_row(self, row: int, task: SkillTask) -> None:
        """Admission (compute stream): the row's first phase and limits."""
        host = torch.tensor([task.phase, 0, task.limit, task.answer_limit, int(task.detect)], dtype=torch.int64)
        if self._pinned:
            host = host.pin_memory()
        dev = host.to(self.phase.device, non_blocking=self._pinned)
        for i, t in enumerate((self.phase, self.count, self.limit, self.answer_limit, self.detect)):
            t[row] = dev[i]

    def suppress(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of the rows' step with what their phase forbids set to -inf (branch-free)."""
        phase = self.phase[rows]
        ninf = torch.tensor(float("-inf"), device=logits.device)
        logits = logits.clone()
        reason = (phase == REASON) & (self.count[rows] > 0)
        logits[:, ANSWER_ID] = torch.where(phase == ANSWER, ninf, logits[:, ANSWER_ID])
        logits[:, EOS_ID] = torch.where(reason, ninf, logits[:, EOS_ID])
        logits[:, SIZE_ID] = torch.where(reason, ninf, logits[:, SIZE_ID])
        return logits

    def advance(self, model, hidden: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After sampling: the emitted tokens and flags, and the region values [R, 3] of the step;
        the rows' phases, counters and pending values advance. ``model``: the Moondream (its region
        heads and skill rules)."""
        phase, count, limit = self.phase[rows], self.count[rows], self.limit[rows]
        coord = model.region.coord(hidden)  # [R] float32
        size = model.region.size(hidden)  # [R, 2] float32
        counted = count + 1
        at_limit = (limit > 0) & (counted >= limit)

        # What each phase emits.
        eos = tokens == EOS_ID
        if model.rules.two_way_stop:  # after the first object: coord or eos only
            eos = torch.where(count > 0, ~model.coord_over_eos(hidden), eos)
        decide_stop = (phase == DECIDE) & (eos | ((limit > 0) & (count >= limit)))
        # The reference emits ``limit`` reasoning tokens, then feeds the answer token.
        reason_end = (phase == REASON) & ((tokens == ANSWER_ID) | ((limit > 0) & (count >= limit)))
        out = tokens
        out = torch.where(reason_end, ANSWER_ID, out)
        out = torch.where(phase == DECIDE, torch.where(decide_stop, EOS_ID, COORD_ID), out)
        out = torch.where(phase == Y, COORD_ID, out)
        out = torch.where(phase == SIZE, SIZE_ID, out)

        stop = torch.where(phase >= DECIDE, decide_stop, (flags & FLAG_STOP).bool() & (phase != REASON))
        length = ((phase == ANSWER) | (phase == ANSWER_FIRST)) & at_limit & ~stop
        new_flags = stop.to(torch.int32) * FLAG_STOP | length.to(torch.int32) * FLAG_LENGTH

        # The next phase and counters.
        detect = self.detect[rows].bool()
        object_done = (phase == SIZE) | (phase == Y) & ~detect
        nxt = phase
        nxt = torch.where(phase == ANSWER_FIRST, ANSWER, nxt)
        nxt = torch.where(reason_end, ANSWER_FIRST, nxt)
        nxt = torch.where(phase == DECIDE, Y, nxt)
        nxt = torch.where(phase == Y, torch.where(detect, SIZE, DECIDE), nxt)
        nxt = torch.where(phase == SIZE, DECIDE, nxt)
        new_count = torch.where(phase >= DECIDE, count + object_done.long(), counted)
        # The reasoning's end starts the answer's count and limit.
        new_count = torch.where(reason_end, 0, new_count)
        new_limit = torch.where(reason_end, self.answer_limit[rows], limit)
        self.phase.index_copy_(0, rows, nxt)
        self.count.index_copy_(0, rows, new_count)
        self.limit.index_copy_(0, rows, new_limit)
        self.coord.index_copy_(0, rows, coord)
        self.size.index_copy_(0, rows, size)
        return out, new_flags, torch.cat([coord[:, None], size], dim=1)

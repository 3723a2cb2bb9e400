"""The records one step leaves on its way through the engine (docs/DESIGN.md §4.1).

- ``Launch``: from ``Engine._launch`` to its commit; the pipeline holds it in the step's
  step buffer meanwhile, so a step buffer is never reused before its step is committed or dropped.
- ``CommittedStep``: the commit's result (phase 3), one entry per sampled row.
- ``Tick``: everything one ``Engine.tick`` produced, which the caller publishes (the engine
  never calls back into it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .image_prefill import ImageInput, LaunchImages
    from .model_runner import LaunchInputs
    from .sequence import Sequence


@dataclass
class Launch:
    """One launched step, from launch to commit (the pipeline holds it meanwhile)."""
    prefill: bool  # the launch holds prefill chunks (else pure decode)
    seqs: list[Sequence]  # every sequence in the launch
    kv_ends: list[int]  # per sequence of ``seqs``: the end of the positions whose KV this launch writes
    step: int = -1  # its step number and step buffer, from ``Pipeline.launch``
    step_buffer: int = -1
    sample_seqs: list[Sequence] = field(default_factory=list)  # one per logits row, in row order
    inputs: LaunchInputs | None = None
    marks: list = field(default_factory=list)  # compute-stream marks: forward begin/end, sampling begin/end
    constrained: np.ndarray | None = None  # sampling rows still waiting for their masks
    copy_into: np.ndarray | None = None  # the caller's host array its ids were also copied into
    copy_done: object = None  # the device->host copy's event: what the commit waits on
    dropped: bool = False  # discarded after a device failure
    images: LaunchImages | None = None  # its image work (image_prefill.py), if a chunk has images


@dataclass
class CommittedStep:
    """A launched step after its commit (phase 3). Row arrays are aligned with ``seqs``."""
    step: int
    prefill: bool
    seqs: list[Sequence]  # one per sampled row
    tokens: np.ndarray  # int32
    finish: np.ndarray  # uint8 FinishReason of the row's token (NONE: the request runs on)
    live: np.ndarray  # bool; False = a zombie row (its request ended before this commit)
    cached: np.ndarray  # int32: on a request's first token, its prompt tokens from the prefix cache
    logprobs: np.ndarray | None  # float32, when any row asked for them
    values: np.ndarray | None  # float32 [rows, 3], Moondream: each token's region values (coord, w, h)
    top: tuple[np.ndarray, np.ndarray] | None = None  # int32 ids, float32 logprobs [rows, K]: the most likely

    @property
    def rows(self) -> int:
        return len(self.seqs)


@dataclass
class Tick:
    """What one ``Engine.tick`` produced, for its caller to publish."""
    committed: CommittedStep | None = None  # None when this tick committed nothing
    released: list[Sequence] = field(default_factory=list)  # resources freed this tick (exactly once each)
    copied_steps: list[int] = field(default_factory=list)  # the steps whose ids went into ``copy_into``, in order
    dropped_steps: list[int] = field(default_factory=list)  # steps discarded after a device failure
    mask_requests: list[Sequence] = field(default_factory=list)  # the next tick() must bring their masks
    mask_step: int | None = None  # the step those masks are for
    tiles_done: list[ImageInput] = field(default_factory=list)  # host tiles never read again (free their memory)

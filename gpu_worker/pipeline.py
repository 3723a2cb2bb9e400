"""The pipeline's bookkeeping: two ping-pong step buffers, as a pure state machine.

A *step buffer* is one set of per-step arrays (staged metadata, logits, sampled ids,
the host copy's destination, CUDA graphs); step n uses buffer n % NUM_STEP_BUFFERS. A
step carries its caller's item (the engine's ``Launch``) from launch to
release (``pop_commit`` hands it back), so the queue of launched steps exists
once.

No torch here: this module only decides which buffer a launch uses, which step is
committed next and when a buffer may be reused, so it is tested exhaustively on
any machine.

Invariants (checked on every call; misuse raises PipelineError):
1. Step numbers are consecutive, starting at 0; step n uses buffer n % num_buffers,
   so the buffers alternate (ping-pong).
2. At most ``num_buffers`` steps are outstanding (launched, not yet released).
3. Steps are committed in launch order (FIFO) and one at a time.
4. Two-phase release: a buffer goes FREE -> IN_FLIGHT (launch) -> COMMITTING
   (pop_commit) -> FREE (release). Its buffers may be rewritten only when FREE,
   i.e. after the step that used them was committed.
5. ``drained`` is true exactly when nothing is outstanding.

Blocking mode is the same machine used with depth 1: launch, pop_commit,
release, then the next launch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum


NUM_STEP_BUFFERS = 2  # launch t+1 while t is committed: two steps in flight at most


class PipelineError(RuntimeError):
    pass


class BufferState(Enum):
    FREE = "free"
    IN_FLIGHT = "in_flight"
    COMMITTING = "committing"


@dataclass
class BufferRecord:
    state: BufferState = BufferState.FREE
    step: int | None = None
    item: object = None  # what the caller launched the step with (the engine: its Launch), until release


class Pipeline:
    def __init__(self, num_buffers: int = NUM_STEP_BUFFERS) -> None:
        if num_buffers < 1:
            raise PipelineError("a pipeline needs at least one buffer")
        self.num_buffers = num_buffers
        self.buffers = [BufferRecord() for _ in range(num_buffers)]
        self.next_step = 0
        self._in_flight: deque[int] = deque()  # launched, not yet popped, in launch order
        self._committing: int | None = None

    # -- queries ---------------------------------------------------------------
    def buffer_of(self, step: int) -> int:
        return step % self.num_buffers

    def can_launch(self) -> bool:
        return self.buffers[self.buffer_of(self.next_step)].state is BufferState.FREE

    @property
    def in_flight(self) -> int:
        """Steps launched and not yet popped for commit."""
        return len(self._in_flight)

    @property
    def outstanding(self) -> int:
        return len(self._in_flight) + (self._committing is not None)

    @property
    def drained(self) -> bool:
        return self.outstanding == 0

    @property
    def in_flight_items(self) -> list:
        """The items of the steps launched and not yet popped for commit, in launch order."""
        return [self.buffers[self.buffer_of(step)].item for step in self._in_flight]

    # -- transitions -----------------------------------------------------------
    def launch(self, item: object = None) -> tuple[int, int]:
        """Claim the next buffer for a new step that carries ``item``; returns (step, buffer)."""
        step = self.next_step
        buffer = self.buffer_of(step)
        rec = self.buffers[buffer]
        if rec.state is not BufferState.FREE:
            raise PipelineError(f"buffer {buffer} is {rec.state.value} (step {rec.step}); cannot launch step {step}")
        rec.state, rec.step, rec.item = BufferState.IN_FLIGHT, step, item
        self._in_flight.append(step)
        self.next_step += 1
        return step, buffer

    def pop_commit(self) -> tuple[int, int, object]:
        """Take the oldest in-flight step for commit; returns (step, buffer, the item it was launched with)."""
        if self._committing is not None:
            raise PipelineError(f"step {self._committing} is still being committed")
        if not self._in_flight:
            raise PipelineError("no step in flight to commit")
        step = self._in_flight.popleft()
        buffer = self.buffer_of(step)
        rec = self.buffers[buffer]
        assert rec.state is BufferState.IN_FLIGHT and rec.step == step  # guaranteed by launch()
        rec.state = BufferState.COMMITTING
        self._committing = step
        return step, buffer, rec.item

    def release(self, step: int) -> None:
        """Second phase: the committed step's buffer becomes reusable."""
        if self._committing != step:
            raise PipelineError(f"release({step}) but the step being committed is {self._committing}")
        rec = self.buffers[self.buffer_of(step)]
        rec.state, rec.step, rec.item = BufferState.FREE, None, None
        self._committing = None

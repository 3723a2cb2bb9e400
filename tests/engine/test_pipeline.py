"""The pipeline state machine, exhaustively, without torch."""
import random

import pytest

from gpu_worker.pipeline import Pipeline, PipelineError, BufferState


def test_step_buffers_alternate_and_commit_fifo():
    p = Pipeline(2)
    assert p.launch("a") == (0, 0)
    assert p.launch("b") == (1, 1)
    assert not p.can_launch()  # both step buffers outstanding
    assert p.pop_commit() == (0, 0, "a")  # a step comes back with the item it was launched with
    assert not p.can_launch()  # two-phase: buffer 0 is committing, not free
    p.release(0)
    assert p.can_launch()
    assert p.launch() == (2, 0)
    assert p.pop_commit() == (1, 1, "b")
    p.release(1)
    assert p.pop_commit() == (2, 0, None)
    p.release(2)
    assert p.drained


def test_blocking_is_depth_one_use():
    p = Pipeline(2)
    for step in range(10):
        assert p.launch() == (step, step % 2)
        assert p.pop_commit() == (step, step % 2, None)
        p.release(step)
        assert p.drained


@pytest.mark.parametrize(
    "ops, message",
    [
        (["pop"], "no step in flight"),
        (["launch", "launch", "launch"], "cannot launch"),
        (["launch", "launch", "pop", "pop"], "still being committed"),
        (["launch", "pop", "release1"], "release(1)"),
        (["release0"], "release(0)"),
    ],
)
def test_misuse_raises(ops, message):
    p = Pipeline(2)
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        for op in ops:
            if op == "launch":
                p.launch()
            elif op == "pop":
                p.pop_commit()
            else:
                p.release(int(op[-1]))


def test_random_walk_keeps_invariants():
    """Random legal/illegal operations against a reference model of the invariants."""
    rng = random.Random(0)
    for num_buffers in (1, 2, 3):
        p = Pipeline(num_buffers)
        launched, committed, committing = [], [], None
        for _ in range(5000):
            op = rng.choice(["launch", "pop", "release"])
            outstanding = len(launched) - len(committed)
            if op == "launch":
                legal = outstanding < num_buffers
                if legal:
                    step, buffer = p.launch()
                    assert step == len(launched) and buffer == step % num_buffers
                    launched.append(step)
                else:
                    with pytest.raises(PipelineError):
                        p.launch()
            elif op == "pop":
                first_uncommitted = len(committed) + (committing is not None)
                legal = committing is None and first_uncommitted < len(launched)
                if legal:
                    step, _, _ = p.pop_commit()
                    assert step == first_uncommitted  # FIFO
                    committing = step
                else:
                    with pytest.raises(PipelineError):
                        p.pop_commit()
            else:
                if committing is not None:
                    p.release(committing)
                    committed.append(committing)
                    committing = None
                else:
                    with pytest.raises(PipelineError):
                        p.release(len(committed))
            # A step buffer is FREE exactly when no outstanding step uses it.
            busy = {s % num_buffers for s in launched[len(committed):]}
            for i, rec in enumerate(p.buffers):
                assert (rec.state is BufferState.FREE) == (i not in busy)
            assert p.drained == (len(launched) == len(committed))

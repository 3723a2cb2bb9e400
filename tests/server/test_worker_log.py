"""The worker's stderr: its log records become the frontend's own, and a failed start reports its last lines."""
from __future__ import annotations

import dataclasses
import logging
import sys
import time

import pytest

from frontend.server.service import Service, ServiceConfig
from frontend.server.worker_handle import WorkerDown, WorkerHandle
from shared.models.info import ModelInfo
from shared.worker_log import Formatter, decode

SIZES = dict(max_batch=8, kv_pages=64, page_size=8)


def _records_until(caplog, found, timeout_s: float = 30.0) -> list[logging.LogRecord]:
    """caplog's records once ``found(records)`` holds: the relay thread logs them as the pipe delivers them."""
    deadline = time.monotonic() + timeout_s
    while not found(caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.01)
    return list(caplog.records)


def test_a_record_survives_the_line_and_other_lines_are_not_records():
    try:
        raise ValueError("inner")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("gpu_worker.cpu_kernels", logging.INFO, __file__, 1, "level %s (100%% %s)",
                               ("avx2", "sure"), exc_info)
    line = Formatter().format(record)
    assert "\n" not in line  # one record, one line of the pipe
    back = decode(line)
    assert (back.name, back.levelno, back.levelname) == ("gpu_worker.cpu_kernels", logging.INFO, "INFO")
    assert back.getMessage().startswith("level avx2 (100% sure)\nTraceback") and "ValueError: inner" in back.getMessage()
    assert back.created == record.created and int(back.msecs) == int(record.msecs)
    for other in ("Traceback (most recent call last):", "", "[1, 2]", '{"time": 1, "level": "INFO"}', "{not json"):
        assert decode(other) is None, other


def test_the_workers_records_are_logged_by_the_frontend_at_its_level(caplog):
    caplog.set_level(logging.INFO)
    started = time.time()
    svc = Service(ServiceConfig(model="tiny-random", device="cpu", log_level="INFO", **SIZES))
    try:
        records = _records_until(caplog, lambda rs: any(r.getMessage().startswith("context: ") for r in rs))
        context = next(r for r in records if r.getMessage().startswith("context: "))
        # the worker's logger, level and clock, not the relay's
        assert context.name == "tandem.worker" and context.levelno == logging.INFO
        assert started <= context.created <= time.time()
        assert any(r.name == "gpu_worker.cpu_kernels" and "cpu kernels: level " in r.getMessage() for r in records)
    finally:
        svc.close()
    # Non-vacuity: at the frontend's WARNING the same start logs none of them.
    caplog.clear()
    caplog.set_level(logging.WARNING)
    quiet = Service(ServiceConfig(model="tiny-random", device="cpu", log_level="WARNING", **SIZES))
    quiet.close()
    assert not [r.getMessage() for r in caplog.records if r.name.startswith(("tandem.worker", "gpu_worker"))]


def test_a_worker_that_cannot_start_reports_its_last_lines_and_its_relay_ends(caplog, tmp_path):
    caplog.set_level(logging.WARNING)
    model = dataclasses.replace(ModelInfo.load("tiny-random"), path=tmp_path)  # no model there: the load raises
    handle = WorkerHandle(ServiceConfig(model="tiny-random", device="cpu", **SIZES), model, generation=1)
    try:
        with pytest.raises(WorkerDown, match="while starting: ") as down:
            handle.wait_ready()
    finally:
        handle.kill()  # (a no-op after wait_ready's failure killed it)
    assert f"FileNotFoundError: unknown model '{tmp_path}'" in str(down.value)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.worker"]  # its traceback, line by line
    assert lines[0] == "Traceback (most recent call last):" and lines[-1].startswith("FileNotFoundError:"), lines
    assert not handle._relay.is_alive() and handle.proc.stderr.closed

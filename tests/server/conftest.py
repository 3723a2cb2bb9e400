"""The ZeroMQ server's tests share one in-process server per module and a ZeroMQ context."""
from __future__ import annotations

import pytest
import zmq
from live_server import LiveServer, Raw

from shared.models.registry import load_tokenizer


@pytest.fixture(scope="module")
def live():
    srv = LiveServer()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()  # not Context.instance(): that one is the server's
    yield c
    c.destroy(linger=0)  # closes what a failed test left open


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


@pytest.fixture
def conn(live, ctx):
    c = Raw(ctx, live.endpoint)
    yield c
    c.close()

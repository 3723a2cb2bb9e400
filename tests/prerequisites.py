"""What a test needs that the machine may lack (a wheel, a model, a browser): here the test
skips, saying what is missing; under CI (``CI=true``, as .ci/run's environment sets it) it
fails, so a broken install cannot pass as a green run with tests silently skipped."""
from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason``; fail it under CI."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a missing prerequisite is a failure)")
    pytest.skip(reason, allow_module_level=True)


def require(module: str):
    """``import module``, or :func:`unavailable`."""
    try:
        return pytest.importorskip(module)
    except pytest.skip.Exception as e:
        unavailable(str(e))

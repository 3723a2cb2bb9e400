"""bench/wlinear.py runs (tiny shapes) and reports every candidate per shape and row count."""
from __future__ import annotations

import pytest

from bench import wlinear

pytestmark = pytest.mark.slow


def test_the_kernel_comparison_runs(monkeypatch):
    monkeypatch.setattr(wlinear, "SHAPES", [(64, 64), (32, 128)])
    rows = wlinear.main(["--rows", "1,5", "--repeats", "2", "--hot"])
    assert [(r["N"], r["rows"]) for r in rows] == [(64, 1), (64, 5), (32, 1), (32, 5)]
    for r in rows:
        assert {"tandem q4/32", "tandem q8/32", "torch int4/32", "torch int8/ch", "torch f32", "torch bf16"} <= set(r)
        assert all(v["us"] > 0 for v in r.values() if isinstance(v, dict))

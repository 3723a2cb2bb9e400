"""Grammars through the two-process pipeline: forward first, mask after the commit."""
from __future__ import annotations

import random

import pytest

from frontend.grammars import GrammarCompiler
from frontend.server.service import Service, ServiceConfig
from shared.finish import FinishReason
from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

SIZES = dict(max_batch=32, prefill_budget=128, kv_pages=2000, page_size=8)
EMAIL = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"
SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["cat", "dog"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "count"], "additionalProperties": False}


def make_service(**kw) -> Service:
    return Service(ServiceConfig(**{"model": "tiny-random", "device": "cpu", **SIZES, **kw}))


@pytest.fixture(scope="module")
def service():
    svc = make_service()
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def compiler(service):
    return GrammarCompiler(service.tokenizer, service.vocab_size, (2,))


def spec_for(i: int, rng: random.Random) -> dict:
    kind = ("point", "box", "point", "box", "regex", "json_schema")[i % 6]
    if kind in ("point", "box"):
        return {"kind": kind, "max_objects": rng.randint(1, 4)}
    if kind == "regex":
        return {"kind": "regex", "pattern": EMAIL}
    return {"kind": "json_schema", "schema": SCHEMA}


def check_output(spec: dict, output) -> None:
    if spec["kind"] == "point":
        pts = output["points"]
        assert len(pts) <= spec["max_objects"]
        assert all(0.0 <= p["x"] <= 1.0 and 0.0 <= p["y"] <= 1.0 for p in pts)
    elif spec["kind"] == "box":
        objs = output["objects"]
        assert len(objs) <= spec["max_objects"]
        for o in objs:
            assert 0.0 <= o["x_min"] <= o["x_max"] <= 1.0 and 0.0 <= o["y_min"] <= o["y_max"] <= 1.0
    elif spec["kind"] == "regex":
        import re

        assert re.fullmatch(EMAIL, output)
    else:
        assert output["label"] in ("cat", "dog") and 0 <= output["count"] <= 9


def test_a_thousand_constrained_requests_at_temperature_one(service, compiler):
    """The random model emits garbage unconstrained; every constrained output must parse."""
    rng = random.Random(0)
    specs, reqs = [], []
    for i in range(1000):
        spec = spec_for(i, rng)
        specs.append(spec)
        reqs.append(service.submit([rng.randrange(3, 40000) for _ in range(rng.randint(1, 12))],
                                   SamplingParams(max_tokens=120, temperature=1.0, seed=i),
                                   constraint=compiler.compile(spec).matcher()))
        if i % 64 == 63:  # keep the queue bounded like a real client load would
            service.run_until(lambda: sum(not r.ended for r in reqs) < 64, 120)
    service.run_until(service.idle, 300)
    for spec, r in zip(specs, reqs):
        assert r.error is None, r.error
        assert r.finish_reason == FinishReason.STOP, (spec, r.text)
        check_output(spec, r.output)
    def nonempty(output):
        return bool(output.get("points") or output.get("objects") or "label" in output) \
            if isinstance(output, dict) else bool(output)

    kinds = {s["kind"] for s, r in zip(specs, reqs) if nonempty(r.output)}
    assert {"point", "box", "regex", "json_schema"} <= kinds  # non-empty outputs of every kind


def test_unconstrained_random_model_emits_garbage(service):
    """Non-vacuity: without the grammar the same model does not produce parseable points."""
    from frontend.grammars import GrammarError, GrammarSpec, parse_output

    reqs = [service.submit([5, 6, 7], SamplingParams(max_tokens=24, temperature=1.0, seed=s)) for s in range(20)]
    service.run_until(service.idle, 60)
    bad = 0
    for r in reqs:
        try:
            parse_output(GrammarSpec("point", max_objects=4), r.text)
        except GrammarError:
            bad += 1
    assert bad == 20


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pipelined_equals_blocking_with_grammars(compiler, temperature):
    rng = random.Random(5)
    work = [([rng.randrange(3, 40000) for _ in range(rng.randint(1, 30))],
             spec_for(i, rng) if i % 3 else None) for i in range(24)]
    results = []
    for pipeline in (True, False):
        svc = make_service(pipeline=pipeline)
        try:
            reqs = [svc.submit(p, SamplingParams(max_tokens=60, temperature=temperature, seed=i),
                               constraint=compiler.compile(s).matcher() if s else None)
                    for i, (p, s) in enumerate(work)]
            svc.run_until(svc.idle, 120)
            results.append([(r.token_ids, r.finish_reason, r.output) for r in reqs])
        finally:
            svc.close()
    assert results[0] == results[1]
    assert sum(s is not None for _, s in work) >= 10 and sum(s is None for _, s in work) >= 5


def test_a_stale_mask_is_never_used():
    """The worker samples token k only with a mask stamped (request, k); a frontend that
    writes the previous stamp gets its request failed, never a stale-masked token."""
    from shared.shm import mask_stamp

    svc = make_service(mask_timeout_s=0.3)
    try:
        comp = GrammarCompiler(svc.tokenizer, svc.vocab_size, (2,))
        real = svc._write_mask

        def stale(req):
            if not req.token_ids:
                return real(req)  # the initial mask (token 0) is correct
            import numpy as np

            # The fresh mask, but stamped for the previous token: never written with the right stamp.
            words = np.empty((1, svc.worker.masks.words_per_row), dtype=np.int32)
            req.constraint.fill_mask(words[0])
            svc.worker.masks.write_rows([req.mask_row], mask_stamp(req.seq_id, len(req.token_ids) - 1), words)

        svc._write_mask = stale
        r = svc.submit([1, 2, 3], SamplingParams(max_tokens=40), constraint=comp.compile(
            {"kind": "point", "max_objects": 3}).matcher())
        free = svc.submit([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
        svc.run_until(lambda: r.ended and free.ended, 30)
        assert r.error is not None and "mask" in r.error[1]
        assert len(r.token_ids) == 1  # only the first token (initial mask, stamp 0) was sampled
        assert free.finish_reason == FinishReason.LENGTH
    finally:
        svc.close()


def test_stop_strings_cancel_and_length_with_grammars(service, compiler):
    spec = {"kind": "box", "max_objects": 4}
    # max_tokens mid-structure: "length" and no output.
    cut = service.submit([9, 9], SamplingParams(max_tokens=7, temperature=1.0, seed=1),
                         constraint=compiler.compile(spec).matcher())
    # A stop string inside the structure ends it as "stop": the output is then whatever parses.
    stopped = service.submit([9, 9], SamplingParams(max_tokens=100, temperature=1.0, seed=2), stop=[";"],
                             constraint=compiler.compile(spec).matcher())
    # Cancellation of a constrained request mid-way.
    cancelled = service.submit([9, 9], SamplingParams(max_tokens=100, temperature=1.0, seed=3),
                               constraint=compiler.compile(spec).matcher())
    service.run_until(lambda: len(cancelled.token_ids) >= 1)  # a box needs >= 24 tokens: still live
    service.cancel(cancelled)
    service.run_until(service.idle, 60)
    assert cut.finish_reason == FinishReason.LENGTH and cut.output is None
    assert stopped.finish_reason == FinishReason.STOP and ";" not in stopped.text
    assert cancelled.finish_reason == FinishReason.CANCELLED and cancelled.output is None
    assert len(service.free_mask_rows) == SIZES["max_batch"]


def test_cancel_while_waiting_for_a_mask_row(compiler):
    """A constrained request cancelled before a mask row freed up never reaches the worker,
    and takes no batch row when one frees (one row here: max_batch=1)."""
    svc = make_service(max_batch=1)
    try:
        spec = {"kind": "box", "max_objects": 2}
        first = svc.submit([5, 6], SamplingParams(max_tokens=30, temperature=1.0, seed=1),
                           constraint=compiler.compile(spec).matcher())
        queued = svc.submit([5, 6], SamplingParams(max_tokens=30, temperature=1.0, seed=2),
                            constraint=compiler.compile(spec).matcher())
        after = svc.submit([5, 6], SamplingParams(max_tokens=5, temperature=1.0, seed=3),
                           constraint=compiler.compile(spec).matcher())
        assert first.submitted and list(svc.unsent) == [queued, after]
        svc.cancel(queued)
        assert queued.finish_reason == FinishReason.CANCELLED and list(svc.unsent) == [after]
        svc.run_until(lambda: first.ended and after.ended, 60)
        svc.run_until(svc.idle, 30)
        assert not queued.submitted and after.submitted and after.error is None and after.token_ids
        assert svc.free_mask_rows == [0] and not svc.unsent
        assert svc.stats()["finished"] == 2  # the worker ran first and after, never queued
    finally:
        svc.close()

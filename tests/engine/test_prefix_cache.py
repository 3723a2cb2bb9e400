"""The prefix cache (gpu_worker/page_pool.py): the same tokens with the cache on and
off (whole pages mapped, a named page's shared rows copied), refcounts under a random
walk of submits, cancels, stops and evictions, and no hit on pages an in-flight
prefill is still writing."""
from __future__ import annotations

import random

import numpy as np
import pytest
from workload import BannedByLastToken

from gpu_worker.engine import Engine, EngineConfig
from gpu_worker.page_pool import PagePool
from shared.page_names import chain
from shared.sampling import SamplingParams

PAGE = 8


def make_engine(prefix_cache=True, pipeline=True, **kw) -> Engine:
    kw.setdefault("kv_pages", 600)
    kw.setdefault("prefill_budget", 40)
    return Engine(EngineConfig(model="tiny-random", device="cpu", dtype="float32", pipeline=pipeline, debug=True,
                               max_batch=16, page_size=PAGE, prefix_cache=prefix_cache, **kw))


def pool_consistent(engine: Engine) -> None:
    """Every page is exactly one of free / referenced / cached, and the references are
    exactly the pages held by the sequences admitted and not yet released."""
    pool = engine.alloc.pages
    held = np.zeros_like(pool.refs)
    for seq in engine.scheduler.running:
        for p in seq.pages:
            held[p] += 1
    assert np.array_equal(held, pool.refs), "references do not match the pages the running requests hold"
    free = set(pool._free)
    cached = set(pool.lru)
    referenced = set(np.flatnonzero(pool.refs).tolist())
    assert not (free & cached) and not (free & referenced) and not (cached & referenced)
    assert len(free) + len(cached) + len(referenced) == pool.capacity
    assert all(p in pool.hash_of for p in cached) and not any(p in pool.hash_of for p in free)
    assert {pool.page_of[h]: h for h in pool.page_of} == pool.hash_of
    assert set(pool.family_of) <= set(pool.hash_of)  # a child only while named
    assert {p: f for f, pages in pool.children.items() for p in pages} == pool.family_of


def workload(rng: random.Random) -> list[list[list[int]]]:
    """Waves of prompts built to hit: shared system prompts of several lengths (page
    multiples and one token short or over), prompts diverging mid-page, the same prompt
    twice in one wave. Each wave runs after the previous one finished."""
    systems = [[rng.randrange(3, 40000) for _ in range(n)] for n in (2 * PAGE, 3 * PAGE - 1, 3 * PAGE + 1, 5 * PAGE)]
    waves = []
    for _ in range(3):
        wave = []
        for sp in systems:
            wave.append(sp + [rng.randrange(3, 40000) for _ in range(rng.randint(1, 12))])
        base = systems[3]
        wave.append(base[:PAGE + 3] + [rng.randrange(3, 40000) for _ in range(9)])  # diverges mid-page
        wave.append(list(wave[0]))  # the same prompt twice at once
        waves.append(wave)
    return waves


def run_waves(engine: Engine, waves, params, turns: int = 2):
    """Every wave, then a multi-turn conversation: turn k+1's prompt is turn k's prompt,
    its answer and a new question. Returns each request's (wave, prompt, output, cached tokens)."""
    runs = []
    for w, wave in enumerate(waves):
        seqs = [engine.submit(p, params) for p in wave]
        engine.run_until_idle()
        runs += [(w, s.prompt_ids, s.output_ids, s.cached_tokens) for s in seqs]
    prompt = waves[0][0]
    for turn in range(turns):
        seq = engine.generate([prompt], params)[0]
        runs.append((len(waves) + turn, prompt, seq.output_ids, seq.cached_tokens))
        prompt = prompt + seq.output_ids + [100 + turn, 200 + turn, 300 + turn]
    return runs


def expected_hit(prompt: list[int], earlier: list[tuple]) -> int:
    """The prompt tokens the cache should give: its longest common prefix with an earlier, finished
    request's tokens, as far as that request's full pages go (the KV of its last token is never
    written), never the last prompt token."""
    best = 0
    for _, p, out, _ in earlier:
        tokens = p + out
        n = 0
        while n < min(len(prompt), len(tokens)) and prompt[n] == tokens[n]:
            n += 1
        best = max(best, min(n, (len(tokens) - 1) // PAGE * PAGE))
    return min(best, len(prompt) - 1)


@pytest.mark.parametrize("pipeline", [True, False])
def test_greedy_tokens_identical_with_the_cache_on_and_off(pipeline):
    rng = random.Random(7)
    waves = workload(rng)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    results = {}
    for on in (False, True):
        eng = make_engine(prefix_cache=on, pipeline=pipeline)
        results[on] = run_waves(eng, waves, params)
        stats = eng.stats()
        assert eng.idle
        pool_consistent(eng)
        eng.close()
        if on:
            assert stats["prefix_hit_tokens"] > 0 and stats["kv_pages_cached"] > 0
        else:
            assert stats["prefix_hit_tokens"] == 0 and stats["kv_pages_cached"] == 0
    off, on = results[False], results[True]
    assert [r[2] for r in on] == [r[2] for r in off]
    assert len({tuple(r[2]) for r in off}) > len(off) // 2  # non-vacuity: the prompts really differ
    assert not any(r[3] for r in off)
    # Each request maps (whole pages) or copies (the rows a named page shares) exactly its longest
    # prefix shared with a request finished before it: none in the first wave (the twin prompt is in
    # flight with its original), then the system prompts mid-page too, then the earlier turns.
    on_cached = [r[3] for r in on]
    assert on_cached == [expected_hit(p, [e for e in on if e[0] < w]) for w, p, _, _ in on]
    n = len(waves[0])
    assert on_cached[:n] == [0] * n
    assert on_cached[n:n + 3] == [2 * PAGE, 3 * PAGE - 1, 3 * PAGE + 1]  # system prompts ending on and off pages
    assert on_cached[n + 4] == PAGE + 3  # diverged in its second page
    first_turn = waves[0][0]
    assert on_cached[-2] == len(first_turn) - 1  # its wave-1 twin's pages hold it all (but the last token)
    assert on_cached[-1] == len(first_turn) + 20 - 1 - (len(first_turn) + 20 - 1) % PAGE  # the last turn's full pages


def test_identical_prompts_in_flight_do_not_share_pages_being_written():
    """Pages are named only when the launch that wrote them is committed: the second of two
    identical concurrent prompts recomputes, a third one after both hits."""
    eng = make_engine(prefill_budget=8)  # one page per launch: the prefill spans several steps
    prompt = list(range(1000, 1000 + 6 * PAGE))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = eng.submit(prompt, params)
    eng.tick()
    eng.tick()  # a's first pages are written (maybe committed), b comes now
    b = eng.submit(prompt, params)
    while eng.has_work:
        eng.tick()
        pool_consistent(eng)
    # b only maps pages a had committed before b was admitted, never the ones still being written.
    assert b.cached_tokens < a.prompt_len - PAGE
    c = eng.generate([prompt], params)[0]
    assert c.cached_tokens == 6 * PAGE - 1 and c.output_ids == a.output_ids == b.output_ids
    eng.close()


def test_debug_check_catches_a_write_into_a_cached_page():
    """Non-vacuity of the engine's exclusivity check: a page named while its owner still
    writes it (a bug the commit-time registration prevents) is caught at the next launch."""
    eng = make_engine()
    s = eng.submit(list(range(50, 50 + 3 * PAGE)), SamplingParams(max_tokens=10, ignore_eos=True))
    eng.tick()
    page = s.pages[-1]  # a page its decode steps will write
    eng.alloc.pages.register(page, b"not-yet-written")
    with pytest.raises(AssertionError, match="shared or cached kv page"):
        eng.run_until_idle()


def test_refcounts_under_a_random_walk_with_evictions():
    """Submits with shared prefixes, cancels at every phase, EOS-like stops (zombies) and a
    KV budget small enough to evict: after every step the references equal the pages the
    running requests hold, and at idle every page is free or cached."""
    rng = random.Random(11)
    eng = make_engine(kv_pages=70, prefill_budget=24)
    prefixes = [[rng.randrange(3, 40000) for _ in range(rng.choice([PAGE, 2 * PAGE, 3 * PAGE + 2]))]
                for _ in range(4)]
    live, cancels, constrained = [], 0, 0
    masks = BannedByLastToken()
    words = None
    for step in range(600):
        if rng.random() < 0.3 and len(live) < 10:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 40000) for _ in range(rng.randint(1, 10))]
            stop = [rng.randrange(3, 40000) for _ in range(64)]  # may stop mid-flight: a zombie row
            c = rng.random() < 0.2
            constrained += c
            live.append(eng.submit(prompt, SamplingParams(max_tokens=rng.randint(1, 24), temperature=1.0,
                                                          seed=step, stop_token_ids=stop), constrained=c))
        if live and rng.random() < 0.08:
            eng.cancel(live.pop(rng.randrange(len(live))))  # any phase: queued, prefilling, decoding, zombie
            cancels += 1
        if eng.has_work:
            result = eng.tick(masks=words)
            words = masks(result.mask_requests, result.mask_step)[0] if result.mask_requests else None
        pool_consistent(eng)
        live = [s for s in live if not s.released]
    eng.run_until_idle(masks)
    pool_consistent(eng)
    stats = eng.stats()
    assert eng.idle and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["prefix_hit_tokens"] > 0 and stats["prefix_cache_evictions"] > 0 and stats["zombie_rows"] > 0
    assert cancels > 5 and constrained > 3


def test_page_pool_unit():
    pool = PagePool(6)
    names = chain(list(range(16)), 4, 3)
    assert len(set(names)) == 3 and chain(list(range(16)), 4, 3) == names  # deterministic, distinct
    a = pool.acquire([], 3)
    for p, h in zip(a, names):
        pool.register(p, h)
    pool.release(a)
    assert pool.num_cached == 3 and pool.idle
    hits = pool.lookup(names[:2] + [b"other"])
    assert hits == a[:2]
    b = pool.acquire(hits, 3)  # 2 hits + 3 fresh: 2 free pages, then the one cached page left is evicted
    assert b[:2] == a[:2] and pool.evictions == 1 and pool.lookup(names) == a[:2]
    assert not pool.can_allocate(1)
    with pytest.raises(MemoryError):
        pool.acquire([], 1)
    pool.release(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(b[:1])
    assert pool.idle


def test_partial_finds_the_longest_matching_child_until_it_is_evicted():
    pool = PagePool(5)
    parent = chain(list(range(4)), 4, 1)[0]
    a, b, c = pool.acquire([], 3)
    pool.register(a, b"a", parent, b"", [7, 8, 9, 10])
    pool.register(b, b"b", parent, b"", [7, 8, 1, 2])
    pool.register(c, b"c", parent, b"lora:x", [7, 8, 9, 10])  # another salt: another family
    assert pool.partial(parent, b"", [7, 8, 9]) == (a, 3)
    assert pool.partial(parent, b"", [7, 8, 1, 2, 5]) == (b, 4)
    assert pool.partial(parent, b"lora:x", [7, 8, 1]) == (c, 2)
    assert pool.partial(parent, b"", [6, 8]) == (0, 0) and pool.partial(b"other", b"", [7]) == (0, 0)
    pool.release([a, b, c])
    assert pool.partial(parent, b"", [7, 8, 9]) == (a, 3)  # cached pages are found too, and made recent
    assert list(pool.lru) == [b, c, a]
    pool.acquire([], 3)  # one free page, then b and c are evicted
    assert pool.partial(parent, b"", [7, 8, 1]) == (a, 2) and pool.partial(parent, b"lora:x", [7]) == (0, 0)
    assert set(pool.family_of) == {a}


@pytest.mark.slow
def test_cached_tokens_reach_the_client_through_both_processes():
    """done.usage.cached_tokens travels on the first token's ring row: 0 on a miss, the
    mapped pages on a hit, 0 with the cache off."""
    from frontend.server.service import Service, ServiceConfig

    prompt = list(range(2000, 2000 + 5 * PAGE + 3))
    for on in (True, False):
        svc = Service(ServiceConfig(model="tiny-random", device="cpu", max_batch=4, page_size=PAGE,
                                    kv_pages=200, prefix_cache=on))
        try:
            usages = []
            for _ in range(2):
                done = {}
                req = svc.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                 on_event=lambda r, kind, payload, done=done: done.update(payload) if kind == "done" else None)
                svc.run_until(lambda req=req: req.ended, 60)
                usages.append(done["usage"])
            assert [u["cached_tokens"] for u in usages] == ([0, 5 * PAGE] if on else [0, 0])  # (page 6 never filled)
            assert all(u["prompt_tokens"] == len(prompt) for u in usages)
        finally:
            svc.close()

"""The engine's invariants on the tiny model: pipelined == blocking, exact forward
counts, zombies, releases, cancellation at every phase, masks, seeds, bad input."""
from __future__ import annotations

import random

import numpy as np
import pytest
from workload import VOCAB, WORDS, BannedByLastToken, workload

from gpu_worker import cpu_kernels
from gpu_worker.device import Device, DeviceError
from gpu_worker.engine import Engine, EngineConfig
from shared.finish import FinishReason
from shared.sampling import SamplingParams


def make_engine(pipeline=True, device="cpu", shared=None, **kw) -> Engine:
    """``shared``: a Device the engine runs on, with others (else its own)."""
    kw.setdefault("max_batch", 32)
    kw.setdefault("prefill_budget", 96)
    kw.setdefault("kv_pages", 1200)
    kw.setdefault("page_size", 8)
    engine = Engine(EngineConfig(model="tiny-random", device=device, pipeline=pipeline, debug=True, **kw),
                    device=shared)
    engine.masks = BannedByLastToken()  # answers the mask requests of constrained rows (see run)
    return engine


def run(engine, reqs, stops=None):
    seqs = []
    for i, r in enumerate(reqs):
        kw = dict(r["params"])
        if stops and i in stops:
            kw["stop_token_ids"] = [stops[i]]
        seqs.append(engine.submit(r["prompt"], SamplingParams(**kw), constrained=r["constrained"]))
    engine.run_until_idle(engine.masks)
    return seqs


def check_accounting(engine, seqs, pipelined):
    for s in seqs:
        assert s.done and s.released, s
        # Every sampling row launched is a committed token or a zombie row.
        assert s.num_dispatched == len(s.output_ids) + s.zombie_rows
        assert len(s.output_ids) <= s.max_tokens
        if s.finish_reason == FinishReason.LENGTH:
            assert len(s.output_ids) == s.max_tokens and s.zombie_rows == 0
        if s.finish_reason == FinishReason.STOP:
            assert s.zombie_rows <= (1 if pipelined else 0)
    assert engine.idle and engine.alloc.idle
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["rows_free"] == stats["rows_total"]


@pytest.fixture(scope="module")
def reference():
    """A blocking run without stops, then stop ids chosen to end requests at varied positions."""
    reqs = workload()
    eng = make_engine(pipeline=False)
    base = run(eng, reqs)
    eng.close()
    rng = random.Random(1)
    stops = {}
    for i, s in enumerate(base):
        if i % 3 == 0 and len(s.output_ids) > 1:
            stops[i] = s.output_ids[rng.randrange(len(s.output_ids))]
    return reqs, stops


@pytest.mark.parametrize("device, dtype, quantization", [("cpu", None, "auto"), ("cpu", "float32", "auto"),
                                                         ("sim:1", None, "auto"), ("cpu", None, "int8"),
                                                         ("cpu", None, "int4")])
@pytest.mark.slow
def test_pipelined_equals_blocking(reference, device, dtype, quantization):
    """Default dtype (bf16 where the CPU kernels build or the CPU has native bf16) and fp32; weights quantized at load."""
    reqs, stops = reference
    outs = {}
    for pipelined in (False, True):
        eng = make_engine(pipeline=pipelined, device=device, dtype=dtype, quantization=quantization)
        seqs = run(eng, reqs, stops)
        check_accounting(eng, seqs, pipelined)
        outs[pipelined] = [(s.output_ids, s.finish_reason) for s in seqs]
        if pipelined:
            assert eng.stats()["zombie_rows"] > 0  # stops really happened mid-pipeline
            assert eng.masks.calls > 0
        eng.close()
    assert sum(r == FinishReason.STOP for _, r in outs[True]) >= 10
    assert outs[True] == outs[False]


# The CPU kernels' ISA levels this CPU runs, up to $TANDEM_CPU_LEVEL's cap.
CPU_LEVELS = [level.name for level in cpu_kernels.choosable_levels()]


@pytest.mark.slow
@pytest.mark.parametrize("level", CPU_LEVELS)
def test_pipelined_equals_blocking_at_every_cpu_kernels_level(reference, level, monkeypatch):
    """bf16 on the CPU runs the fused kernels: at each ISA level (capped through TANDEM_CPU_LEVEL)
    the two schedules give the same tokens (a third of the workload: the level is what varies)."""
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, level)
    reqs, stops = reference
    reqs = reqs[:24]
    outs = {}
    for pipelined in (False, True):
        eng = make_engine(pipeline=pipelined, dtype="bfloat16")
        try:
            assert eng.runner.model.cpu_kernels.level == level
            seqs = run(eng, reqs, {i: t for i, t in stops.items() if i < len(reqs)})
            check_accounting(eng, seqs, pipelined)
        finally:
            eng.close()
        outs[pipelined] = [(s.output_ids, s.finish_reason) for s in seqs]
    assert sum(r == FinishReason.STOP for _, r in outs[True]) >= 3
    assert outs[True] == outs[False]


def test_engines_sharing_a_device_give_their_own_tokens_and_leave_it_open(reference):
    """Engines on one Device (a benchmark's modes: one compute thread) run one after another with the
    tokens each gives alone; closing one leaves the device to the others."""
    reqs, stops = reference
    reqs = reqs[:12]
    alone = {}
    for pipelined in (False, True):
        eng = make_engine(pipeline=pipelined)
        alone[pipelined] = [s.output_ids for s in run(eng, reqs, stops)]
        eng.close()
    shared = Device("cpu")
    try:
        engines = {p: make_engine(pipeline=p, shared=shared) for p in (False, True)}
        first = [s.output_ids for s in run(engines[True], reqs, stops)]
        engines[True].close()
        assert shared.compute._thread.is_alive()
        second = [s.output_ids for s in run(engines[False], reqs, stops)]
        engines[False].close()
        assert first == alone[True] and second == alone[False]
    finally:
        shared.close()
    assert not shared.compute._thread.is_alive()


def test_non_vacuity_a_different_run_is_detected(reference):
    reqs, stops = reference
    eng = make_engine()
    a = [s.output_ids for s in run(eng, reqs[:8], stops)]
    changed = [dict(r, params=dict(r["params"], temperature=1.0, seed=99)) for r in reqs[:8]]
    b = [s.output_ids for s in run(eng, changed, stops)]
    eng.close()
    assert a != b


@pytest.mark.slow
def test_masks_are_respected(reference):
    reqs, _ = reference
    eng = make_engine()
    seqs = run(eng, reqs)
    eng.close()
    constrained = [s for s, r in zip(seqs, reqs) if r["constrained"]]
    assert sum(len(s.output_ids) for s in constrained) > 20
    for s in constrained:
        for prev, tok in zip(s.output_ids, s.output_ids[1:]):
            assert tok % 5 != prev % 5


@pytest.mark.parametrize("pipelined", [True, False])
def test_greedy_rows_sample_the_same_tokens_on_the_host_shortcut(pipelined, monkeypatch):
    """On a CPU plain greedy steps are sampled by numpy (sampler.greedy_on_host); a step where some row
    asks for logprobs goes through sample(). Both give each request the same tokens and stop at the
    same stop id (each request's own fifth token)."""
    from gpu_worker import model_runner
    calls = []
    spy = model_runner.greedy_on_host
    monkeypatch.setattr(model_runner, "greedy_on_host", lambda *a: calls.append(1) or spy(*a))
    prompts = [[5 + i, 9, 13 * i % 200 + 1, 7] for i in range(6)]

    def generate(stops, logprobs):
        eng = make_engine(pipeline=pipelined)
        seqs = [eng.submit(p, SamplingParams(max_tokens=12, stop_token_ids=s), logprobs=logprobs)
                for p, s in zip(prompts, stops)]
        eng.run_until_idle()
        eng.close()
        return [s.output_ids for s in seqs]

    free = generate([[]] * len(prompts), False)
    stops = [[out[4]] for out in free]
    calls.clear()
    on_host = generate(stops, False)
    assert calls, "the plain greedy run took the host shortcut"
    taken = len(calls)
    assert generate(stops, True) == on_host
    assert len(calls) == taken  # the logprobs run never took it
    assert all(len(out) <= 5 and out[-1] == s[0] for out, s in zip(on_host, stops))  # each stopped on its id


def test_exact_forward_counts_for_length_caps():
    eng = make_engine()
    seqs = [eng.submit([5] * plen, SamplingParams(max_tokens=k, ignore_eos=True))
            for plen, k in [(1, 1), (3, 2), (40, 17), (150, 64), (9, 5)]]
    eng.run_until_idle()
    for s, k in zip(seqs, [1, 2, 17, 64, 5]):
        assert len(s.output_ids) == k and s.num_dispatched == k and s.zombie_rows == 0
    assert eng.stats()["sample_rows"] == 1 + 2 + 17 + 64 + 5
    assert eng.stats()["zombie_rows"] == 0
    eng.close()


def test_seeded_sampling_ignores_batch_mates_and_mode():
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234)
    prompt = [7, 8, 9, 10]
    eng = make_engine(pipeline=False)
    alone = eng.generate([prompt], params)[0].output_ids
    eng.close()
    eng = make_engine(pipeline=True)
    mates = [eng.submit([11] * 30, SamplingParams(max_tokens=30, temperature=1.0)) for _ in range(5)]
    crowd = eng.submit(prompt, params)  # a different batch row, other rows around it
    eng.run_until_idle()
    eng.close()
    assert crowd.row != 0 and crowd.output_ids == alone
    assert any(m.output_ids != alone for m in mates)


# ------------------------------------------------------------------ cancellation


def _step_until(eng, cond, limit=500):
    for _ in range(limit):
        if cond():
            return
        eng.tick()
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("pipelined", [True, False])
def test_cancel_at_every_phase(pipelined):
    eng = make_engine(pipeline=pipelined, prefill_budget=16)
    p = SamplingParams(max_tokens=50, ignore_eos=True)

    queued = eng.submit([3] * 10, p)
    eng.cancel(queued)
    eng.tick()
    assert queued.finish_reason == FinishReason.CANCELLED and not queued.admitted and queued.output_ids == []

    mid_prefill = eng.submit([4] * 100, p)  # 7 chunks of 16
    _step_until(eng, lambda: 0 < mid_prefill.num_prefilled < 100)
    eng.cancel(mid_prefill)

    in_flight = eng.submit([5] * 5, p)
    _step_until(eng, lambda: len(in_flight.output_ids) >= 3)
    eng.cancel(in_flight)
    n = len(in_flight.output_ids)

    eng.run_until_idle()
    assert mid_prefill.finish_reason == FinishReason.CANCELLED and mid_prefill.output_ids == []
    assert in_flight.finish_reason == FinishReason.CANCELLED and len(in_flight.output_ids) <= n + 1
    for s in (mid_prefill, in_flight):
        assert s.released
    assert eng.idle
    eng.close()


def test_cancel_on_the_eos_step_and_as_zombie():
    eng = make_engine(pipeline=True)
    base = eng.generate([[9] * 6], SamplingParams(max_tokens=10))[0].output_ids
    first = next(i for i in range(2, 10) if base.index(base[i]) == i)
    stop = base[first]
    # Cancel lands in the same tick as the stop token's commit.
    s = eng.submit([9] * 6, SamplingParams(max_tokens=10, stop_token_ids=[stop]))
    _step_until(eng, lambda: len(s.output_ids) == first)  # the stop token is next to commit
    eng.cancel(s)
    eng.run_until_idle()
    assert s.finish_reason in (FinishReason.STOP, FinishReason.CANCELLED) and s.released
    # Cancel a zombie: already finalized by its stop, a step still in flight.
    z = eng.submit([9] * 6, SamplingParams(max_tokens=10, stop_token_ids=[stop]))
    _step_until(eng, lambda: z.finalized)
    assert z.inflight_refs == 1 and not z.released  # it rides one extra step
    eng.cancel(z)
    eng.run_until_idle()
    assert z.finish_reason == FinishReason.STOP and z.output_ids == base[: first + 1] and z.released
    assert eng.idle
    eng.close()


# ------------------------------------------------------------------ failures and bad input


def test_debug_poison_catches_a_gather_of_an_unwritten_token():
    eng = make_engine()
    import torch

    with pytest.raises(RuntimeError, match="unwritten pending token"):
        eng.runner.gather_pending(torch.tensor([3]))
    eng.close()


def test_bad_input_fails_that_request_only():
    eng = make_engine(max_model_len=256)
    with pytest.raises(ValueError, match="top_p"):
        eng.submit([1, 2], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="prompt"):
        eng.submit([1] * 300, SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        eng.submit([VOCAB + 5], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        eng.submit([], SamplingParams())
    ok = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]
    assert len(ok.output_ids) == 4 and eng.idle
    eng.close()


def test_a_request_must_fit_the_whole_kv_cache_and_the_vocabulary():
    eng = make_engine(kv_pages=5, max_model_len=256)
    room = eng.alloc.pages.capacity * eng.alloc.page_size  # tokens the whole cache holds
    assert room < 256
    with pytest.raises(ValueError, match=r"max_tokens: prompt \+ max_tokens needs more KV pages than the cache has"):
        eng.submit([1] * 10, SamplingParams(max_tokens=room - 9))
    with pytest.raises(ValueError, match="stop_token_ids contains an invalid token id"):
        eng.submit([1, 2], SamplingParams(stop_token_ids=[3, eng.vocab_size]))
    full = eng.generate([[1] * 10], SamplingParams(max_tokens=room - 10, ignore_eos=True))[0]
    assert len(full.output_ids) == room - 10 and eng.idle
    rest = eng.generate([[1] * 10], SamplingParams(ignore_eos=True))[0]  # max_tokens omitted: what the cache holds
    assert len(rest.output_ids) == room - 10 and eng.idle
    with pytest.raises(ValueError, match="prompt"):
        eng.submit([1] * (room + 1), SamplingParams())
    eng.close()


def test_max_tokens_omitted_is_the_rest_of_the_context():
    eng = make_engine(max_model_len=64)
    seqs = eng.generate([[3] * n for n in (1, 40, 63)], SamplingParams(ignore_eos=True))
    assert [len(s.output_ids) for s in seqs] == [63, 24, 1]
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs) and eng.idle
    eng.close()


def test_mask_failure_fails_only_that_request():
    eng = make_engine()

    def provider(seqs, step):
        words = np.full((len(seqs), WORDS), -1, dtype=np.int32)
        return words, np.array([s.seq_id == bad.seq_id for s in seqs])

    bad = eng.submit([1, 2, 3], SamplingParams(max_tokens=8), constrained=True)
    good = eng.submit([1, 2, 3], SamplingParams(max_tokens=8), constrained=True)
    free = eng.submit([1, 2, 3], SamplingParams(max_tokens=8))
    eng.run_until_idle(provider)
    assert bad.finish_reason == FinishReason.ERROR and "mask" in bad.error
    assert len(good.output_ids) == 8 and len(free.output_ids) == 8
    assert eng.idle
    eng.close()


def test_device_error_fails_requests_and_engine_keeps_serving():
    eng = make_engine()
    real = eng.runner.model.forward
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*a, **k)

    eng.runner.model.forward = flaky
    victims = [eng.submit([1, 2, 3], SamplingParams(max_tokens=10)) for _ in range(2)]
    eng.run_until_idle()
    assert all(v.finish_reason == FinishReason.ERROR for v in victims)
    after = eng.generate([[4, 5]], SamplingParams(max_tokens=3))[0]
    assert len(after.output_ids) == 3 and eng.idle
    eng.close()
    assert DeviceError  # the error type the host sees


@pytest.mark.slow
def test_default_model_answers_paris():
    """The embedded default model, converted from GGUF, greedy, with the chat template."""
    from frontend.server.tokenization import chat_prompt_ids
    from shared.models.registry import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    for pipelined in (True, False):
        eng = Engine(EngineConfig(model="smollm2-135m", device="cpu", pipeline=pipelined, max_batch=4))
        seq = eng.generate([ids], SamplingParams(max_tokens=24))[0]
        eng.close()
        assert "Paris" in tok.decode(seq.output_ids, skip_special_tokens=True)
        assert seq.finish_reason == FinishReason.STOP  # ended on EOS


def test_unconstrained_rows_are_sampled_before_masks_are_awaited():
    """In a mixed batch the host asks for masks only after the unconstrained rows'
    sampling is enqueued: their tokens are on the device while the constrained rows
    (still poisoned in debug mode) wait."""
    from gpu_worker.model_runner import POISON

    eng = make_engine()
    checked = {"n": 0}
    inner = BannedByLastToken()

    def provider(seqs, step):
        eng.device.compute.record().synchronize()  # everything enqueued so far has run
        launch = eng.awaiting_masks
        assert launch.step == step
        for s in launch.sample_seqs:
            if s.num_dispatched >= 2 and not s.finalized:  # a decode row of this step
                value = int(eng.runner.pending[s.row])
                assert (value == POISON) == s.constrained, (s.seq_id, s.constrained, value)
                checked["n"] += 1
        return inner(seqs, step)

    seqs = [eng.submit([3, 4, 5 + i], SamplingParams(max_tokens=12, ignore_eos=True), constrained=i % 2 == 0)
            for i in range(6)]
    eng.run_until_idle(provider)
    eng.close()
    assert checked["n"] > 20 and all(len(s.output_ids) == 12 for s in seqs)


def test_warmup_captures_each_bucket_once_and_reports_progress():
    """Warm-up visits every (step buffer, batch bucket, page bucket) once and reports done/total
    after each (the worker forwards it to the frontend; capture itself needs CUDA)."""
    eng = make_engine()
    try:
        runner = eng.runner
        runner.use_graphs = True  # CPU: record the captures instead of making them
        keys, seen = [], []
        runner._graph_for = lambda buffer, batch, pages: keys.append((buffer, batch, pages))
        runner.warmup(progress=lambda done, total: seen.append((done, total)))
        assert len(keys) == len(set(keys)) == 12  # 2 step buffers x 3 batch sizes x 2 page buckets
        assert seen == [(i + 1, 12) for i in range(12)]
    finally:
        eng.close()


def test_the_protocols_64_stop_token_ids_fit_on_the_device():
    """Regression: the device kept 8 stop ids per row while the protocol allows 64; a request
    with more failed its launch, and with it every request in the same steps."""
    from shared.sampling import MAX_STOP_TOKEN_IDS

    eng = make_engine()
    base = eng.generate([[9] * 6], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_ids
    stop = base[5]
    first = base.index(stop)
    others = [t for t in range(3, 3 + 2 * MAX_STOP_TOKEN_IDS) if t not in base][:MAX_STOP_TOKEN_IDS - 1]
    many = eng.submit([9] * 6, SamplingParams(max_tokens=10, stop_token_ids=others + [stop], ignore_eos=True))
    mate = eng.submit([7] * 6, SamplingParams(max_tokens=10, ignore_eos=True))
    eng.run_until_idle()
    assert many.error is None and mate.error is None
    assert many.output_ids == base[:first + 1] and many.finish_reason == FinishReason.STOP
    assert len(mate.output_ids) == 10 and eng.idle
    eng.close()


def test_bf16_cpu_weights_are_prepacked_unless_disabled():
    """bf16 on the CPU runs PackedLinear matmuls where the kernels' AMX matmul or oneDNN's bf16 prepack
    takes them (test_pipelined_equals_blocking covers their tokens); float32, prepack=False and a CPU
    with neither keep the plain nn.Linear."""
    import torch

    from gpu_worker.cpu_backend import PackedLinear, onednn_packs_bf16

    for dtype, prepack, want in (("bfloat16", True, True), ("bfloat16", False, False), ("float32", True, False)):
        eng = make_engine(dtype=dtype, prepack=prepack)
        amx = eng.runner.model.cpu_kernels is not None and eng.runner.model.cpu_kernels.has_matmul
        want = want and (amx or onednn_packs_bf16())  # else bf16 linears stay plain (oneDNN refuses them)
        try:
            kinds = {type(m) for m in eng.runner.model.modules() if isinstance(m, torch.nn.Linear)}
        finally:
            eng.close()
        assert kinds == ({PackedLinear} if want else {torch.nn.Linear}), (dtype, prepack, kinds)


def test_the_default_context_is_the_models_limit_bounded_by_the_kv_cache():
    from shared.models.random_weights import TINY_RANDOM_CONFIG

    limit = TINY_RANDOM_CONFIG["max_position_embeddings"]
    roomy = make_engine(max_batch=2)  # 1200 pages of 8 tokens: the whole limit fits
    assert (roomy.max_model_len, roomy.runner.context_reason) == (limit, f"the model's limit, "
                                                                         f"max_position_embeddings {limit}")
    roomy.close()
    small = make_engine(max_batch=2, kv_pages=5)  # page 0 is scratch: 4 pages of 8 tokens
    assert small.max_model_len == 4 * 8 == small.alloc.pages.capacity * small.alloc.page_size
    assert small.runner.context_reason.startswith("what the KV cache holds")
    with pytest.raises(ValueError, match="do not fit the context of 32"):
        small.submit([1] * 32, SamplingParams())
    assert len(small.generate([[1] * 31], SamplingParams(max_tokens=100, ignore_eos=True))[0].output_ids) == 1
    small.close()


@pytest.mark.parametrize("requested, kv_tokens, expected, why", [
    (None, None, 2048, "the model's limit, max_position_embeddings 2048"),
    (None, 4096, 2048, "the model's limit, max_position_embeddings 2048"),
    (None, 512, 512, "what the KV cache holds, below the model's limit of 2048 (--kv-pages, --kv-memory-fraction)"),
    (1024, 4096, 1024, "--max-model-len"),
    (4096, None, 2048, "the model's limit; --max-model-len 4096 asked for more"),
    (1024, 512, 1024, "--max-model-len; the KV cache holds only 512 tokens"),  # asked for: it stands
])
def test_context_length_and_its_reason(requested, kv_tokens, expected, why):
    from gpu_worker.model_runner import context_length

    assert context_length(requested, 2048, kv_tokens) == (expected, why)

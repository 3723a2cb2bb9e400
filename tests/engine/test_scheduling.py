"""Direct tests of the worker's bookkeeping parts, without an engine: the allocator (KV pages and
batch rows), the scheduler (FIFO admission, the prefill budget, decode rows) and the sampler
(top-k/top-p truncation against a reference computation, counter-based sampling)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.allocator import Allocator, FreeList
from shared.page_names import chain
from gpu_worker.sampler import FLAG_STOP, RowParams, _filter, apply_bitmask, sample
from gpu_worker.scheduler import Scheduler
from gpu_worker.sequence import Sequence
from shared.finish import FinishReason
from shared.sampling import SamplingParams

VOCAB = 100  # the widest logits these tests sample

PAGE = 4


def seq(i: int, prompt_len: int, max_tokens: int = 4, tokens: list[int] | None = None) -> Sequence:
    return Sequence(i, tokens or [100 + i] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens, seed=i)


# --------------------------------------------------------------------------- allocator


def test_free_list_hands_out_lowest_first_and_refuses_double_and_foreign_frees():
    rows = FreeList("rows", range(4))
    assert rows.allocate(2) == [0, 1] and rows.num_free == 2
    with pytest.raises(MemoryError):
        rows.allocate(3)
    assert rows.num_free == 2  # a refused allocation takes nothing
    rows.free([1])
    with pytest.raises(RuntimeError, match="double free of 1"):
        rows.free([1])
    with pytest.raises(RuntimeError, match="double free of 3"):  # never handed out
        rows.free([3])
    rows.free([0])
    assert rows.num_free == rows.capacity == 4


@pytest.mark.parametrize("tokens, pages", [(0, 0), (1, 1), (PAGE, 1), (PAGE + 1, 2), (3 * PAGE, 3)])
def test_pages_for_rounds_up(tokens, pages):
    assert Allocator(16, PAGE, 2).pages_for(tokens) == pages


def test_allocator_admits_while_rows_and_pages_last_and_release_makes_it_idle():
    alloc = Allocator(num_pages=9, page_size=PAGE, max_rows=2)  # 8 usable pages (page 0 is scratch)
    assert alloc.can_admit(8 * PAGE) and not alloc.can_admit(8 * PAGE + 1)
    row_a, pages_a = alloc.admit(5 * PAGE)
    assert len(pages_a) == 5 and 0 not in pages_a and not alloc.idle
    assert not alloc.can_admit(4 * PAGE) and alloc.can_admit(3 * PAGE)  # pages run out first
    row_b, pages_b = alloc.admit(PAGE)
    assert {row_a, row_b} == {0, 1} and not set(pages_a) & set(pages_b)
    assert not alloc.can_admit(1)  # rows run out
    alloc.release(row_a, pages_a)
    alloc.release(row_b, pages_b)
    assert alloc.idle
    with pytest.raises(RuntimeError):
        alloc.release(row_b, pages_b)


# --------------------------------------------------------------------------- scheduler


def test_admission_is_fifo_and_reserves_prompt_plus_max_tokens():
    alloc = Allocator(num_pages=11, page_size=PAGE, max_rows=8)  # 10 usable pages
    sched = Scheduler(alloc, prefill_budget=1000)
    big, small = seq(0, 6 * PAGE, max_tokens=2 * PAGE), seq(1, PAGE - 1, max_tokens=1)
    first = seq(2, 2 * PAGE, max_tokens=PAGE)
    for s in (first, big, small):
        sched.add(s)
    _, admitted = sched.plan()
    # first takes 3 pages; big needs 8 of the 7 left and waits; small would fit but does not overtake it
    assert admitted == [first] and len(first.pages) == 3 and list(sched.waiting) == [big, small]
    first.finalize(FinishReason.STOP)
    sched.remove(first)
    alloc.release(first.row, first.pages)
    _, admitted = sched.plan()
    assert admitted == [big, small] and len(big.pages) == 8 and len(small.pages) == 1


def test_prefill_is_chunked_by_the_budget_oldest_first_and_decode_rows_join_when_prefilled():
    sched = Scheduler(Allocator(num_pages=64, page_size=PAGE, max_rows=8), prefill_budget=10)
    a, b = seq(0, 7), seq(1, 9)
    sched.add(a)
    sched.add(b)
    plan, _ = sched.plan()
    assert [(c.seq, c.start, c.length, c.final) for c in plan.prefill] == [(a, 0, 7, True), (b, 0, 3, False)]
    assert plan.decode == []
    a.num_prefilled, b.num_prefilled = 7, 3  # what the engine does when it launches the plan
    plan, _ = sched.plan()
    assert plan.decode == [a] and [(c.seq, c.start, c.length) for c in plan.prefill] == [(b, 3, 6)]
    b.num_prefilled = 9
    a.num_dispatched = a.max_tokens  # its last token is launched: no more decode
    plan, _ = sched.plan()
    assert plan.decode == [b] and plan.prefill == []
    b.finalize(FinishReason.CANCELLED)
    assert not sched.plan()[0]  # a finalized sequence is neither decoded nor prefilled


def test_a_request_cancelled_while_queued_is_dropped_without_pages():
    alloc = Allocator(num_pages=9, page_size=PAGE, max_rows=2)
    sched = Scheduler(alloc, prefill_budget=100)
    gone, kept = seq(0, PAGE), seq(1, PAGE)
    sched.add(gone)
    sched.add(kept)
    gone.finalize(FinishReason.CANCELLED)
    _, admitted = sched.plan()
    assert admitted == [kept] and not gone.admitted and gone.pages == [] and not sched.waiting


def test_cached_prompt_pages_are_mapped_and_the_last_token_is_recomputed():
    alloc = Allocator(num_pages=32, page_size=PAGE, max_rows=4)
    sched = Scheduler(alloc, prefill_budget=100)
    prompt = list(range(10, 10 + 3 * PAGE))  # exactly three full pages
    first = seq(0, 0, tokens=prompt)
    sched.add(first)
    sched.plan()
    for page, name in zip(first.pages, chain(prompt, PAGE, 3)):  # the engine names pages whose KV is complete
        alloc.pages.register(page, name)
    again = seq(1, 0, tokens=list(prompt))
    sched.add(again)
    plan, admitted = sched.plan()
    # two pages mapped, not three: the last prompt token's logits sample the first output token
    assert admitted == [again] and again.pages[:2] == first.pages[:2] and again.cached_tokens == 2 * PAGE
    assert [(c.seq, c.start, c.length) for c in plan.prefill if c.seq is again] == [(again, 2 * PAGE, PAGE)]
    other = seq(2, 0, tokens=[7] + prompt[1:])  # non-vacuity: another first token, no hit
    sched.add(other)
    sched.plan()
    assert other.cached_tokens == 0 and not set(other.pages) & set(first.pages)


# --------------------------------------------------------------------------- sampler


def reference_top_k_top_p(row: np.ndarray, k: int, p: float) -> np.ndarray:
    """The kept logits of one row (others -inf), computed the textbook way in float64: the k
    largest (k = 0: all), then the smallest set of the most likely of those whose probability
    reaches p."""
    order = np.argsort(-row, kind="stable")
    keep = order[:k] if k > 0 else order
    probs = np.exp(row[keep] - row[keep].max())
    probs /= probs.sum()
    n = int(np.searchsorted(np.cumsum(probs), p - 1e-6) + 1)  # first prefix whose mass reaches p
    out = np.full_like(row, -np.inf)
    out[keep[:n]] = row[keep[:n]]
    return out


@pytest.mark.parametrize("k, p", [(0, 1.0), (5, 1.0), (0, 0.5), (7, 0.3), (3, 0.99), (1, 0.9), (0, 0.999)])
def test_top_k_top_p_keeps_what_the_reference_keeps(k, p):
    rng = np.random.default_rng(k * 100 + int(p * 1000))
    logits = rng.normal(0, 2, size=(6, 50)).astype(np.float32)
    got = _filter(torch.from_numpy(logits), torch.zeros(6), torch.full((6,), k), torch.full((6,), p)).numpy()
    for row, out in zip(logits, got):
        want = reference_top_k_top_p(row.astype(np.float64), k, p)
        assert np.array_equal(np.isfinite(out), np.isfinite(want)), (k, p)
        np.testing.assert_array_equal(out[np.isfinite(out)], row[np.isfinite(want)])
    kept = np.isfinite(got).sum(axis=1)
    if k or p < 1:  # non-vacuity: the truncation dropped tokens
        assert (kept < 50).all(), kept
    else:
        assert (kept == 50).all()


def test_top_k_top_p_applies_per_row_parameters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    out = _filter(logits, torch.zeros(3), torch.tensor([1, 0, 3]), torch.tensor([1.0, 0.7, 1.0]))  # p: 0.64, 0.24, ...
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 2, 3]


def make_params(rows: int, **kw) -> RowParams:
    params = RowParams(rows, VOCAB, torch.device("cpu"))
    for r in range(rows):
        params.set_row(r, SamplingParams(**kw), seed=1234 + r, eos_ids=(2,))
    return params


def test_sampled_tokens_follow_the_truncated_distribution():
    """Over many positions of one seeded row, counter-based Gumbel-max picks each kept token
    about as often as its probability after temperature and top-k/top-p, and never a dropped one."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0]])
    params = make_params(1, temperature=0.7, top_k=6, top_p=0.9)
    n = 20_000
    tokens, *_ = sample(logits.expand(n, -1), torch.zeros(n, dtype=torch.long), torch.arange(n), params,
                          any_random=True, any_filter=True, want_logprobs=False)
    counts = np.bincount(tokens.numpy(), minlength=8) / n
    truncated = reference_top_k_top_p(logits[0].double().numpy() / 0.7, 6, 0.9)
    want = np.exp(truncated - truncated.max())
    want /= want.sum()
    assert (counts[want == 0] == 0).all() and (want == 0).sum() >= 3, (counts, want)  # tokens were dropped
    np.testing.assert_allclose(counts, want, atol=0.015)


def test_a_seeded_row_samples_the_same_tokens_whatever_its_batch_row_and_mates():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = RowParams(4, VOCAB, torch.device("cpu"))
    same = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4)
    params.set_row(0, same, seed=99, eos_ids=())
    params.set_row(3, same, seed=99, eos_ids=())
    params.set_row(1, SamplingParams(temperature=1.0), seed=5, eos_ids=())
    pos = torch.tensor([7, 7, 7])
    run = dict(any_random=True, any_filter=True, want_logprobs=False)
    a, *_ = sample(logits[[0, 1, 2]], torch.tensor([0, 1, 2]), pos, params, **run)
    b, *_ = sample(logits[[2, 1, 0]], torch.tensor([1, 2, 3]), pos, params, **run)  # row 3 has row 0's seed
    assert a[0] == b[2]
    draws = [sample(logits[[0]], torch.tensor([0]), torch.tensor([p]), params, **run)[0].item() for p in range(40)]
    assert len(set(draws)) > 1  # non-vacuity: the noise does change with the position


def test_greedy_rows_take_the_argmax_and_stop_tokens_are_flagged():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]])
    params = make_params(2, temperature=0.0)
    tokens, flags, logprobs, _ = sample(logits, torch.tensor([0, 1]), torch.tensor([0, 0]), params,
                                     any_random=False, any_filter=False, want_logprobs=True)
    assert tokens.tolist() == [1, 0]
    params.set_row(1, SamplingParams(stop_token_ids=(0,)), seed=0, eos_ids=(2,))
    _, flags, *_ = sample(logits, torch.tensor([0, 1]), torch.tensor([0, 0]), params, False, False, False)
    assert flags.tolist() == [0, FLAG_STOP]
    np.testing.assert_allclose(logprobs.numpy(), torch.log_softmax(logits, -1).max(-1).values.numpy(), rtol=1e-6)


def test_apply_bitmask_leaves_only_the_allowed_tokens():
    vocab = 40
    allowed = {0, 3, 31, 32, 39}
    words = np.zeros(2, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    out = apply_bitmask(torch.zeros(1, vocab), torch.from_numpy(words.view(np.int32))[None])
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_the_stop_ids_until_the_position_after_it(temperature):
    """vLLM's min_tokens: while fewer than min_tokens tokens were generated (position < prompt length
    + min_tokens) the row's EOS and stop_token_ids cannot be sampled, however likely; from then on they
    can, and a row without min_tokens is untouched."""
    logits = torch.tensor([[-30.0, 30.0, 29.0, 10.0]]).expand(2, -1)  # the stops (1, 2) by far the most likely
    params = RowParams(2, 4, torch.device("cpu"))
    params.set_row(0, SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(2,)), seed=1,
                   eos_ids=(1,), prompt_ids=[5, 6])
    params.set_row(1, SamplingParams(temperature=temperature, stop_token_ids=(2,)), seed=1, eos_ids=(1,),
                   prompt_ids=[5, 6])
    run = dict(any_random=temperature > 0, any_filter=False, want_logprobs=False, any_min_tokens=True)
    rows = torch.tensor([0, 1])
    for position, early in [(2, True), (4, True), (5, False), (9, False)]:
        tokens, flags, *_ = sample(logits, rows, torch.tensor([position, position]), params, **run)
        assert tokens[1] in (1, 2) and flags[1] == FLAG_STOP  # no min_tokens: a stop at once
        if early:  # neither EOS (1) nor the stop token id (2): token 3 it is
            assert tokens[0] == 3 and flags[0] == 0, position
        else:
            assert tokens[0] in (1, 2) and flags[0] == FLAG_STOP, position

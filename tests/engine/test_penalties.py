"""Penalties, logit_bias and min_p: the device sampler against plain per-row references on the
same logits, the token counts the sampler keeps, and the engine's two schedules with them on; the
sampler's argmax against aten's."""
from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.engine import Engine, EngineConfig
from gpu_worker.sampler import (RowParams, _filter, apply_logit_bias, apply_penalties, argmax_rows, greedy_on_host,
                                sample)
from shared.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from workload import BannedByLastToken

VOCAB = 64


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> torch.Tensor:
    """One row, token by token, as vLLM's apply_penalties defines it."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] = out[t] - torch.tensor(frequency) * output.count(t) - torch.tensor(presence)
    return out


def random_rows(rng: random.Random, n: int):
    """Per row: (prompt ids, generated ids, SamplingParams with penalties and a bias)."""
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        output = [rng.randrange(VOCAB // 2) for _ in range(rng.randrange(0, 30))]  # repeats are likely
        bias = {rng.randrange(VOCAB): rng.uniform(-150, 150) for _ in range(rng.randrange(0, 6))}
        params = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                                repetition_penalty=rng.uniform(0.5, 2.0), logit_bias=bias)
        rows.append((prompt, output, params))
    return rows


def fill(params: RowParams, rows) -> None:
    """Admit every row, then count its generated tokens as the sampler does, one step at a time."""
    for r, (prompt, _, p) in enumerate(rows):
        params.set_row(r, p, seed=r, eos_ids=(), prompt_ids=prompt)
    longest = max(len(out) for _, out, _ in rows)
    for step in range(longest):
        live = [r for r, (_, out, _) in enumerate(rows) if step < len(out)]
        params.count(torch.tensor(live), torch.tensor([rows[r][1][step] for r in live]))


def test_argmax_rows_is_atens_argmax_with_ties_nans_and_masked_rows():
    """numpy's argmax on a CPU must pick aten's index: the first of equal maxima, a row's first NaN,
    0 for a row masked to -inf; strided rows too."""
    g = torch.Generator().manual_seed(0)
    differs_from_last = 0
    with torch.inference_mode():
        for trial in range(200):
            rows, vocab = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(2, 300, (1,), generator=g))
            x = torch.randint(-3, 3, (rows, vocab), generator=g).float()  # small integers: many ties
            u = torch.rand(rows, vocab, generator=g)
            x[u < 0.1] = float("-inf")
            x[u > 0.99] = float("nan")
            x[0] = float("-inf") if trial % 7 == 0 else x[0]
            for view in (x, x[:, ::2]):
                got = argmax_rows(view)
                assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
            differs_from_last += int((x.argmax(-1) != vocab - 1 - x.flip(-1).argmax(-1)).any())
    assert differs_from_last > 50  # ties broken toward the first index were exercised


def test_greedy_on_host_is_samples_greedy_result():
    """The CPU's numpy shortcut for plain greedy rows gives sample()'s tokens and stop flags, on rows in
    any order, with stop ids that are hit and ones that are not."""
    params = RowParams(8, VOCAB, "cpu")
    g = torch.Generator().manual_seed(1)
    for r in range(8):
        params.set_row(r, SamplingParams(stop_token_ids=[r, r + 8]), seed=r, eos_ids=(VOCAB - 1,))
    stops = 0
    with torch.inference_mode():
        for _ in range(100):
            rows = torch.randperm(8, generator=g)[:5]
            logits = torch.randint(-2, 2, (5, VOCAB), generator=g).float()
            want, flags, _, _ = sample(logits, rows, torch.zeros(5, dtype=torch.int64), params, False, False, False)
            got, got_flags = greedy_on_host(logits.numpy(), rows.numpy(), params.stop_ids.numpy())
            assert torch.equal(torch.from_numpy(got), want) and torch.equal(torch.from_numpy(got_flags), flags)
            stops += int(flags.sum())
    assert stops > 10  # the stop flags were exercised


def test_penalties_match_the_per_row_reference():
    rng = random.Random(0)
    rows = random_rows(rng, 8)
    params = RowParams(len(rows), VOCAB, torch.device("cpu"))
    fill(params, rows)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    idx = torch.arange(len(rows))
    seen = [list(dict.fromkeys(prompt + output)) for prompt, output, _ in rows]
    width = max(map(len, seen))  # the bound a sampling call is given
    got = apply_penalties(logits, *params.seen(idx, width), params.presence_penalty[idx],
                          params.frequency_penalty[idx], params.repetition_penalty[idx])
    for r, (prompt, output, _) in enumerate(rows):
        assert params.seen_ids[r, :len(seen[r])].tolist() == seen[r] and params.seen_len[r] == len(seen[r])
        want = reference_penalties(logits[r], prompt, output, params.presence_penalty[r].item(),
                                   params.frequency_penalty[r].item(), params.repetition_penalty[r].item())
        assert torch.equal(got[r], want), r
    assert (got != logits).sum(dim=1).min() > 0  # non-vacuity: every row was changed
    whole = apply_penalties(logits, *params.seen(idx), params.presence_penalty[idx],
                            params.frequency_penalty[idx], params.repetition_penalty[idx])
    assert torch.equal(whole, got)  # past a row's seen tokens the table repeats its first: no change
    short = apply_penalties(logits, *params.seen(idx, width - 1), params.presence_penalty[idx],
                            params.frequency_penalty[idx], params.repetition_penalty[idx])
    assert not torch.equal(short, got)  # non-vacuity: the last seen token of the longest row counts


def test_logit_bias_is_clamped_and_added_to_its_tokens():
    p = SamplingParams(logit_bias={"5": 250, 7: -1000.5, 9: 0.25})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.25}
    params = RowParams(2, VOCAB, torch.device("cpu"))
    params.set_row(0, p, seed=0, eos_ids=())
    params.set_row(1, SamplingParams(), seed=0, eos_ids=())
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    got = apply_logit_bias(logits, params.bias_ids[:2], params.bias_values[:2])
    want = logits.clone()
    for t, b in p.logit_bias.items():
        want[0, t] += b
    assert torch.equal(got, want)


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.5, 1.0])
    got = _filter(logits, min_p, torch.zeros(5, dtype=torch.long), torch.ones(5))
    probs = logits.softmax(-1)
    for r in range(5):
        keep = probs[r] >= min_p[r] * probs[r].max()
        assert torch.equal(torch.isfinite(got[r]), keep), r
        assert torch.equal(got[r][keep], logits[r][keep])
    kept = torch.isfinite(got).sum(-1)
    assert kept[0] == VOCAB and kept[4] == 1 and kept[2] < kept[1]  # non-vacuity


def test_sample_applies_bias_then_penalties_and_counts_what_it_emits():
    """Greedy through sample(): the argmax of the reference; with temperature, the draw is made over
    the adjusted logits (a token banned by a -100 bias never comes). Logprobs stay the model's."""
    rng = random.Random(4)
    rows = random_rows(rng, 6)
    params = RowParams(len(rows), VOCAB, torch.device("cpu"))
    fill(params, rows)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    idx = torch.arange(len(rows))
    before = params.counts.clone()
    tokens, _, logprobs, _ = sample(logits, idx, torch.zeros(len(rows), dtype=torch.long), params, any_random=False,
                                 any_filter=False, want_logprobs=True, any_bias=True, any_penalty=True)
    for r, (prompt, output, p) in enumerate(rows):
        biased = logits[r].clone()
        for t, b in p.logit_bias.items():
            biased[t] += b
        want = reference_penalties(biased, prompt, output, params.presence_penalty[r].item(),
                                   params.frequency_penalty[r].item(), params.repetition_penalty[r].item())
        assert tokens[r] == want.argmax(), r
    assert torch.equal(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
    assert (tokens != logits.argmax(-1)).any()  # non-vacuity: the adjustments changed some choice
    params.count(idx, tokens)
    delta = params.counts - before
    assert delta.sum() == len(rows) and torch.equal(delta[idx, tokens], torch.ones(len(rows), dtype=torch.int32))


def test_top_logprobs_are_the_models_own_most_likely_tokens():
    """The top MAX_TOP_LOGPROBS of the log-softmax of the model's logits, whatever the bias and
    penalties did to the sampling distribution (vLLM's raw logprobs)."""
    rows = random_rows(random.Random(6), 4)
    params = RowParams(len(rows), VOCAB, torch.device("cpu"))
    fill(params, rows)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    idx = torch.arange(len(rows))
    tokens, _, chosen, top = sample(logits, idx, torch.zeros(len(rows), dtype=torch.long), params, any_random=False,
                                    any_filter=False, want_logprobs=False, any_bias=True, any_penalty=True,
                                    want_top=True)
    want_values, want_ids = logits.log_softmax(-1).topk(MAX_TOP_LOGPROBS, dim=-1)
    assert torch.equal(top[0], want_ids.to(torch.int32)) and torch.equal(top[1], want_values)
    assert torch.equal(chosen, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
    assert (tokens != want_ids[:, 0]).any()  # non-vacuity: the adjusted choice is not always the model's best


def test_a_penalized_row_starts_from_zero_counts_and_its_own_prompt():
    params = RowParams(1, VOCAB, torch.device("cpu"))
    params.set_row(0, SamplingParams(presence_penalty=1.0), seed=0, eos_ids=(), prompt_ids=[1, 2])
    params.count(torch.tensor([0]), torch.tensor([3]))
    params.set_row(0, SamplingParams(repetition_penalty=1.5), seed=0, eos_ids=(), prompt_ids=[4])
    assert params.counts.sum() == 0 and params.in_prompt[0].nonzero().flatten().tolist() == [4]
    assert params.seen_len[0] == 1 and (params.seen_ids[0] == 4).all()  # its list, padded with its first


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")), ("min_p", 1.5), ("min_p", -0.1), ("logit_bias", {"x": 1}),
    ("logit_bias", {1: "a"}), ("logit_bias", [1, 2]), ("logit_bias", {t: 1 for t in range(MAX_LOGIT_BIAS + 1)}),
])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_token_ids_are_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={VOCAB: 1.0})
    p.validate()
    with pytest.raises(ValueError, match="logit_bias"):
        p.validate(VOCAB)


# ------------------------------------------------------------------ the engine


def make_engine(pipeline: bool) -> Engine:
    return Engine(EngineConfig(model="tiny-random", device="cpu", pipeline=pipeline, debug=True, max_batch=16,
                               prefill_budget=64, kv_pages=600, page_size=8))


def penalized_workload(n=24):
    rng = random.Random(7)
    reqs = []
    for i in range(n):
        kw = dict(max_tokens=rng.randrange(1, 40), ignore_eos=True)
        if i % 4 != 3:  # a quarter stays plain: stale counts on their rows must not matter
            kw.update(presence_penalty=rng.choice([0.0, 1.5]), frequency_penalty=rng.choice([0.0, 0.7]),
                      repetition_penalty=rng.choice([1.0, 1.3]), logit_bias={rng.randrange(1000): -100.0})
        if i % 2:
            kw.update(temperature=0.8, seed=i, min_p=rng.choice([0.0, 0.1]))
        reqs.append(([rng.randrange(1000) for _ in range(rng.randrange(1, 60))], SamplingParams(**kw), i % 3 == 0))
    return reqs


def test_pipelined_equals_blocking_with_penalties_on():
    """A third of the rows are constrained: they are sampled in a later part of their step, after the
    mask came (their counts are updated by that part)."""
    reqs = penalized_workload()
    outs = {}
    for pipelined in (False, True):
        eng = make_engine(pipelined)
        seqs = [eng.submit(prompt, p, constrained=c) for prompt, p, c in reqs]
        masks = BannedByLastToken()
        eng.run_until_idle(masks)
        assert eng.idle and masks.calls > 0
        eng.close()
        outs[pipelined] = [s.output_ids for s in seqs]
    assert outs[True] == outs[False]
    # non-vacuity: the same requests without their penalties and biases give other tokens
    eng = make_engine(True)
    plain = [eng.submit(prompt, SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=p.temperature,
                                               seed=p.seed)) for prompt, p, _ in reqs]
    eng.run_until_idle()
    eng.close()
    assert [s.output_ids for s in plain] != outs[True]


def test_the_engine_penalizes_its_own_generated_tokens():
    """Greedy on the random model repeats itself; a presence penalty of 2 and a frequency penalty of 2
    make every generated token pay, so the sequence repeats less, and a -100 bias bans a token."""
    prompt = [5, 6, 7]
    eng = make_engine(True)
    plain = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].output_ids
    banned = plain[0]
    pen = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=2.0,
                                                frequency_penalty=2.0, logit_bias={banned: -100}))[0].output_ids
    eng.close()
    assert len(set(plain)) < len(plain)  # non-vacuity: the plain run repeats
    assert len(set(pen)) > len(set(plain)) and banned not in pen


@pytest.mark.slow
def test_the_engines_seen_width_bound_changes_no_token(monkeypatch):
    """A sampling call reads each row's seen tokens up to a host-known bound (the largest position it
    samples). The same workload with the whole table read every time gives the same tokens."""
    import gpu_worker.model_runner as model_runner

    reqs = penalized_workload()
    widths = []

    def run(read_all: bool) -> list[list[int]]:
        def sample(*args, **kw):
            widths.append(args[-1])
            return real(*args[:-1], None if read_all else args[-1], **kw)

        real = model_runner.sample
        monkeypatch.setattr(model_runner, "sample", sample)
        try:
            eng = make_engine(True)
            seqs = [eng.submit(prompt, p, constrained=c) for prompt, p, c in reqs]
            eng.run_until_idle(BannedByLastToken())
            table = eng.runner.params.seen_ids.shape[1]
            eng.close()
        finally:
            monkeypatch.setattr(model_runner, "sample", real)
        return [s.output_ids for s in seqs], table

    bounded, table = run(read_all=False)
    assert run(read_all=True)[0] == bounded
    assert 0 < min(w for w in widths if w) < table  # non-vacuity: the bound was below the table's width

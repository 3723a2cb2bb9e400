"""Sampling on the device, vectorised over rows, reproducible per request.

Per-row parameters live on the device, indexed by the sequence's stable batch
row, and are written once at admission: no per-step upload.

Randomness is counter-based: the noise for (seed, position, token) is a hash of
those three numbers, used through the Gumbel-max trick
(argmax(logits / T + Gumbel)). A seeded request therefore samples the same
tokens whatever its batch mates, its batch row, the timing, or pipelined vs
blocking mode. Requests without a seed get one drawn at admission.

The logits are adjusted in vLLM's order: ``logit_bias`` (added), ``min_tokens``
(a row's stop ids masked until its position reaches ``RowParams.stops_from``), then the
penalties (``repetition_penalty`` over the prompt's and the generated tokens,
``frequency_penalty`` and ``presence_penalty`` over the generated ones), then
greedy argmax or temperature, ``min_p``, top-k, top-p and the Gumbel draw.
Logprobs are the model's own (its log-softmax before any adjustment: vLLM's
default "raw" logprobs): the sampled token's, and on request the
``MAX_TOP_LOGPROBS`` most likely tokens with theirs (the frontend keeps as many
as each request asked for).

Penalties touch only the tokens a row has seen: its prompt's and those it
generated, listed once each in ``RowParams.seen_ids`` ([rows, width], in order
of first appearance, padded with the row's first token), with their counts in
the output read from ``RowParams.counts`` ([rows, vocab], looked up, never
scanned). A sampling call gathers those logits, adjusts them and scatters them
back: its cost grows with the tokens seen (at most the position being sampled,
a host-known bound), not with the vocabulary. The pads repeat a listed token,
so they write back the same value. The sampling call that emits a row's token
counts it (``RowParams.count``: its count, and its place in the list when new),
on the compute stream, before the next step's sampling is enqueued: pipelined
or blocking, step t+1 sees step t's token. A penalized row's tables are reset
at admission (its prompt's tokens listed and marked); other rows' are stale and
never matter (their penalties are neutral).
"""
from __future__ import annotations

import numpy as np
import torch

from shared.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SamplingParams

MAX_EOS_IDS = 8
MAX_STOP_IDS = MAX_EOS_IDS + MAX_STOP_TOKEN_IDS  # stop ids per row kept on device (EOS ids + stop_token_ids)
NO_TOKEN = -1

FLAG_STOP = 1  # sampled token is EOS or a stop token id
FLAG_LENGTH = 2  # the row's device-side limit is reached with this token (Moondream skills)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values < 2**32."""
    m = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of float32 rows [R, V]: the first largest value's index, a NaN's first
    where a row has one. On a CPU numpy's argmax gives the same index about 10x sooner than aten's
    for a vocabulary-wide row (BENCHMARKS.md "Python after a CPU forward runs cold")."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.argmax(dim=-1)
    return torch.from_numpy(x.numpy().argmax(axis=-1).astype(np.int64, copy=False))


def greedy_on_host(logits: np.ndarray, rows: np.ndarray, stop_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sample`'s tokens and flags for plain greedy rows (no bias, penalty, min_tokens,
    logprobs), in numpy, for a CPU: ``logits`` float32 [R, V], ``stop_ids`` ``RowParams.stop_ids``'s
    table. A CPU forward streams the weights through the caches, so each call after it runs cold:
    :func:`sample`'s torch calls and their outputs cost ~0.4 ms a step there, these few numpy calls
    a third of it (BENCHMARKS.md "Python after a CPU forward runs cold")."""
    tokens = logits.argmax(axis=-1).astype(np.int64, copy=False)
    flags = (stop_ids[rows] == tokens[:, None]).any(axis=-1).astype(np.int32) * FLAG_STOP
    return tokens, flags


def counter_uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform(0, 1) noise [R, vocab] from (seed, position, token index)."""
    m = 0xFFFFFFFF
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    lo = seed & m
    hi = (seed >> 32) & m
    h = _mix32(lo ^ _mix32(hi ^ _mix32(position & m)))  # [R]
    x = _mix32(h[:, None] ^ _mix32(token[None, :] + 0x9E3779B9 & m))
    # 23 bits -> (0, 1), never exactly 0 or 1: k + 0.5 is exact in float32 for k < 2**23
    # (with 24 bits the top value rounds to 1.0, the Gumbel noise becomes inf, and a
    # masked -inf logit plus inf is NaN, which argmax would pick).
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


class RowParams:
    """Sampling parameters of every batch row, on the device.

    Stored as one int64 and one float32 table so a row's admission is two small
    uploads. On CUDA they come from page-locked memory with ``non_blocking``: a
    copy from pageable memory would make the host wait for the compute stream
    to drain (the forward in flight), a pipeline bubble at every admission.
    """

    def __init__(self, max_rows: int, vocab: int, device: torch.device, max_len: int | None = None) -> None:
        """``max_len``: the context (prompt + output), which bounds the tokens a row sees."""
        self._pinned = torch.device(device).type == "cuda"
        stops_end = _INTS + MAX_STOP_IDS
        self.ints = torch.zeros(max_rows, stops_end + MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.floats = torch.zeros(max_rows, _FLOATS + MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.ints[:, _INTS:] = NO_TOKEN
        self.top_k, self.seed, self.stops_from = self.ints[:, :_INTS].unbind(1)
        self.stop_ids, self.bias_ids = self.ints[:, _INTS:stops_end], self.ints[:, stops_end:]
        (self.temperature, self.top_p, self.min_p, self.presence_penalty, self.frequency_penalty,
         self.repetition_penalty) = self.floats[:, :_FLOATS].unbind(1)
        self.bias_values = self.floats[:, _FLOATS:]
        self.top_p.fill_(1.0)
        self.repetition_penalty.fill_(1.0)
        self.counts = torch.zeros(max_rows, vocab, dtype=torch.int32, device=device)  # generated tokens
        self.in_prompt = torch.zeros(max_rows, vocab, dtype=torch.bool, device=device)
        # The tokens each row has seen, once each (a zombie step may see one past the context)
        width = vocab if max_len is None else min(vocab, max_len + 2)
        self.seen_ids = torch.zeros(max_rows, width, dtype=torch.int64, device=device)
        self.seen_len = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def set_row(self, row: int, p: SamplingParams, seed: int, eos_ids: tuple[int, ...],
                prompt_ids: list[int] = ()) -> None:
        stops = list(dict.fromkeys((() if p.ignore_eos else eos_ids) + p.stop_token_ids))
        assert len(stops) <= MAX_STOP_IDS, "checked by the model's EOS ids and SamplingParams.validate"
        stops += [NO_TOKEN] * (MAX_STOP_IDS - len(stops))
        pad = [NO_TOKEN] * (MAX_LOGIT_BIAS - len(p.logit_bias))
        stops_from = len(prompt_ids) + p.min_tokens  # the first position a stop id may be sampled at
        ints = torch.tensor([int(p.top_k), int(seed) & 0x7FFFFFFFFFFFFFFF, stops_from, *stops, *p.logit_bias, *pad],
                            dtype=torch.int64)
        floats = torch.tensor([float(p.temperature), float(p.top_p), float(p.min_p), float(p.presence_penalty),
                               float(p.frequency_penalty), float(p.repetition_penalty), *p.logit_bias.values(),
                               *[0.0] * len(pad)], dtype=torch.float32)
        seen = torch.zeros(0, dtype=torch.int64)
        if p.penalized:  # the prompt's distinct tokens in order, then pads repeating the first
            distinct = torch.tensor(list(dict.fromkeys(int(t) for t in prompt_ids)), dtype=torch.int64)
            first = distinct[:1] if len(distinct) else torch.zeros(1, dtype=torch.int64)
            seen = torch.cat([distinct, first.expand(self.seen_ids.shape[1] - len(distinct))])
        if self._pinned:
            ints, floats, seen = ints.pin_memory(), floats.pin_memory(), seen.pin_memory()
        self.ints[row].copy_(ints, non_blocking=self._pinned)
        self.floats[row].copy_(floats, non_blocking=self._pinned)
        if p.penalized:
            self.seen_ids[row].copy_(seen, non_blocking=self._pinned)
            self.seen_len[row] = len(distinct)
            self.counts[row].zero_()
            self.in_prompt[row].zero_()
            self.in_prompt[row].index_fill_(0, self.seen_ids[row, :len(distinct)], True)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The rows emitted these tokens (rows are distinct within one call): a token new to its row
        joins the row's list, then its count goes up."""
        new = (self.counts[rows, tokens] == 0) & ~self.in_prompt[rows, tokens]
        end = self.seen_len[rows].clamp_max(self.seen_ids.shape[1] - 1)  # (only a stale row reaches the end)
        self.seen_ids[rows, end] = torch.where(new, tokens, self.seen_ids[rows, end])
        self.seen_len.index_add_(0, rows, new.to(torch.int64))
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def seen(self, rows: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' seen tokens [R, width] (``width`` >= every row's count of them; None: all the
        table holds) and their counts in the output."""
        ids = self.seen_ids[:, :width][rows]
        return ids, self.counts[rows[:, None], ids]


_INTS = 3  # top_k, seed, stops_from; then the stop ids and the logit_bias ids
_FLOATS = 6  # temperature, top_p, min_p, presence, frequency, repetition; then the logit_bias values


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Disallow tokens whose bit is 0 in int32 bitmask words [R, ceil(V/32)]."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    params: RowParams,
    any_random: bool,
    any_filter: bool,
    want_logprobs: bool,
    any_bias: bool = False,
    any_penalty: bool = False,
    want_top: bool = False,
    any_min_tokens: bool = False,
    seen_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Sample one token per logits row. Returns (token ids, flags, logprobs or None, top or None):
    ``top`` is (ids, logprobs) [R, MAX_TOP_LOGPROBS] of the most likely tokens, most likely first.

    ``any_random`` / ``any_filter`` / ``any_bias`` / ``any_penalty`` / ``any_min_tokens`` are host-known
    batch properties (some row has temperature > 0 / min-p, top-k or top-p /
    a logit bias / a penalty / not yet its min_tokens) so plain greedy batches skip the noise,
    the sort and the [rows, vocab] gathers entirely. ``seen_width``: a bound on the tokens any row
    has seen (the largest position sampled; None: the whole table).
    """
    logits = logits.float()
    raw = logits
    if any_bias:
        logits = apply_logit_bias(logits, params.bias_ids[rows], params.bias_values[rows])
    if any_min_tokens:
        logits = mask_early_stops(logits, params.stop_ids[rows], positions < params.stops_from[rows])
    if any_penalty:
        logits = apply_penalties(logits, *params.seen(rows, seen_width), params.presence_penalty[rows],
                                 params.frequency_penalty[rows], params.repetition_penalty[rows])
    greedy = argmax_rows(logits)
    tokens = greedy
    if any_random:
        temp = params.temperature[rows]
        scaled = logits / temp.clamp_min(1e-6)[:, None]
        if any_filter:
            scaled = _filter(scaled, params.min_p[rows], params.top_k[rows], params.top_p[rows])
        u = counter_uniform(params.seed[rows], positions, logits.shape[-1])
        gumbel = -torch.log(-torch.log(u))
        sampled = argmax_rows(scaled + gumbel)
        tokens = torch.where(temp > 0, sampled, greedy)
    stop = (tokens[:, None] == params.stop_ids[rows]).any(dim=-1)
    flags = stop.to(torch.int32) * FLAG_STOP
    logprobs = top = None
    if want_logprobs or want_top:
        model_logprobs = torch.log_softmax(raw, dim=-1)
        logprobs = model_logprobs.gather(1, tokens[:, None]).squeeze(1)
        if want_top:
            values, ids = model_logprobs.topk(MAX_TOP_LOGPROBS, dim=-1)
            top = (ids.to(torch.int32), values)
    return tokens, flags, logprobs, top


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Add each row's biases [R, MAX_LOGIT_BIAS] to its tokens ``ids`` (NO_TOKEN entries add nothing)."""
    used = ids >= 0
    return logits.scatter_add(1, torch.where(used, ids, 0), torch.where(used, values, 0.0))


def mask_early_stops(logits: torch.Tensor, stop_ids: torch.Tensor, early: torch.Tensor) -> torch.Tensor:
    """vLLM's min_tokens: the rows still ``early`` [R] cannot sample their stop ids [R, MAX_STOP_IDS]
    (EOS unless ignore_eos, and stop_token_ids; NO_TOKEN entries mask nothing)."""
    masked = (stop_ids >= 0) & early[:, None]
    return logits.scatter_add(1, torch.where(masked, stop_ids, 0), torch.where(masked, float("-inf"), 0.0))


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on the tokens each row has seen (``seen`` [R, W], their output ``counts``
    [R, W]; a token listed twice gets the same value twice): a token of the prompt or the output has
    its logit divided by the repetition penalty if positive (multiplied if not); then each generated
    token loses frequency x its count, and presence once. The other logits are untouched."""
    values = logits.gather(1, seen)
    values = torch.where(values > 0, values / repetition[:, None], values * repetition[:, None])
    values = values - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits.scatter(1, seen, values)


def _filter(scaled: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """min-p and top-k (masks over the whole distribution), then top-p over what they keep."""
    sorted_vals, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    full = sorted_vals.softmax(dim=-1)
    drop |= full < min_p[:, None] * full[:, :1]  # the most likely token always stays
    probs = sorted_vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_vals)

"""Sampling on the device, vectorised over rows, reproducible per request.

Per-row parameters live on the device, indexed by the sequence's stable batch
row, and are written once at admission: no per-step upload.

Randomness is counter-based: the noise for (seed, position, token) is a hash of
those three numbers, used through the Gumbel-max trick
(argmax(logits / T + Gumbel)). A seeded request therefore samples the same
tokens whatever its batch mates, its batch row, the timing, or pipelined vs
blocking mode. Requests without a seed get one drawn at admission.
"""
from __future__ import annotations

import torch

from shared.sampling import MAX_STOP_TOKEN_IDS, SamplingParams

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

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self._pinned = torch.device(device).type == "cuda"
        self.ints = torch.zeros(max_rows, 2 + MAX_STOP_IDS, dtype=torch.int64, device=device)
        self.floats = torch.zeros(max_rows, 2, dtype=torch.float32, device=device)
        self.ints[:, 2:] = NO_TOKEN
        self.floats[:, 1] = 1.0
        self.top_k, self.seed, self.stop_ids = self.ints[:, 0], self.ints[:, 1], self.ints[:, 2:]
        self.temperature, self.top_p = self.floats[:, 0], self.floats[:, 1]

    def set_row(self, row: int, p: SamplingParams, seed: int, eos_ids: tuple[int, ...]) -> None:
        stops = list(dict.fromkeys((() if p.ignore_eos else eos_ids) + p.stop_token_ids))
        assert len(stops) <= MAX_STOP_IDS, "checked by the model's EOS ids and SamplingParams.validate"
        stops += [NO_TOKEN] * (MAX_STOP_IDS - len(stops))
        ints = torch.tensor([int(p.top_k), int(seed) & 0x7FFFFFFFFFFFFFFF, *stops], dtype=torch.int64)
        floats = torch.tensor([float(p.temperature), float(p.top_p)], dtype=torch.float32)
        if self._pinned:
            ints, floats = ints.pin_memory(), floats.pin_memory()
        self.ints[row].copy_(ints, non_blocking=self._pinned)
        self.floats[row].copy_(floats, non_blocking=self._pinned)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sample one token per logits row. Returns (token ids, flags, logprobs or None).

    ``any_random`` / ``any_filter`` are host-known batch properties (some row has
    temperature > 0 / top-k or top-p) so greedy-only batches skip the noise and
    the sort entirely.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    tokens = greedy
    if any_random:
        temp = params.temperature[rows]
        scaled = logits / temp.clamp_min(1e-6)[:, None]
        if any_filter:
            scaled = _top_k_top_p(scaled, params.top_k[rows], params.top_p[rows])
        u = counter_uniform(params.seed[rows], positions, logits.shape[-1])
        gumbel = -torch.log(-torch.log(u))
        sampled = (scaled + gumbel).argmax(dim=-1)
        tokens = torch.where(temp > 0, sampled, greedy)
    stop = (tokens[:, None] == params.stop_ids[rows]).any(dim=-1)
    flags = stop.to(torch.int32) * FLAG_STOP
    logprobs = None
    if want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, flags, logprobs


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_vals, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    probs = sorted_vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_vals)

"""The fused CPU kernels (gpu_worker/kernels/) against the eager PyTorch ops they replace, at every
ISA level this CPU runs (up to $TANDEM_CPU_LEVEL's cap); the levels above it are compiled only.

Each kernel alone, in float32 (agreement to float32 rounding) and bfloat16 (the eager path's
op-by-op rounding, so equal or one bf16 ulp apart), on shapes with vector tails (dims that are
not multiples of 16), GQA groups and sequences that end mid-page; then the whole forward, fused
against eager, and the invariant the engine relies on: a token's result does not depend on how its prompt was
chunked (the schedules of pipelined and blocking decoding, one process or two, differ).
The AMX matmul (where the CPU has AMX): against float32 and oneDNN, and each row independent of
the rows batched with it.
"""
from __future__ import annotations

import collections
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prerequisites import unavailable

from gpu_worker import cpu_backend, cpu_kernels
from gpu_worker.batch import Batch
from gpu_worker.cpu_backend import PackedLinear, layer_table, pack_linears
from gpu_worker.kv_cache import PagedKVCache, by_slot
from gpu_worker.model import Llama, LlamaConfig, RMSNorm, apply_rope, attention_mask, paged_attention

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


# The levels this CPU runs, up to the one load() picks (the cap's, where $TANDEM_CPU_LEVEL sets one).
LEVELS = [level.name for level in cpu_kernels.choosable_levels()]


@pytest.fixture(scope="module", params=LEVELS)
def kernels(request):
    k = cpu_kernels.load(level=request.param)
    assert k is not None, "the fused CPU kernels did not build (is a C compiler installed?)"
    assert k.level == request.param
    return k


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of b's last place at its own dtype (bf16: 8 bits, fp32: 24)."""
    bits = 8 if b.dtype == torch.bfloat16 else 24
    a, b = a.double(), b.double()
    scale = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - (bits - 1))
    return ((a - b).abs() / scale).max().item()


def float32_error(t: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |t - exact| / |exact| in float32 roundings (2^-24): a float32 op rounds by at most
    one, a sum of n terms in any order by at most n - 1 (relative to the sum of the terms' sizes)."""
    exact = exact.double()
    return ((t.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item() * 2 ** 24


def rounding_error(t: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |t - exact| over a bf16 rounding's bound, 2^-8 |exact|, plus 1e-5 for the float32
    sums' own order (near zero a sum's order, not the rounding, decides): <= 1 is rounded right."""
    return ((t.float() - exact).abs() / (exact.abs() * 2 ** -8 + 1e-5)).max().item()


DTYPES = [torch.float32, torch.bfloat16]
# (activations, KV cache): each dtype over its own cache, and float32 over bf16 (the quantized models')
CACHE_TYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 40), (3, 45), (33, 576)])  # 45: a vector tail at every width
def test_add_rmsnorm(kernels, dtype, rows, dim):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    y = torch.randn(rows, dim, generator=g).to(dtype)
    norm = RMSNorm(dim, 1e-5, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    with torch.inference_mode():
        want_x = x + y
        want = norm(want_x)
        got_x = x.clone()
        got = kernels.add_rmsnorm(got_x, y, norm.weight, 1e-5)
        assert torch.equal(got_x, want_x)  # the residual add rounds as the eager add
        if dtype == torch.bfloat16:  # the eager path's roundings: normalised, then times the weight
            assert ulps(got, want) <= 1
        else:  # the sum of squares (dim - 1 roundings, halved by the square root), then 4 ops
            x64 = want_x.double()
            exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
            assert float32_error(got, exact) <= dim / 2 + 5
            assert float32_error(got, exact) > 0  # non-vacuity: a float32 result, not float64's
        alone = kernels.add_rmsnorm(want_x.clone(), None, norm.weight, 1e-5)  # no residual: the norm alone
        assert torch.equal(alone, got)


def _slots(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache [pages, Hkv, page_size, D] as rows [slots, Hkv, D] (a copy), by kv_index."""
    return by_slot(cache).reshape(-1, cache.shape[1], cache.shape[3])


@pytest.mark.parametrize("dtype, kv_dtype", CACHE_TYPES)
def test_rope_kv_writes_the_cache_and_ropes_q(kernels, dtype, kv_dtype):
    """q and k roped as the eager path does, in the activations' type; k and v written to the cache in
    its own type, rounded as the eager path's cast (PagedKVCache.write)."""
    T, H, Hkv, D, page_size = 5, 6, 2, 24, 4
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), 1.0 / (10000 ** (torch.arange(0, D, 2) / D)))
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([0, 7, 8, 30, 63])
    kv_index = torch.tensor([3, 17, 4, 9, 30])
    k_cache = torch.zeros(8, Hkv, page_size, D, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    with torch.inference_mode():
        q = kernels.rope_kv(qkv, cos, sin, positions, kv_index, k_cache, v_cache, H, Hkv, D)
        c, s = cos[positions].to(dtype), sin[positions].to(dtype)
        qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), c, s)
        assert q.dtype == dtype and torch.equal(q, qk[:, :H])
        assert torch.equal(_slots(k_cache)[kv_index], qk[:, H:].to(kv_dtype))
        assert torch.equal(_slots(v_cache)[kv_index], qkv[:, (H + Hkv) * D:].view(T, Hkv, D).to(kv_dtype))
        untouched = torch.ones(_slots(k_cache).shape[0], dtype=torch.bool)
        untouched[kv_index] = False
        assert not _slots(k_cache)[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(kernels, dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(7, 2 * 100, generator=g)).to(dtype)
    with torch.inference_mode():
        gate, up = gate_up.chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = kernels.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert ulps(got, want) <= 1
    else:  # exp to 2 ulps (4 roundings; Cephes'), then the add, the division and the product: one each
        gate, up = gate.double(), up.double()
        assert float32_error(got, gate / (1 + torch.exp(-gate)) * up) <= 7


def _paged_case(dtype, lens, chunk, H=6, Hkv=2, D=24, page_size=4):
    """Sequences of ``lens`` cached tokens whose last ``chunk[i]`` tokens are this forward's queries."""
    g = torch.Generator().manual_seed(2)
    pages_per_seq = max(-(-n // page_size) for n in lens)
    kv = PagedKVCache(1, 1 + len(lens) * pages_per_seq, page_size, Hkv, D, dtype)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    # Pages handed out backwards, so no sequence's pages are contiguous or in order.
    tables = [list(range(1 + (i + 1) * pages_per_seq - 1, i * pages_per_seq, -1)) for i in range(len(lens))]
    batch = Batch.build([(n - c, c, t) for n, c, t in zip(lens, chunk, tables)], page_size)
    q = torch.randn(batch.num_tokens, H, D, generator=g).to(dtype)
    return q, kv, batch, Hkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [24, 64, 128])  # 64 and 128: the unrolled item (attention_item_fixed)
@pytest.mark.parametrize("H, Hkv", [(6, 2), (8, 2), (3, 3)])  # groups of 3, 4 and 1: literal or not (G_FITS)
@pytest.mark.parametrize("page_size", [4, 16])  # 16: a block of 16 keys is one page's (fused.c's block_rows)
def test_attention_over_pages_in_place(kernels, dtype, D, H, Hkv, page_size):
    """Decode (one query per sequence) and short chunks (causal within the chunk) against SDPA over
    the gathered pages; lengths odd and even, ending mid-page and crossing pages, and a 16-key block."""
    q, kv, batch, Hkv = _paged_case(dtype, lens=[1, 5, 13, 32, 37], chunk=[1, 2, 4, 1, 3], H=H, Hkv=Hkv, D=D,
                                    page_size=page_size)
    seq = batch.token_to_padded // batch.max_query_len
    with torch.inference_mode():
        got = kernels.attention(q, kv.k[0], kv.v[0], batch.block_tables, seq, batch.positions, Hkv)
        from gpu_worker.model import attend_pages
        want = attend_pages(q, 0, batch, kv, attention_mask(batch, kv, q.shape[1] // Hkv))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("D", [24, 64])  # 64: the unrolled item (and at AVX512-BF16, the bf16 one)
def test_long_attention_in_chunks_is_sdpa_and_each_sequence_alone(kernels, dtype, cache_dtype, D):
    """Past fused.c's CHUNK (256) keys a token's attention is its chunks' softmaxes merged: SDPA's to
    the path's rounding, and the same bits whether the chunks of one sequence's token are spread over
    the threads (the sequence alone: fewer items than threads * SPLIT_ITEMS) or run in turn by one
    thread (in a batch of many rows). Lengths on both sides of a chunk's end, a prefill chunk across
    one, and 1100 keys (five chunks)."""
    lens, chunk = [1, 255, 256, 257, 600, 1100], [1, 1, 1, 1, 5, 3]
    q, kv, batch, Hkv = _paged_case(dtype, lens, chunk, H=6, Hkv=2, D=D, page_size=16)
    k, v = kv.k[0].to(cache_dtype), kv.v[0].to(cache_dtype)
    seq = batch.token_to_padded // batch.max_query_len
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            got = kernels.attention(q, k, v, batch.block_tables, seq, batch.positions, Hkv)
            alone = []
            for s in range(len(lens)):
                rows = seq == s
                only = torch.zeros(int(rows.sum()), dtype=torch.long)
                alone.append(kernels.attention(q[rows], k, v, batch.block_tables[s:s + 1], only, batch.positions[rows],
                                               Hkv))
            from gpu_worker.model import attend_pages
            wide = PagedKVCache(1, kv.num_pages, kv.page_size, Hkv, D, torch.float32)
            wide.k[0], wide.v[0] = k.float(), v.float()
            want = attend_pages(q.float(), 0, batch, wide, attention_mask(batch, wide, q.shape[1] // Hkv))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), got)
    # float32: SDPA's own tolerance above; bf16 activations: their rounding (as above); float32 queries over a
    # bf16 cache: scores_split's 2^-17 where it runs, widened keys elsewhere (the test below)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want.flatten(1).float(), **tol)
    assert (batch.positions + 1 > 256).sum() >= 8  # non-vacuity: rows of two chunks and more


@pytest.mark.parametrize("D", [24, 64])
@pytest.mark.parametrize("H, Hkv", [(6, 2), (3, 3)])
@pytest.mark.parametrize("page_size", [4, 16])
def test_float32_queries_over_a_bf16_cache_are_the_float32_kernel_over_it_widened(kernels, D, H, Hkv, page_size):
    """The quantized models' attention: float32 queries over bf16 caches give the float32 kernel over
    the same values widened to float32: bit for bit where the keys are widened (the loads widen
    exactly; the math is the same); with bf16 dot products (D 64 and 128) pass 1 multiplies the keys
    as stored by the query split into two bf16 halves (fused.c's scores_split), whose sum is the
    query to 2^-18, and sums in another order: each score moves by at most 2^-17 of the sum of its
    products' sizes (<= |q| |k| / sqrt(D)), each output by at most twice that times the largest value."""
    q, kv, batch, Hkv = _paged_case(torch.float32, lens=[1, 5, 13, 32, 37], chunk=[1, 2, 4, 1, 3], H=H, Hkv=Hkv,
                                    D=D, page_size=page_size)
    seq = batch.token_to_padded // batch.max_query_len
    k16, v16 = kv.k[0].bfloat16(), kv.v[0].bfloat16()
    with torch.inference_mode():
        got = kernels.attention(q, k16, v16, batch.block_tables, seq, batch.positions, Hkv)
        want = kernels.attention(q, k16.float(), v16.float(), batch.block_tables, seq, batch.positions, Hkv)
        unrounded = kernels.attention(q, kv.k[0], kv.v[0], batch.block_tables, seq, batch.positions, Hkv)
    assert got.dtype == torch.float32
    if kernels.level in ("avx512_bf16", "amx") and D in (64, 128):
        norms = q.norm(dim=-1).max() * k16.float().norm(dim=-1).max() / D ** 0.5
        bound = 2 * 2 ** -17 * norms * v16.float().abs().max()
        assert (got - want).abs().max() <= bound
        assert not torch.equal(got, want)  # non-vacuity: the split query's path ran
    else:
        assert torch.equal(got, want)
    assert not torch.equal(got, unrounded)  # non-vacuity: the bf16 cache's values were read, rounded


TINY = LlamaConfig(vocab_size=96, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-5)


def _forward(model, kv, chunks, ids):
    batch = Batch.build(chunks, kv.page_size)
    ends = torch.cumsum(torch.tensor([c[1] for c in chunks]), 0) - 1
    return model(ids, batch, kv, ends)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_forward_matches_eager_and_is_batch_independent(kernels, dtype):
    """Prefill, then decode steps, fused against eager on copies of one cache; then a decode row
    batched beside a prompt chunk: one kernel call per layer for both."""
    model = Llama.random(TINY, seed=3, dtype=dtype)
    page_size = 4
    g = torch.Generator().manual_seed(4)
    caches = {name: PagedKVCache.from_config(TINY, 40, page_size, dtype, "cpu") for name in ("eager", "fused")}
    tables = [list(range(1, 9)), list(range(9, 17))]
    prompt = torch.randint(0, TINY.vocab_size, (2 * 11,), generator=g)
    steps = [((0, 11, tables[0]), (0, 11, tables[1]), prompt)]
    for i in range(4):
        steps.append(((11 + i, 1, tables[0]), (11 + i, 1, tables[1]), torch.randint(0, 96, (2,), generator=g)))
    tol = dict(atol=0.1, rtol=0.05) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-5)
    with torch.inference_mode():
        for a, b, ids in steps:
            model.cpu_kernels = None
            eager = _forward(model, caches["eager"], [a, b], ids)
            model.cpu_kernels = kernels
            fused = _forward(model, caches["fused"], [a, b], ids)
            torch.testing.assert_close(fused, eager, **tol)
        if dtype == torch.bfloat16:  # non-vacuity: the fused path really ran (bf16 rounds differently)
            assert not torch.equal(fused, eager)
        torch.testing.assert_close(caches["fused"].k, caches["eager"].k, **tol)

        # A token's attention is the kernel's whatever its chunk: a decode row beside a 9-token prompt
        # chunk, and the prompt chunk itself, all in one kernel call per layer.
        calls = []

        class Recording:
            def __getattr__(self, name):
                return getattr(kernels, name)

            def attention(self, q, *args, **kw):
                calls.append(q.shape[0])
                return kernels.attention(q, *args, **kw)

        model.cpu_kernels = Recording()
        other = torch.randint(0, 96, (9,), generator=g)
        _forward(model, caches["fused"], [(15, 1, tables[0]), (0, 9, list(range(17, 20)))],
                 torch.cat([torch.tensor([5]), other]))
        assert calls == [10] * TINY.num_hidden_layers


# Every matmul of this one has N and K multiples of 32 (TINY's have zero-padded tails).
TINY32 = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)


def amx(kernels):
    if not kernels.has_matmul:
        pytest.skip("this CPU (or kernel) has no AMX: the matmuls stay oneDNN's")


@pytest.mark.parametrize("cfg,packed", [(TINY, False), (TINY32, True), (TINY, True)],
                         ids=["plain-linears", "amx-linears", "amx-linears-padded"])
def test_a_prompt_chunked_or_whole_gives_the_same_bits(kernels, cfg, packed):
    """The invariant the engine's schedule tests need: the same prompt, prefilled in one chunk or in
    chunks of 3, 1 and the rest, leaves the same cache and the same last logits, bit for bit (with
    the engine's packed linears too: the AMX matmul computes each row alone)."""
    model = Llama.random(cfg, seed=5, dtype=torch.bfloat16)
    model.cpu_kernels = kernels
    if packed:
        amx(kernels)
        assert pack_linears(model, kernels) == 4 * cfg.num_hidden_layers + 1
        assert all(m.kernels is kernels for m in model.modules() if isinstance(m, PackedLinear))
    prompt = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(6))
    table = list(range(1, 5))
    whole, chunked = (PagedKVCache.from_config(cfg, 8, 4, torch.bfloat16, "cpu") for _ in range(2))
    with torch.inference_mode():
        a = _forward(model, whole, [(0, 11, table)], prompt)
        for start, n in ((0, 3), (3, 1), (4, 7)):
            b = _forward(model, chunked, [(start, n, table)], prompt[start:start + n])
    assert torch.equal(a[-1], b[-1])
    assert torch.equal(whole.k, chunked.k) and torch.equal(whole.v, chunked.v)


def _one_call_equals_python_loop(model, kernels, dtype, kv_dtype=None):
    """The model's forward with every layer in one C call against ``fused_layers``' Python loop over
    the same kernels: the same logits and caches, bit for bit, over a prefill and decode steps."""
    assert layer_table(model, kernels) is not None  # non-vacuity: the one-call path runs below

    class PythonLoop:  # the same kernels without the one-call loop
        layers = None

        def __getattr__(self, name):
            return getattr(kernels, name)

    g = torch.Generator().manual_seed(8)
    caches = [PagedKVCache.from_config(TINY32, 12, 4, kv_dtype or dtype, "cpu") for _ in range(2)]
    tables = [list(range(1, 6)), list(range(6, 11))]
    steps = [([(0, 9, tables[0]), (0, 5, tables[1])], torch.randint(0, 96, (14,), generator=g))]
    steps += [([(9 + i, 1, tables[0]), (5 + i, 1, tables[1])], torch.randint(0, 96, (2,), generator=g)) for i in range(3)]
    with torch.inference_mode():
        for chunks, ids in steps:
            out = []
            for impl, kv in zip((kernels, PythonLoop()), caches):
                model.cpu_kernels = impl
                out.append(_forward(model, kv, chunks, ids))
            assert torch.equal(out[0], out[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[0].k.abs().sum() > 0


def test_the_layers_in_one_call_are_the_python_loop_bit_for_bit(kernels):
    """AMX-packed linears: every layer in one C call is the Python loop bit for bit; a model whose
    linears are not all packed for the AMX matmul keeps the Python loop."""
    amx(kernels)
    model = Llama.random(TINY32, seed=7, dtype=torch.bfloat16)
    pack_linears(model, kernels)
    _one_call_equals_python_loop(model, kernels, torch.bfloat16)
    model.layers[1].mlp.down_proj = torch.nn.Linear(TINY32.intermediate_size, TINY32.hidden_size, dtype=torch.bfloat16)
    assert layer_table(model, kernels) is None  # e.g. LoRA's wrapped linears


@pytest.mark.parametrize("dtype, kv_dtype", CACHE_TYPES)
def test_quantized_layers_in_one_call_are_the_python_loop_bit_for_bit(kernels, dtype, kv_dtype):
    """Weight-only quantized linears at every level, activations float32 and bf16 (float32 over a bf16
    cache too, as the engine serves them): every layer in one C call is the Python loop bit for bit,
    with a fused qkv of three formats (a Q4_K_M file mixes them) and a bias read from each part's
    columns; a linear with more parts than the table holds keeps the Python loop."""
    from gpu_worker.quant import QuantKernels, QuantLinear, quantize

    model = Llama.random(TINY32, seed=7, dtype=dtype)
    qk = QuantKernels(kernels)
    H, Hkv, D = TINY32.num_attention_heads, TINY32.num_key_value_heads, TINY32.head_dim
    g = torch.Generator().manual_seed(9)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w = attn.qkv_proj.weight.detach().float()
        q, k, v = w.split([H * D, Hkv * D, Hkv * D])
        bias = torch.randn(w.shape[0], generator=g)
        attn.qkv_proj = QuantLinear([quantize(q, "int4", 32), quantize(k, "int8", 32, symmetric=True),
                                     quantize(v, "int8", 64)], bias, qk)
        attn.qkv_proj.parts[2] = type(attn.qkv_proj.parts[2])("bf16", v.bfloat16(), None, None, 0, tuple(v.shape))
        attn.o_proj = QuantLinear([quantize(attn.o_proj.weight.detach(), "int8", 32)], None, qk)
        mlp.gate_up_proj = QuantLinear([quantize(mlp.gate_up_proj.weight.detach(), "int4", 64)], None, qk)
        mlp.down_proj = QuantLinear([quantize(mlp.down_proj.weight.detach(), "int4", 32)], torch.randn(
            TINY32.hidden_size, generator=g), qk)
    tiled = ["t4", "t8", "bf16"] if qk.tile_rows else ["q4", "q8", "bf16"]  # tiles at the VW 16 levels
    assert [p.fmt for p in model.layers[0].self_attn.qkv_proj.parts] == tiled
    _one_call_equals_python_loop(model, kernels, dtype, kv_dtype)
    kept = layer_table(model, kernels)
    assert layer_table(model, kernels) is kept  # kept while no module or parameter was registered
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
    renewed = layer_table(model, kernels)
    assert renewed is not kept and renewed[-1, 2] == model.norm.weight.data_ptr()  # the final norm's new weight
    halves = v.split(Hkv * D // 2)
    model.layers[1].self_attn.qkv_proj = QuantLinear(  # four parts: more than the table holds
        [quantize(q, "int4", 32), quantize(k, "int8", 32), quantize(halves[0], "int4", 32),
         quantize(halves[1], "int8", 32)], None, qk)
    assert len(model.layers[1].self_attn.qkv_proj.parts) == 4
    assert layer_table(model, kernels) is None


@pytest.mark.parametrize("n,k,bias", [(96, 64, True), (128, 1536, False), (40, 72, True), (4304, 1000, False),
                                      (3, 5, True)])  # the last three: zero-padded tails of N and K
def test_amx_matmul_matches_float32_and_each_row_is_alone(kernels, n, k, bias):
    """The AMX matmul against float32 (one rounding of the exact-order sum: at most one bf16 ulp)
    and oneDNN's prepacked matmul; a row's result is the same bits alone, in a block of 32 rows, in
    a partial block (17, 33 rows) and past one pass of 256 rows (300). N and K need not be
    multiples of 32 (Moondream's vision MLP has 4304 columns)."""
    amx(kernels)
    g = torch.Generator().manual_seed(n + k)
    linear = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    linear.weight.data = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    if bias:
        linear.bias.data = torch.randn(n, generator=g).bfloat16()
    ours, onednn = PackedLinear.from_linear(linear, kernels), PackedLinear.from_linear(linear)
    assert ours.kernels is kernels and onednn.kernels is None
    x = torch.randn(300, k, generator=g).bfloat16()
    with torch.inference_mode():
        exact = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
        got = ours(x)
        assert rounding_error(got, exact) <= 1 and rounding_error(onednn(x), exact) <= 1
        assert not torch.equal(got, torch.zeros_like(got))
        for rows in (1, 17, 32, 33):
            assert torch.equal(ours(x[-rows:]), got[-rows:]), rows
        assert torch.equal(ours(x.view(3, 100, k)), got.view(3, 100, n))  # leading dims kept


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "onednn"])
@pytest.mark.parametrize("n,k", [(128, 64), (4304, 96)])
def test_gelu_fused_into_the_matmul_rounds_once(kernels, n, k, amx):
    """``PackedLinear.forward_gelu_tanh`` (Moondream's MLPs in bf16 on a CPU): the gelu runs on the
    float32 sum, so the result is within one bf16 ulp of float32's gelu(linear(x)) (plus 1e-5 for
    the sums' own order), where the eager pair (matmul rounded, then gelu rounded) is not; an AMX
    row is the same bits alone and in a batch."""
    g = torch.Generator().manual_seed(n)
    linear = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    linear.weight.data = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    linear.bias.data = torch.randn(n, generator=g).bfloat16()
    if not amx and not cpu_backend.onednn_packs_bf16():
        pytest.skip("oneDNN has no bf16 prepack on this CPU")
    packed = PackedLinear.from_linear(linear, kernels if amx else None)
    assert (packed.kernels is not None) == (amx and kernels.has_matmul)
    x = (2 * torch.randn(40, k, generator=g)).bfloat16()  # 2x: far into gelu's tails both sides
    with torch.inference_mode():
        want = torch.nn.functional.gelu(x.float() @ linear.weight.float().T + linear.bias.float(), approximate="tanh")
        eager = torch.nn.functional.gelu(linear(x), approximate="tanh")
        got = packed.forward_gelu_tanh(x)

        assert rounding_error(got, want) <= 1 < rounding_error(eager, want)
        if packed.kernels is not None:
            assert torch.equal(packed.forward_gelu_tanh(x[-1:]), got[-1:])


def test_build_is_cached_and_a_failed_build_falls_back(tmp_path, monkeypatch, capfd):
    level = cpu_kernels.level_named(LEVELS[0])
    lib = cpu_kernels.build(level, tmp_path)
    assert f"compiling CPU kernels (level {level.name})" in capfd.readouterr().err
    stamp = lib.stat().st_mtime_ns
    assert cpu_kernels.build(level, tmp_path) == lib and lib.stat().st_mtime_ns == stamp  # not rebuilt
    assert not capfd.readouterr().err
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "empty"))
    assert cpu_kernels.load() is None


def test_engine_attaches_the_kernels_for_bf16_on_a_cpu_only():
    from gpu_worker.engine import Engine, EngineConfig

    for dtype, enabled, want in (("bfloat16", True, True), ("bfloat16", False, False), ("float32", True, False)):
        eng = Engine(EngineConfig(model="tiny-random", device="cpu", dtype=dtype, cpu_kernels=enabled, kv_pages=64))
        try:
            kernels = eng.runner.model.cpu_kernels
            assert (kernels is not None) == want, (dtype, enabled)
            linears = [m for m in eng.runner.model.modules() if isinstance(m, PackedLinear)]
            # The AMX matmul where the CPU has it, whatever the dims; else oneDNN's where it packs bf16.
            amx_on = want and kernels.has_matmul
            assert bool(linears) == (dtype == "bfloat16" and (amx_on or cpu_backend.onednn_packs_bf16()))
            assert all((m.kernels is not None) == amx_on for m in linears), (dtype, enabled)
        finally:
            eng.close()


def test_paged_attention_eager_still_writes_then_attends():
    """The eager path the fused one falls back to: paged_attention = write k, v + attend_pages."""
    q, kv, batch, Hkv = _paged_case(torch.float32, lens=[6], chunk=[6])
    k = torch.randn(batch.num_tokens, Hkv, q.shape[2])
    v = torch.randn_like(k)
    mask = attention_mask(batch, kv, q.shape[1] // Hkv)
    out = paged_attention(q, k, v, 0, batch, kv, mask)
    assert torch.equal(_slots(kv.k[0])[batch.kv_index], k)
    assert out.shape == (batch.num_tokens, q.shape[1] * q.shape[2])


def test_a_crop_encodes_to_the_same_bits_whatever_is_encoded_with_it(kernels):
    """Moondream's vision encoder in bf16 with every linear on the AMX matmul (its MLP's 100
    columns here, 4304 in moondream2, through the zero-padded tails): a crop's features are the
    same bits alone and beside other crops (its 729 rows then start mid-block), so an image's
    features never depend on the images a launch encodes with it."""
    from gpu_worker.moondream import Moondream, normalize_crops
    from shared.moondream_config import MoondreamConfig
    from shared.moondream_random import TINY_CONFIG, make_image

    amx(kernels)
    config = dict(TINY_CONFIG, vision=dict(TINY_CONFIG["vision"], enc_ff_dim=100))
    model = Moondream.random(MoondreamConfig.from_dict(config), seed=2, dtype=torch.bfloat16)
    linears = pack_linears(model.vision, kernels)
    assert linears and all(m.kernels is kernels for m in model.vision.modules() if isinstance(m, PackedLinear))
    crops = torch.from_numpy(np.stack([make_image(378, 378, s).transpose(2, 0, 1) for s in range(3)]))
    with torch.inference_mode():
        pixels = normalize_crops(crops, torch.bfloat16)
        together = model.vision.encode(pixels)
        for i in range(3):
            assert torch.equal(model.vision.encode(pixels[i:i + 1])[0], together[i]), i
    assert not torch.equal(together[0], together[1])


def _full_attention_eager(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, width = qkv.shape
    q, k, v = (t.view(B, T, heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, width // 3)


@pytest.mark.parametrize("B,T,H,D", [(2, 729, 4, 72), (3, 50, 3, 64), (1, 17, 2, 32)])
def test_full_attention_is_as_close_to_float32_as_sdpa_and_each_crop_alone(kernels, B, T, H, D):
    """The vision encoder's attention kernel (bf16, AMX) against float32 attention: as close as
    torch's own bf16 SDPA (both round P to bf16 for the second matmul; the max error within a bf16
    ulp of SDPA's, the mean within 10%); each crop's result the same bits alone as beside others,
    and a key changed in one crop changes that crop's output only. T not a multiple of 32 (729:
    moondream2's crop) and D = 72 exercise the zero padding."""
    amx(kernels)
    g = torch.Generator().manual_seed(T + D)
    qkv = (2 * torch.randn(B, T, 3 * H * D, generator=g)).bfloat16()
    with torch.inference_mode():
        exact = _full_attention_eager(qkv.float(), H)
        ours, sdpa = kernels.full_attention(qkv, H), _full_attention_eager(qkv, H)
        err, sdpa_err = (ours.float() - exact).abs(), (sdpa.float() - exact).abs()
        assert err.max() <= sdpa_err.max() + 2 ** -8 * exact.abs().max() and err.mean() <= 1.1 * sdpa_err.mean()
        assert err.mean() < 0.01 * exact.abs().mean()  # non-vacuity: an attention, not a lucky bound
        for b in range(B):
            assert torch.equal(kernels.full_attention(qkv[b:b + 1], H)[0], ours[b]), b
        changed = qkv.clone()
        changed[0, T // 2, H * D:2 * H * D] += 1  # one key of crop 0, every head
        after = kernels.full_attention(changed, H)
        assert not torch.equal(after[0], ours[0]) and torch.equal(after[1:], ours[1:])


def test_the_moondream_attention_benchmark_runs(kernels, capsys):
    from bench import moondream_attention

    amx(kernels)
    from gpu_worker.moondream import TextAttention

    init = TextAttention.__init__
    out = moondream_attention.main(["--model", "tiny", "--text-layers", "1", "--repeats", "1", "--json"])
    assert set(out["speedup"]) == {"block_attention_ms", "encode_s", "text_prefill_s", "text_decode_ms"}
    assert all(set(out[k]) == {"kernel", "sdpa"} for k in out["speedup"])
    assert cpu_kernels.CpuKernels.full_attention is not moondream_attention.sdpa  # the kernels are put back
    assert TextAttention.__init__ is init
    assert '"speedup"' in capsys.readouterr().out


def _prefix_lm_last(batch: Batch, block: int) -> torch.Tensor:
    """Each token's last visible position: causal, but a token inside the first ``block`` positions
    sees the whole block (Moondream's image prefix)."""
    p = batch.positions
    return torch.where(p < block, torch.full_like(p, block - 1), p)


@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 64), (6, 2, 72)])
def test_paged_amx_attention_is_sdpas_and_each_row_is_its_own(kernels, H, Hkv, D):
    """The text model's AMX attention over the cache pages (bf16): prefill chunks with a prefix-LM
    block, causal rows and decode rows of sequences ending mid-page, against the gather + SDPA
    under the same mask (as close to float32 as SDPA); then every row's result is the same bits
    computed alone, in any chunk and beside any other rows: the pipeline's schedules (which
    batch and chunk tokens differently) never change a token."""
    amx(kernels)
    lens, chunk = [40, 75, 3, 66], [40, 30, 1, 1]
    q, kv, batch, _ = _paged_case(torch.bfloat16, lens, chunk, H=H, Hkv=Hkv, D=D, page_size=16)
    block = 20
    last = _prefix_lm_last(batch, block)
    starts = torch.cat([batch.query_index[:, 0], torch.tensor([batch.num_tokens])])
    from gpu_worker.model import attend_pages
    with torch.inference_mode():
        got = kernels.paged_attention(q, kv.k[0], kv.v[0], batch.block_tables, starts, last)
        mask = attention_mask(batch, kv, H // Hkv, last[batch.query_index])
        sdpa = attend_pages(q, 0, batch, kv, mask)
        exact = attend_pages(q.float(), 0, batch, _float_cache(kv), mask)
        err, sdpa_err = (got.float() - exact).abs(), (sdpa.float() - exact).abs()
        assert err.max() <= sdpa_err.max() + 2 ** -8 * exact.abs().max() and err.mean() <= 1.1 * sdpa_err.mean()
        assert err.mean() < 0.01 * exact.abs().mean()
        # each row alone, as a one-row "sequence" with its own table
        seq = batch.token_to_padded // batch.max_query_len
        for t in range(batch.num_tokens):
            s = int(seq[t])
            alone = kernels.paged_attention(q[t:t + 1], kv.k[0], kv.v[0], batch.block_tables[s:s + 1],
                                            torch.tensor([0, 1]), last[t:t + 1])
            assert torch.equal(alone[0], got[t]), t
        # non-vacuity: a block row sees keys past its own position, a causal row does not
        first = int(starts[0])
        changed = kv.k.clone()
        table = batch.block_tables[0]
        changed[0, table[(block - 1) // 16], :, (block - 1) % 16] += 1  # the block's last key, every kv head
        kv2 = PagedKVCache(1, kv.k.shape[1], 16, Hkv, D, torch.bfloat16)
        kv2.k.copy_(changed)
        kv2.v.copy_(kv.v)
        after = kernels.paged_attention(q, kv2.k[0], kv2.v[0], batch.block_tables, starts, last)
        assert not torch.equal(after[first], got[first])  # position 0 sees position block - 1
        assert torch.equal(after[starts[1]:], got[starts[1]:])  # other sequences untouched


def _float_cache(kv: PagedKVCache) -> PagedKVCache:
    layers, pages, kv_heads, page_size, D = kv.k.shape
    out = PagedKVCache(layers, pages, page_size, kv_heads, D, torch.float32)
    out.k.copy_(kv.k)
    out.v.copy_(kv.v)
    return out


def test_moondream_text_rows_are_the_same_bits_however_they_are_chunked_and_batched(kernels):
    """Moondream's text model in bf16 with its linears and attention on AMX: a sequence's hidden
    states (the 730-position image block, then prompt tokens) are the same bits prefilled whole,
    in chunks and then one decode row at a time, and beside another sequence (the pipeline's
    schedules differ in exactly these ways); and close to the gather + SDPA path's."""
    from gpu_worker.moondream import Moondream
    from shared.moondream_config import MoondreamConfig
    from shared.moondream_random import TINY_CONFIG

    amx(kernels)
    model = Moondream.random(MoondreamConfig.from_dict(TINY_CONFIG), seed=3, dtype=torch.bfloat16)
    t = model.spec.text
    P, T, D = model.prefix_len, model.prefix_len + 23, t.dim // t.n_heads
    pages = -(-T // 16)
    g = torch.Generator().manual_seed(0)
    x, other = (torch.randn(n, t.dim, generator=g).bfloat16() for n in (T, 40))

    def run(chunks, beside=False):
        kv = PagedKVCache(t.n_layers, 2 + 2 * pages, 16, t.n_kv_heads, D, torch.bfloat16)
        table, table_b = list(range(pages, 0, -1)), list(range(2 * pages + 1, pages, -1))
        out = torch.empty(T, t.dim, dtype=torch.bfloat16)
        with torch.inference_mode():
            for start, n in chunks:
                parts, rows = [(start, n, table)], [x[start:start + n]]
                if beside:  # another sequence's 5 rows before this one's (no image block)
                    parts, rows = [(0, 5, table_b)] + parts, [other[:5]] + rows
                batch = Batch.build(parts, 16)
                first = 5 if beside else 0
                prefix = torch.arange(first, first + P) if start == 0 else None
                out[start:start + n] = model.hidden_states(torch.cat(rows), batch, kv, prefix)[first:]
        return out

    plain = run([(0, T)])  # the eager path: gather + SDPA
    pack_linears(model, kernels)
    whole = run([(0, T)])
    assert torch.equal(run([(0, P), (P, 7), (P + 7, 9)] + [(p, 1) for p in range(P + 16, T)]), whole)
    assert torch.equal(run([(0, P + 3), (P + 3, T - P - 3)], beside=True), whole)
    rel = ((whole.float() - plain.float()).norm() / plain.float().norm()).item()
    assert 0 < rel < 0.02, rel  # bf16 noise (two paths, two roundings), not a different attention


@pytest.mark.parametrize("D", [64, 72])  # 72: 18 rotated pairs, a vector tail at every width
def test_moondream_rotary_and_cache_write_in_one_pass_are_the_eager_bits(kernels, D):
    """``partial_rope_kv`` (bf16): q is ``apply_partial_rope``'s bits, k lands rotated and v as it
    is at its kv_index (pages handed out backwards, one mid-page), nothing else written."""
    from gpu_worker.moondream import apply_partial_rope, rope_tables

    H, Hkv, T = 4, 2, 37
    cos_t, sin_t = rope_tables(D, 64, theta=10000.0)
    g = torch.Generator().manual_seed(5)
    qkv = (3 * torch.randn(T, (H + 2 * Hkv) * D, generator=g)).bfloat16()
    positions = torch.arange(5, 5 + T)
    kv_index = torch.arange(T).flip(0) * 2 + 1  # every other place, backwards
    k_cache, v_cache = (torch.zeros((2 * T + 2) // 4, Hkv, 4, D, dtype=torch.bfloat16) for _ in range(2))
    q = kernels.partial_rope_kv(qkv, cos_t, sin_t, positions, kv_index, k_cache, v_cache, H, Hkv)
    eq, ek, ev = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    cos, sin = cos_t[positions], sin_t[positions]
    assert torch.equal(q, apply_partial_rope(eq.view(T, H, D), cos, sin))
    assert torch.equal(_slots(k_cache)[kv_index], apply_partial_rope(ek.reshape(T, Hkv, D), cos, sin))
    assert torch.equal(_slots(v_cache)[kv_index], ev.reshape(T, Hkv, D))
    untouched = torch.ones(2 * T + 2, dtype=torch.bool)
    untouched[kv_index] = False
    assert not _slots(k_cache)[untouched].any() and not _slots(v_cache)[untouched].any()
    assert not torch.equal(q[:, :, :D // 2], eq.view(T, H, D)[:, :, :D // 2])  # non-vacuity: it rotated


def test_the_level_never_exceeds_the_cpu_and_the_cap_lowers_it(monkeypatch, caplog):
    """load() picks the highest level the CPU runs, or the cap's; a cap above the CPU, or one that
    names no level, is refused with what the CPU has; the log says which level runs and why."""
    runnable, above = cpu_kernels.runnable_levels()
    have = cpu_kernels.cpu_features()
    assert runnable[0].name == "scalar"
    assert all(set(level.needs) <= have for level in runnable)
    names = [level.name for level in cpu_kernels.levels()]
    if len(runnable) < len(names):  # the next level up: the CPU lacks one of its features (or AMX's grant)
        nxt = cpu_kernels.levels()[len(runnable)]
        assert above.startswith(f"{nxt.name}: ")
        assert not set(nxt.needs) <= have or nxt.name == "amx"
    monkeypatch.delenv(cpu_kernels.LEVEL_ENV, raising=False)
    assert cpu_kernels.choose_level()[0] == runnable[-1]
    for level in runnable:
        monkeypatch.setenv(cpu_kernels.LEVEL_ENV, level.name)
        with caplog.at_level("INFO", logger="gpu_worker.cpu_kernels"):
            assert cpu_kernels.load().level == level.name
        assert f"cpu kernels: level {level.name} (" in caplog.text and f"cap: {level.name})" in caplog.text
        caplog.clear()
    monkeypatch.delenv(cpu_kernels.LEVEL_ENV)
    assert cpu_kernels.load(level="scalar").level == "scalar"  # the keyword caps as the variable does
    for too_high in names[len(runnable):]:
        with pytest.raises(ValueError, match=f"{too_high}.*above this CPU: it runs up to {runnable[-1].name}"):
            cpu_kernels.load(level=too_high)
    with pytest.raises(ValueError, match="not a CPU kernels level"):
        cpu_kernels.load(level="sse9")


def test_the_default_dtype_is_bf16_where_the_kernels_build_at_a_measured_level(monkeypatch, caplog):
    """A CPU without native bf16 (an AVX2-only one's /proc/cpuinfo, this CPU's levels capped) still
    gets bf16 by default where the kernels build at a level whose bf16 was measured faster than
    float32's eager forward; without them, or at the scalar level, float32; native bf16 needs neither.
    The log says which and why."""
    caplog.set_level("INFO", logger="tandem.worker")
    from gpu_worker.model_runner import BF16_LEVELS, default_dtype

    runnable = [level.name for level in cpu_kernels.choosable_levels()]
    if "avx2" not in runnable:
        pytest.skip(f"this CPU runs {runnable}: no level of {BF16_LEVELS}")
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "avx2")
    assert default_dtype(False) == torch.bfloat16 and cpu_kernels.builds()
    assert "dtype bfloat16 by default: the CPU kernels' bf16 linears at level avx2" in caplog.text
    assert default_dtype(False, kernels=False) == torch.float32  # the kernels may not run: aten's float32
    assert default_dtype(True, kernels=False) == torch.bfloat16  # CUDA
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "scalar")
    assert "scalar" not in BF16_LEVELS and default_dtype(False) == torch.float32
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "avx2")
    monkeypatch.setattr(cpu_kernels, "builds", lambda: False)  # no C compiler
    assert default_dtype(False) == torch.float32
    assert caplog.records[-1].getMessage() == ("dtype float32 by default: the CPU kernels do not build here and "
                                               "the CPU has no native bf16")
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert default_dtype(False) == torch.bfloat16  # native bf16: oneDNN's, kernels or not


def test_a_function_the_level_lacks_is_absent_and_fails_loudly(kernels):
    if kernels.has_matmul:
        pytest.skip("level amx has every function")
    with pytest.raises(NotImplementedError, match=f"linear_bf16 is not in the level {kernels.level}"):
        kernels.linear(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(32 * 32, dtype=torch.bfloat16), None, 32)
    assert not kernels.can_matmul(torch.zeros(32, 32, dtype=torch.bfloat16))


def test_the_profiler_sees_each_kernel_call_as_one_tandem_op(kernels):
    """Each kernel call is one ``tandem::`` op in the profile (a ctypes call alone is invisible
    there): the Python loop's kernels counted per layer, then the one-call loop's ``tandem::layers``
    and the quantized head's ``tandem::wlinear``, once a forward."""
    from gpu_worker.gguf_weights import quantize_linears
    from gpu_worker.quant import QuantKernels

    L = TINY32.num_hidden_layers
    ids = torch.randint(0, TINY32.vocab_size, (5,), generator=torch.Generator().manual_seed(10))
    model = Llama.random(TINY32, seed=7, dtype=torch.float32)
    model.cpu_kernels = kernels
    expected = [{"tandem::add_rmsnorm": 2 * L + 1, "tandem::rope_kv": L, "tandem::attention": L, "tandem::silu_mul": L},
                {"tandem::layers": 1, "tandem::wlinear": 1}]
    for want in expected:  # plain linears (the Python loop), then int8 ones (every layer in one call)
        kv = PagedKVCache.from_config(TINY32, 4, 4, torch.float32, "cpu")
        with torch.inference_mode(), torch.profiler.profile() as prof:
            _forward(model, kv, [(0, 5, [1, 2])], ids)
        assert collections.Counter(e.name for e in prof.events() if e.name.startswith("tandem::")) == want
        quantize_linears(model, "int8", 32, QuantKernels(kernels))


def test_each_ops_schema_is_its_kernels_arguments():
    """Every op's schema names its kernel's arguments in order (after the handle): the AMX ops run only
    on an AMX machine, so this is where any other machine checks them."""
    import inspect

    for name, (_schema, kernel) in cpu_kernels._OPS.items():
        schema = getattr(torch.ops.tandem, name).default._schema
        assert [a.name for a in schema.arguments] == ["kernels", *list(inspect.signature(kernel).parameters)[1:]]
        assert not schema.returns


def test_torch_compile_keeps_the_ops_whole_and_computes_the_eager_bits(kernels):
    """A layer's kernel calls and a quantized linear under ``torch.compile(fullgraph=True)`` (aot_eager:
    the ops' fake kernels, their writes functionalized): one graph, with each op in it, and the eager
    call's output, residual (written in place) and caches, bit for bit (eager calls the kernels without
    the dispatcher: CpuKernels.run). Under FakeTensorMode a call runs the fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    x = _compiled_layer_is_the_eager_layer(kernels, "aot_eager")
    with FakeTensorMode() as fake:  # a dispatch mode: the op's fake kernel, never the library on fake memory
        h = kernels.add_rmsnorm(fake.from_tensor(x), None, fake.from_tensor(torch.ones(x.shape[1])), 1e-5)
    assert isinstance(h, FakeTensor) and h.shape == x.shape


def test_inductor_compiles_the_ops_to_the_eager_bits():
    """torch.compile's default backend (inductor, which writes C++ for the ops around the kernels and
    reuses the written buffers in place), at the level the engine runs."""
    if not (shutil.which("g++") or shutil.which("c++")):
        unavailable("no C++ compiler for torch.compile's inductor")
    _compiled_layer_is_the_eager_layer(cpu_kernels.load(), "inductor")


def _compiled_layer_is_the_eager_layer(kernels, backend: str) -> torch.Tensor:
    """A layer's kernel calls and a quantized linear, compiled with ``backend`` (fullgraph) and eager, on
    copies of one input: one graph holding the ops; the same output, residual and caches, bit for bit.
    Returns the input."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from gpu_worker.quant import QuantKernels, QuantLinear, quantize

    H, Hkv, D, hidden = 4, 2, 16, 64
    g = torch.Generator().manual_seed(11)
    qkv_proj = QuantLinear([quantize(torch.randn((H + 2 * Hkv) * D, hidden, generator=g), "int8", 32)], None,
                           QuantKernels(kernels))
    norm = torch.rand(hidden, generator=g) + 0.5
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), 1.0 / (10000 ** (torch.arange(0, D, 2) / D)))
    cos, sin = freqs.cos(), freqs.sin()
    batch = Batch.build([(0, 5, [1, 2]), (2, 3, [3, 4])], 4)
    seq_of_token = batch.token_to_padded // batch.max_query_len

    def layer(x, k_cache, v_cache):
        h = kernels.add_rmsnorm(x, None, norm, 1e-5)
        q = kernels.rope_kv(qkv_proj(h), cos, sin, batch.positions, batch.kv_index, k_cache, v_cache, H, Hkv, D)
        o = kernels.attention(q, k_cache, v_cache, batch.block_tables, seq_of_token, batch.positions, Hkv)
        return kernels.add_rmsnorm(x, o, norm, 1e-5) * 2  # an aten op after the kernels: inductor's to write

    x = torch.randn(batch.num_tokens, hidden, generator=g)
    caches = torch.randn(2, 5, Hkv, 4, D, generator=g)
    eager = [x.clone(), *caches.clone()]
    compiled = [x.clone(), *caches.clone()]
    counter = CompileCounterWithBackend(backend)
    want = layer(*eager)
    got = torch.compile(layer, fullgraph=True, backend=counter)(*compiled)
    assert counter.frame_count == 1
    traced = {str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"}
    assert {f"tandem.{op}" for op in ("add_rmsnorm", "wlinear", "rope_kv", "attention")} <= traced
    assert torch.equal(got, want)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0], x) and not torch.equal(eager[1], caches[0])  # non-vacuity: both written
    return x


@pytest.mark.slow
@pytest.mark.parametrize("arch,level", [(arch, level.name) for arch, levels in cpu_kernels.LEVELS.items()
                                        for level in levels])
def test_every_level_compiles(tmp_path, arch, level):
    """The levels this CPU does not run are compiled at least (x86's with gcc's -m flags on any
    x86 machine, aarch64's with Debian's cross compiler, gcc-aarch64-linux-gnu); each exports the
    portable kernels, and only level amx the AMX ones."""
    import platform
    import subprocess

    if arch == platform.machine():
        compiler = None
    elif arch == "aarch64" and platform.machine() == "x86_64":
        compiler = shutil.which("aarch64-linux-gnu-gcc")
        if compiler is None:
            unavailable("no aarch64-linux-gnu-gcc (apt-get install gcc-aarch64-linux-gnu) to compile the NEON level")
    else:
        pytest.skip(f"no cross compiler for {arch} set up on {platform.machine()}")
    lib = cpu_kernels.build(cpu_kernels.level_named(level, arch), tmp_path, compiler)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines()}
    assert {"add_rmsnorm_f32", "attention_bf16", "partial_rope_kv_bf16"} <= exported
    assert ("linear_bf16" in exported) == (level == "amx")


def test_bf16_linears_stay_plain_where_onednn_refuses_bf16(kernels, monkeypatch):
    """On a CPU whose oneDNN has no bf16 prepack (AVX2 only), pack_linears never calls it: a linear the
    kernels' matmul does not take stays an nn.Linear, and the model still runs; a direct
    PackedLinear.from_linear says why it cannot."""
    called = []
    monkeypatch.setattr(cpu_backend, "onednn_packs_bf16", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda *a: called.append(a))
    model = Llama.random(TINY, seed=5, dtype=torch.bfloat16)
    model.cpu_kernels = kernels
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packed = pack_linears(model, kernels)
    assert packed == (len(linears) if kernels.has_matmul else 0) and not called
    if not kernels.has_matmul:
        assert [m for m in model.modules() if type(m) is torch.nn.Linear] == linears
        with pytest.raises(RuntimeError, match="oneDNN refuses bf16"):
            PackedLinear.from_linear(linears[0], kernels)
    kv = PagedKVCache.from_config(TINY, 8, 4, torch.bfloat16, "cpu")
    with torch.inference_mode():
        logits = _forward(model, kv, [(0, 5, [1, 2])], torch.arange(5))
    assert logits.isfinite().all() and not called

"""FlexAttention over the KV pages in place (``gpu_worker/flex_paged.py``) against the gather path
(``model.attend_pages``: each sequence's pages copied out, SDPA with a materialised mask), in float32
on the CPU, where FlexAttention runs eagerly (a dense evaluation of ``mask_mod`` over every slot) and
compiled (inductor's CPU template, which reads only the blocks the ``BlockMask`` lists: what the CUDA
kernels do). Both compute the gather path's softmax over the same keys, so they agree to float32
rounding (1e-5 on values of magnitude 1)."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.batch import Batch
from torch.nn.attention.flex_attention import flex_attention

from gpu_worker.flex_paged import attend_pages_in_place, block_mask, compiled_flex_attention, page_owner
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.model import Llama, LlamaConfig, attend_pages, attention_mask

PAGE = 4
PAGES = 24  # in the cache; page 0 is the engine's scratch page
CLOSE = dict(rtol=1e-5, atol=1e-5)


def _case(chunks, heads: int, kv_heads: int, seed: int = 0, dim: int = 8):
    """A heads_major cache of random keys and values, and random queries for ``chunks`` (Batch.build's)."""
    g = torch.Generator().manual_seed(seed)
    kv = PagedKVCache(1, PAGES, PAGE, kv_heads, dim, dtype=torch.float32, heads_major=True)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    batch = Batch.build(chunks, PAGE)
    return torch.randn(batch.num_tokens, heads, dim, generator=g), kv, batch


def _both(chunks, heads=4, kv_heads=2, seed=0):
    q, kv, batch = _case(chunks, heads, kv_heads, seed)
    gathered = attend_pages(q, 0, batch, kv, attention_mask(batch, kv, heads // kv_heads))
    return gathered, attend_pages_in_place(q, 0, batch, kv, block_mask(batch, PAGES, PAGE))


def test_a_heads_major_cache_holds_what_the_default_layout_holds():
    default, heads = (PagedKVCache(2, PAGES, PAGE, 3, 8, torch.float32, heads_major=h) for h in (False, True))
    g = torch.Generator().manual_seed(1)
    slots, k, v = torch.tensor([5, 17, 40, 93]), torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    for kv in (default, heads):
        kv.write(1, slots, k, v)
    assert torch.equal(heads.k, default.k) and torch.equal(heads.v, default.v) and not heads.k.is_contiguous()
    tables = torch.tensor([[1, 4, 10], [23, 0, 0]])
    assert all(torch.equal(a, b) for a, b in zip(heads.gather(1, tables), default.gather(1, tables)))
    keys, _ = heads.by_head(1)  # [1, Hkv, slots, D], a view of the same memory
    assert keys.shape == (1, 3, PAGES * PAGE, 8) and torch.equal(keys[0, :, slots].transpose(0, 1), k)
    assert keys.data_ptr() == heads.k[1].data_ptr()
    with pytest.raises(ValueError, match="heads_major"):
        default.by_head(0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_decode_rows_sharing_prefix_pages_match_the_gather_path(heads, kv_heads):
    shared = [3, 9]  # a prefix-cache hit: two sequences hold the same first pages at the same logical index
    chunks = [(10, 1, [*shared, 5]), (9, 1, [*shared, 17]), (0, 1, [21]), (15, 1, [2, 7, 11, 13])]
    gathered, in_place = _both(chunks, heads, kv_heads)
    assert in_place.shape == gathered.shape == (4, heads * 8)
    torch.testing.assert_close(in_place, gathered, **CLOSE)


def test_prefill_chunks_beside_decode_rows_match_the_gather_path():
    # a chunk after a cached prefix (causal inside it), a whole prompt, a decode row: Qmax 6, padding
    chunks = [(5, 6, [4, 8, 12]), (0, 3, [14]), (7, 1, [19, 20])]
    gathered, in_place = _both(chunks, seed=1)
    assert in_place.shape == (10, 32)
    torch.testing.assert_close(in_place, gathered, **CLOSE)


def test_the_mask_lists_each_sequences_own_pages_and_reads_up_to_its_position():
    """Non-vacuity: keys past a query's position, on another sequence's page or on nobody's change
    nothing; a key within it changes that sequence's output alone."""
    chunks = [(5, 1, [3, 9]), (2, 1, [6])]
    q, kv, batch = _case(chunks, heads=4, kv_heads=2)
    mask = block_mask(batch, PAGES, PAGE)
    assert mask.kv_num_blocks[:, 0, 0].tolist() == [2, 1] and mask.kv_indices.shape == (2, 1, 1, PAGES)
    assert mask.kv_indices[0, 0, 0, :2].tolist() == [3, 9] and mask.kv_indices[1, 0, 0, 0] == 6
    owner = page_owner(batch.block_tables, torch.tensor([2, 1]), PAGES)
    assert owner[0, 3] == 0 and owner[0, 9] == 1 and owner[1, 6] == 0 and owner[0, 6] == -1 and owner[1, 3] == -1
    before = attend_pages_in_place(q, 0, batch, kv, mask)
    kv.k[0, 9, :, 2:] += 100.0  # sequence 0's positions 6 and 7 (past its 5)
    kv.k[0, 6, :, 3:] += 100.0  # sequence 1's position 3 (past its 2)
    kv.k[0, 11] += 100.0  # nobody's page
    torch.testing.assert_close(attend_pages_in_place(q, 0, batch, kv, mask), before, rtol=0, atol=0)
    kv.k[0, 9, :, 1] += 100.0  # sequence 0's position 5: its own
    after = attend_pages_in_place(q, 0, batch, kv, mask)
    assert not torch.allclose(after[0], before[0]) and torch.equal(after[1], before[1])


TINY = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)


def _model_steps(model: Llama, attention):
    """Logits of a prefill of two prompts (one sharing the other's first page), then 4 decode steps,
    with ``attention`` in place (None: the gather path) for the decode steps, as a CUDA graph would."""
    kv = PagedKVCache.from_config(TINY, PAGES, PAGE, torch.float32, "cpu", heads_major=True)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, TINY.vocab_size, (9,), generator=g)
    tables = [[1, 2, 3, 4], [1, 5, 6, 7]]  # page 1 shared: the same first 4 tokens
    ids = torch.cat([prompt, prompt[:4], torch.randint(0, TINY.vocab_size, (3,), generator=g)])
    out = []
    with torch.inference_mode():
        chunks = [(0, 9, tables[0]), (0, 7, tables[1])]
        out.append(model(ids, Batch.build(chunks, PAGE), kv, torch.tensor([8, 15])))
        model.attention_in_place = attention
        for step in range(4):
            chunks = [(9 + step, 1, tables[0]), (7 + step, 1, tables[1])]
            out.append(model(out[-1].argmax(-1), Batch.build(chunks, PAGE), kv, torch.arange(2)))
        model.attention_in_place = None
    return torch.stack(out)


def test_the_models_decode_steps_read_in_place_as_the_gather_path_does():
    model = Llama.random(TINY, seed=3)
    gathered = _model_steps(model, None)
    in_place = _model_steps(model, flex_attention)
    torch.testing.assert_close(in_place, gathered, **CLOSE)
    assert not torch.equal(in_place, gathered)  # non-vacuity: another computation ran (its own rounding)


@pytest.mark.slow  # inductor compiles the kernel (about 25 s here)
def test_the_compiled_kernel_reads_only_the_listed_pages_and_matches_the_gather_path():
    """The compiled kernel skips every block the mask does not list (the eager form evaluates them
    all): the model's decode steps, and the kernel alone where an unlisted page holds huge keys."""
    model = Llama.random(TINY, seed=3)
    compiled = compiled_flex_attention()
    torch.testing.assert_close(_model_steps(model, compiled), _model_steps(model, None), **CLOSE)
    chunks = [(10, 1, [3, 9, 5]), (9, 1, [3, 9, 17]), (0, 1, [21]), (15, 1, [2, 7, 11, 13])]
    q, kv, batch = _case(chunks, heads=4, kv_heads=2)
    kv.k[0, 14:17] += 1e4  # nobody's pages
    reference = attend_pages(q, 0, batch, kv, attention_mask(batch, kv, 2))
    torch.testing.assert_close(attend_pages_in_place(q, 0, batch, kv, block_mask(batch, PAGES, PAGE), compiled),
                               reference, **CLOSE)


def test_a_decode_graph_reads_in_place_only_where_the_kernel_runs_and_agrees(monkeypatch, caplog):
    """The choice made per decode graph at capture (``model_runner._in_place_attention``), on the CPU
    with FlexAttention's eager form standing in for the compiled one: the kernel when it gives the gather
    path's logits on the graph's inputs; the gather path (None, logged) when it differs; the gather
    path for this graph and every later one when it raises."""
    from types import SimpleNamespace

    from gpu_worker import flex_paged
    from gpu_worker.model_runner import _in_place_attention

    model = Llama.random(TINY, seed=3)
    kv = PagedKVCache.from_config(TINY, PAGES, PAGE, torch.float32, "cpu", heads_major=True)
    batch = Batch.build([(5, 1, [2, 3]), (0, 1, [4])], PAGE)
    runner = SimpleNamespace(model=model, in_place=True)

    def forward():
        with torch.inference_mode():
            return model(torch.tensor([7, 9]), batch, kv, torch.arange(2)), None

    def wrong(q, k, v, block_mask, enable_gqa):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa) + 1.0

    def broken(*args, **kw):
        raise RuntimeError("no kernel for this GPU")

    for kernel, chosen in ((flex_attention, flex_attention), (wrong, None), (broken, None)):
        monkeypatch.setattr(flex_paged, "compiled_flex_attention", lambda k=kernel: k)
        assert _in_place_attention(runner, forward, "batch=2 pages=2") is chosen
        assert model.attention_in_place is None  # the eager forwards keep the gather path
    assert "differ from the gather path's" in caplog.text and "no kernel for this GPU" in caplog.text
    assert runner.in_place is False  # a kernel that raised is not tried for the next graphs

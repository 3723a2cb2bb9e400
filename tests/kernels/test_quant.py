"""Weight-only quantized linears (gpu_worker/quant.py, gpu_worker/kernels/quant.c).

- GGUF blocks repacked into the kernel's formats expand to exactly ``gguf``'s own float32
  dequantization, for each supported type (random blocks: every bit pattern of the payload);
- the kernel against a float64 matmul over the same expanded weights, within float32
  summation's bound, for each format, x in float32 and bf16, row counts around its blocking;
  and each row's result independent of the rows beside it (the engine batches rows differently
  in its pipelined and blocking schedules);
- int8 / int4 quantization at load, and a model served from a GGUF file against the same
  weights dequantized: teacher-forced top-1 agreement (the embedded SmolLM2-135M Q4_1 file, real
  weights), and the engine's pipelined == blocking with quantized weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker import cpu_kernels, quant
from gpu_worker.gguf_weights import holds_only_bf16 as gguf_holds_only_bf16
from gpu_worker.model_runner import kv_cache_dtype
from gpu_worker.quant import QWeight

pytestmark = pytest.mark.slow

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", params=[lv.name for lv in cpu_kernels.choosable_levels()])
def kernels(request):
    """quant.c at every ISA level this CPU runs (TANDEM_CPU_LEVEL caps them)."""
    k = cpu_kernels.load(level=request.param)
    assert k is not None, "the CPU kernels did not build (is a C compiler installed?)"
    return quant.QuantKernels(k)


# Bytes per block and where its fp16 scales lie (the rest of a block is any bit pattern).
BLOCKS = {"Q8_0": (34, 32, [0]), "Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q4_K": (144, 256, [0, 2]),
          "Q6_K": (210, 256, [208])}


class Tensor:
    """What ``quant.from_gguf`` reads of a ``gguf.GGUFReader`` tensor."""

    def __init__(self, kind: str, data: np.ndarray, N: int, K: int, name: str = "t"):
        self.tensor_type, self.data, self.shape, self.name = T[kind], data, [K, N], name


def random_blocks(kind: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    size, per, scales = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (N, K // per, size), dtype=np.uint8)
    for at in scales:  # finite scales of a weight's magnitude
        data[:, :, at:at + 2] = (rng.standard_normal((N, K // per, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return data.reshape(N, -1)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_gguf_blocks_expand_to_ggufs_own_dequantization(kernels, kind):
    N, K = 8, 512
    blocks = random_blocks(kind, N, K)
    w = quant.from_gguf(Tensor(kind, blocks, N, K))
    ref = gguf.quants.dequantize(blocks, T[kind]).astype(np.float32).reshape(N, K)
    assert np.array_equal(w.dequantize().numpy(), ref)  # bit for bit
    ids = torch.tensor([5, 0, 5])
    assert torch.equal(kernels.gather(w, ids), torch.from_numpy(ref[[5, 0, 5]]))
    other = random_blocks(kind, N, K, seed=1)  # non-vacuity: other blocks, other weights
    assert not np.array_equal(quant.from_gguf(Tensor(kind, other, N, K)).dequantize().numpy(), ref)


def test_a_bf16_gguf_matrix_stays_bf16_and_expands_exactly(kernels):
    N, K = 8, 64
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)).bfloat16()
    q = quant.from_gguf(Tensor("BF16", w.view(torch.int16).numpy().view(np.uint8).reshape(N, -1), N, K))
    assert q.fmt == "bf16" and torch.equal(q.dequantize(), w.float())
    assert torch.equal(kernels.gather(q, torch.tensor([3, 1])), w[[3, 1]].float())


def test_an_unsupported_gguf_type_is_refused_by_name():
    with pytest.raises(ValueError, match="Q5_K.*supported: .*Q4_K"):
        quant.from_gguf(Tensor("Q5_K", np.zeros((2, 176), np.uint8), 2, 256, name="blk.0.ffn_up.weight"))


def weights(N: int, K: int) -> dict[str, QWeight]:
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g) * 0.05
    return {"q8": quant.quantize(w, "int8", 128), "q4": quant.quantize(w, "int4", 32),
            "q4/64": quant.quantize(w, "int4", 64),
            "q8/Q6_K": quant.from_gguf(Tensor("Q6_K", random_blocks("Q6_K", N, K), N, K)),
            "bf16": QWeight("bf16", w.bfloat16(), None, None, 0, (N, K))}


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["q8", "q4", "q4/64", "q8/Q6_K", "bf16"])
def test_the_kernel_is_a_float32_matmul_and_each_row_is_alone(kernels, fmt, x_dtype):
    N, K = 37, 256  # N: not a multiple of the kernel's 4-row blocks
    w = weights(N, K)[fmt]
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    layer = quant.QuantLinear([w], bias, kernels)
    held = layer.parts[0]  # tiled (t8 / t4) where the level has the tiled kernel
    assert held.fmt == (("t" + w.fmt[1]) if kernels.tiles(w) else w.fmt)
    assert kernels.tiles(w) == (kernels.level in ("avx512", "avx512_bf16", "amx") and fmt in ("q8", "q4", "q4/64"))
    dense = kernels.multiplied_weight(held, x_dtype).double()  # at bf16-dot levels with bf16 x: rounded to bf16
    assert kernels.bf16_dot == (kernels.level in ("avx512_bf16", "amx"))
    for M in (1, 2, 3, 5, 9, 33):  # around the kernel's blocks of rows (4), streamed and buffered, and a long batch
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(x_dtype)
        y = layer(x)
        assert y.dtype == x_dtype and y.shape == (M, N)
        xm = kernels.multiplied_activation(x, held).double()  # tiled: rounded to int16 per 32 k
        exact = xm @ dense.T + bias.double()
        # float32 sums over K terms: |error| <= K 2^-24 sum |x w| (plus bf16's rounding of the result)
        bound = K * 2 ** -24 * (xm.abs() @ dense.abs().T + bias.double().abs())
        if x_dtype == torch.bfloat16:
            bound = bound + exact.abs() * 2 ** -8
        assert ((y.double() - exact).abs() <= bound).all()
        for m in range(M):  # a row's result does not depend on the rows computed with it
            assert torch.equal(layer(x[m:m + 1]), y[m:m + 1])
    changed = QWeight(w.fmt, w.data.clone(), w.scale, w.offset, w.group, w.shape)
    changed.data.view(torch.uint8 if w.fmt == "q4" else changed.data.dtype)[0, 0] += 1  # one weight moves
    assert not torch.equal(quant.QuantLinear([changed], bias, kernels)(x)[:, 0], y[:, 0])


def test_a_fused_projection_of_mixed_formats_writes_each_part_in_its_columns(kernels):
    K = 256
    parts = [weights(16, K)["q4"], weights(8, K)["q8/Q6_K"], weights(8, K)["q4"]]
    layer = quant.QuantLinear(parts, None, kernels)
    row_major = [quant.untile(p) if p.fmt in ("t8", "t4") else p for p in layer.parts]
    assert [p.fmt for p in row_major] == ["q4", "q8", "q4"]  # neighbours of one format would merge
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    xm = [kernels.multiplied_activation(x, p).double() for p in layer.parts]
    exact = torch.cat([a @ p.dequantize().double().T for a, p in zip(xm, layer.parts)], dim=1)
    bound = K * 2 ** -24 * torch.cat([a.abs() @ p.dequantize().double().abs().T for a, p in zip(xm, layer.parts)],
                                     dim=1)  # float32 sums, as above
    assert ((layer(x).double() - exact).abs() <= bound).all()


def test_tiles_hold_the_row_major_weight_exactly(kernels):
    """tile() and untile() are inverses for every tiled format, N not a multiple of the tile."""
    for w in (weights(37, 256)[f] for f in ("q8", "q4", "q4/64")):
        back = quant.untile(quant.tile(w))
        assert quant.tile(w).fmt == "t" + w.fmt[1] and back.fmt == w.fmt
        for a, b in ((back.data, w.data), (back.scale, w.scale), (back.offset, w.offset)):
            assert (a is None and b is None) or torch.equal(a, b)


def test_q8_tiles_sum_extreme_integers_exactly(kernels):
    """int8 weights at -128 and 127 against activations whose int16 steps reach +-32767 (each block's
    largest |x|): every integer sum exact, whichever way the level multiplies (k-pairs of int16, or
    VNNI's bytes: x's high and low bytes, the high ones offset by 128), streamed and buffered."""
    N, K = 48, 256
    g = torch.Generator().manual_seed(5)
    data = torch.where(torch.rand(N, K, generator=g) < 0.5, -128, 127).to(torch.int8)
    w = QWeight("q8", data, torch.ones(N, K // 32), None, 32, (N, K))
    layer = quant.QuantLinear([w], None, kernels)
    x = torch.where(torch.rand(17, K, generator=g) < 0.5, -1.0, 1.0) * (1 + torch.arange(K) % 7)
    xm = kernels.multiplied_activation(x, layer.parts[0]).double()
    exact = xm @ data.double().T
    bound = K * 2 ** -24 * (xm.abs() @ data.double().abs().T)
    for M in (1, 4, 9, 17):  # streamed (up to 4 rows) and buffered
        assert ((layer(x[:M]).double() - exact[:M]).abs() <= bound[:M]).all()


def test_tiles_hold_their_scales_in_fp16_where_that_is_exact(kernels):
    """fp16 scales where every scale and offset is an fp16 number (the quantizer's, as a GGUF file's
    Q4_0, Q4_1 and Q8_0), float32 where one is not; either way the same products bit for bit."""
    if not kernels.tile_rows:
        pytest.skip(f"level {kernels.level} has no tiled kernel")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for fmt in ("q4", "q4/64", "q8"):
        w = weights(37, 256)[fmt]
        held = quant.tile(w)
        assert held.scale.dtype == torch.float16 and held.code == quant.FORMATS[held.fmt] | quant.HALF_SCALES
        odd = quant.tile(QWeight(w.fmt, w.data, w.scale * (1 + 2 ** -20), w.offset, w.group, w.shape))
        assert odd.scale.dtype == torch.float32 and odd.code == quant.FORMATS[held.fmt]  # not an fp16 number
        wide = QWeight(held.fmt, held.data, held.scale.float(), held.offset.float(), held.group, held.shape)
        assert wide.nbytes > held.nbytes and wide.code == quant.FORMATS[held.fmt]
        y = [torch.empty(5, 37) for _ in range(2)]
        kernels.linear(x, held, None, y[0])
        kernels.linear(x, wide, None, y[1])
        assert torch.equal(y[0], y[1])
        wide.scale[0, 0, 0] *= 1 + 2 ** -20  # non-vacuity: the kernel reads the scales it is given
        kernels.linear(x, wide, None, y[1])
        assert not torch.equal(y[0][:, 0], y[1][:, 0]) and torch.equal(y[0][:, 1:], y[1][:, 1:])


def test_quantization_at_load_is_close_and_refuses_what_it_cannot():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for method, group, step in (("int8", 32, 1 / 255), ("int8", 128, 1 / 255), ("int4", 32, 1 / 15),
                                ("int4", 128, 1 / 15)):
        q = quant.quantize(w, method, group)
        g = w.view(64, -1, group)
        lo = g.amin(2, keepdim=True)
        span, lo = ((g.amax(2, keepdim=True) - lo).expand(-1, -1, group).reshape(64, 256),
                    lo.expand(-1, -1, group).reshape(64, 256))
        # round to nearest: half a step of the group's range, plus the offset's and the scale's
        # rounding to fp16 (2^-11 of each; the scale's times up to `levels` steps = the span), plus
        # float32 rounding
        bound = span * step / 2 * (1 + 1e-5) + (lo.abs() + span) * 2 ** -11 + 1e-6
        assert ((q.dequantize() - w).abs() <= bound).all(), (method, group)
        assert q.scale.equal(q.scale.half().float())  # fp16 numbers, as tile() can hold them
        assert (q.dequantize() != w).any()  # non-vacuity: it did round
    with pytest.raises(ValueError, match="group"):
        quant.quantize(w, "int4", 48)
    with pytest.raises(ValueError, match="int8 or int4"):
        quant.quantize(w, "fp8")


def write_gguf(path, matrices: dict[str, str]) -> None:
    """A GGUF file with a float32 norm vector and a 2 x 32 matrix of each named type."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    for name, kind in matrices.items():
        if kind == "BF16":
            writer.add_tensor(name, np.zeros((2, 32), np.uint16), raw_dtype=T.BF16)
        elif kind == "Q8_0":
            writer.add_tensor(name, random_blocks(kind, 2, 32), raw_dtype=T.Q8_0)  # its blocks: 2 x 34 bytes
        else:
            writer.add_tensor(name, np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_bf16_gguf_runs_on_the_amx_matmul_where_the_kernels_run_amx(tmp_path, monkeypatch):
    """--quantization auto serves a GGUF file's blocks as they are, except a file of BF16 matrices at
    level amx with bf16 activations: the float path then holds the very same weights (their expansion
    is exact) and multiplies them on AMX tiles (BENCHMARKS.md "On the AMX Xeon again")."""
    from gpu_worker import model_runner
    from gpu_worker.engine import EngineConfig
    from shared.models.gguf_files import GGUF_FILE

    files = {"bf16": {"blk.0.ffn_up.weight": "BF16", "output.weight": "BF16"},
             "mixed": {"blk.0.ffn_up.weight": "BF16", "output.weight": "Q8_0"},
             "f32": {"blk.0.ffn_up.weight": "F32"}}
    dirs = {}
    for name, matrices in files.items():
        (tmp_path / name).mkdir()
        write_gguf(tmp_path / name / GGUF_FILE, matrices)
        dirs[name] = tmp_path / name
    assert [gguf_holds_only_bf16(d) for d in dirs.values()] == [True, False, False]

    def held(name, level="amx", **options):
        monkeypatch.setattr(cpu_kernels, "choose_level", lambda: (cpu_kernels.level_named(level, "x86_64"), "test"))
        return model_runner._quantization(EngineConfig(model=str(dirs[name]), **options), torch.device("cpu"),
                                          dirs[name])

    assert held("bf16") is None  # floats: the AMX matmul
    assert held("bf16", dtype="bfloat16") is None
    assert held("bf16", level="avx512_bf16") == "gguf"  # the weight-only kernel is the faster one there
    assert held("bf16", dtype="float32") == "gguf"  # float32 activations: the weight-only kernel's numerics
    assert held("bf16", cpu_kernels=False) == "gguf"
    assert held("mixed") == held("f32") == "gguf"  # quantized blocks, or floats bf16 would round
    assert held("bf16", quantization="none") is None


# ---- whole models ---------------------------------------------------------------------------------

PROMPTS = ["Write a short poem about the sea.", "Explain why the sky is blue.", "What is the capital of France?",
           "List three uses of a paperclip.", "Describe a cat to someone who has never seen one.",
           "How do airplanes stay in the air?", "Give me a recipe for pancakes.", "Why do we dream?"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    """The embedded SmolLM2-135M (its Q4_1 GGUF file and that file dequantized to float32), 8 chat
    prompts each continued by 64 of transformers' greedy tokens on the dequantized weights, and
    transformers' top-1 token after every position of those continuations (teacher forcing)."""
    from prerequisites import unavailable

    from frontend.server.tokenization import chat_prompt_ids
    from shared.models.registry import load_tokenizer, resolve_model

    transformers = pytest.importorskip("transformers")
    try:
        path = resolve_model("smollm2-135m", quiet=True)
    except (ImportError, FileNotFoundError) as e:
        unavailable(f"smollm2-135m weights not available here: {e!r}")
    tok = load_tokenizer(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seqs, tops = [], []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = chat_prompt_ids(tok, [{"role": "user", "content": p}])
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)[0].tolist()
            seqs.append((len(ids), out))
            tops.append(hf(torch.tensor([out])).logits[0, len(ids) - 1:-1].argmax(-1))
    return path, seqs, tops


def top1_agreement(model, seqs, tops, kv_dtype=torch.float32) -> float:
    """The share of positions where ``model``'s top-1 token, over each whole sequence in one
    forward, is transformers'."""
    from model_harness import PAGE_SIZE, Harness

    pages = sum(-(-(len(s) + 1) // PAGE_SIZE) for _, s in seqs) + 1
    h = Harness(model, [s for _, s in seqs], max_new=1, num_pages=pages, kv_dtype=kv_dtype)
    same = total = 0
    for i, ((n_prompt, s), top) in enumerate(zip(seqs, tops)):
        logits = h.step([(i, len(s))])
        ours = logits[n_prompt - 1:len(s) - 1].argmax(-1)
        same += int((ours == top).sum())
        total += len(top)
    return same / total


# bf16 activations cost agreement whatever the weights: the Q4_1 file with bf16 activations and its
# weights expanded in float32 (level avx512) agreed at 97.3%, with them rounded to bf16 (vdpbf16ps,
# level avx512_bf16) at 97.5%, on AMD Zen 4.
@pytest.mark.parametrize("method, dtype, floor", [("gguf", torch.float32, 0.99), ("gguf", torch.bfloat16, 0.97),
                                                  ("int8", torch.float32, 0.99), ("int4", torch.float32, 0.95)])
def test_quantized_smollm2_agrees_with_its_float32_weights(smollm2, method, dtype, floor):
    """The GGUF file served in its own format (Q4_1 blocks, Q8_0 embeddings), and the float32
    weights quantized at load, against transformers on those float32 weights, at the CPU's own
    level (with float32 activations the levels differ only in the order of float32 sums, tested
    above). bf16 activations as a CPU with native bf16 serves them by default: where the level has
    bf16 dot products, they multiply the weights rounded to bf16."""
    from gpu_worker.gguf_weights import load_gguf, quantize_linears
    from gpu_worker.model import Llama

    kernels = quant.QuantKernels(cpu_kernels.load())
    path, seqs, tops = smollm2
    if method == "gguf":
        model = load_gguf(path, kernels, dtype, max_model_len=512)
        assert {p.fmt for m in model.modules() if isinstance(m, quant.QuantLinear) for p in m.parts} == (
            {"t4", "t8"} if kernels.tile_rows else {"q4", "q8"})
    else:
        model = Llama.from_pretrained(path, dtype=torch.float32, max_model_len=512)
        assert quantize_linears(model, method, 32, kernels) == 30 * 4 + 1
    model.cpu_kernels = kernels.source  # the layers as the engine runs them, over the engine's KV cache
    kv_dtype = kv_cache_dtype(dtype, True, model.cpu_kernels is not None)
    agreement = top1_agreement(model, seqs, tops, kv_dtype)
    print(f"{method} {dtype} (KV cache {kv_dtype}): top-1 agreement {agreement:.4f} "
          f"over {len(tops) * NEW_TOKENS} positions")
    assert agreement >= floor

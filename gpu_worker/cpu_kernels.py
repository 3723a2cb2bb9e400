"""The fused CPU kernels of ``cpu_kernels.c``: built once per machine, called through ctypes.

:func:`load` compiles the C file with the system's C compiler (``cc -O3
-march=native -fopenmp``, about a second) into the cache directory's ``kernels/``
(``~/.cache/tandem/kernels/`` by default) under a name that hashes the source, the
flags and the CPU, and loads it;
without a compiler it returns None and the model keeps its eager path
(``Llama.forward`` uses the kernels only when a :class:`CpuKernels` is attached).

Each method takes contiguous CPU tensors of one dtype (bfloat16 or float32) and
allocates its output. ctypes drops the GIL for the call, so another Python thread
runs while a kernel does.

Where the CPU has AMX (and the kernel grants it), :meth:`CpuKernels.linear` is also the
bf16 matmul of every linear layer (``gpu_worker.model.PackedLinear``): a weight packed once
by :meth:`CpuKernels.pack_linear`, each row's result independent of the batch.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.arith import ceil_div
from shared.models import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared", "-fPIC")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rmsnorm": (_P, _P, _P, _P, _I, _I, _F, ctypes.c_int),
    "rope_kv": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int),
    "attention": (_P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _P, ctypes.c_int),
    "silu_mul": (_P, _P, _I, _I, ctypes.c_int),
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_LINEAR = {"linear_pack_bf16": (_P, _P, _I, _I), "linear_bf16": (_P, _P, _P, _P, _I, _I, _I, ctypes.c_int),
           "linear_gelu_bf16": (_P, _P, _P, _P, _I, _I, _I, ctypes.c_int),
           "full_attention_bf16": (_P, _P, _I, _I, _I, _I, _F, ctypes.c_int),
           "paged_attention_amx_bf16": (_P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int),
           "partial_rope_kv_bf16": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int),
           "layers_bf16": (_P, _P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _F, _I,
                           _P, _P, _P, _P, _P, _P, _P, ctypes.c_int)}


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU model and its flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def build(cache_dir: Path | None = None) -> Path:
    """The shared library, compiled if this machine has none yet; raises if it cannot be."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cc, *FLAGS)).encode() + _cpu_id().encode()).hexdigest()[:16]
    cache_dir = cache_dir or cache_root().parent / "kernels"  # beside the converted models
    lib = cache_dir / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class CpuKernels:
    """Typed wrappers of the library's functions; see ``cpu_kernels.c`` for what each computes."""

    def __init__(self, lib: Path):
        self.path = lib
        dll = ctypes.CDLL(str(lib))
        self._fn = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, sfx in _SUFFIX.items():
                fn = getattr(dll, f"{name}_{sfx}")
                fn.argtypes, fn.restype = argtypes, None
                self._fn[name, dtype] = fn
        self._scratch = torch.empty(0)
        for name, argtypes in _LINEAR.items():
            fn = getattr(dll, name)
            fn.argtypes, fn.restype = argtypes, None
            self._fn[name] = fn
        # AMX: compiled in (-march=native on a CPU that has it) and granted by the kernel.
        self.has_matmul = bool(dll.linear_ready())

    def can_matmul(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`linear` computes with ``weight`` [N, K]: bf16 on a CPU with AMX (any
        shape: the packed copy is zero-padded to multiples of 32)."""
        return self.has_matmul and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] (see :meth:`can_matmul`) in the tile layout :meth:`linear` reads, N and
        K zero-padded to multiples of 32."""
        N, K = weight.shape
        w = weight.detach().contiguous()
        packed = torch.empty(ceil_div(N, 32) * 32 * ceil_div(K, 32) * 32, dtype=torch.bfloat16)
        self._fn["linear_pack_bf16"](w.data_ptr(), packed.data_ptr(), N, K)
        return packed

    def layers(self, x: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
               seq_of_token: torch.Tensor, heads: int, kv_heads: int, head_dim: int, intermediate: int,
               eps: float) -> torch.Tensor:
        """Every decoder layer in one call (``layers_bf16``): x [T, hidden] bf16 updated in place as the
        residual stream; ``weights`` the int64 [layers, 10] addresses of ``Llama._layer_weights``; the
        caches k, v [layers, pages, page_size, kv_heads, head_dim]. -> norm(x) after the last layer."""
        T, hidden = x.shape
        page_size = k.shape[2]
        max_len = block_tables.shape[1] * page_size
        threads = torch.get_num_threads()
        scratch = self._attention_scratch(threads, heads // kv_heads, max_len)
        h = torch.empty_like(x)
        qkv = torch.empty((T, (heads + 2 * kv_heads) * head_dim), dtype=x.dtype)
        q, o = (torch.empty((T, heads * head_dim), dtype=x.dtype) for _ in range(2))
        proj = torch.empty_like(x)
        gate_up = torch.empty((T, 2 * intermediate), dtype=x.dtype)
        act = torch.empty((T, intermediate), dtype=x.dtype)
        self._fn["layers_bf16"](x.data_ptr(), h.data_ptr(), weights.data_ptr(), weights.shape[0], k.data_ptr(),
                                v.data_ptr(), k[0].numel(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], page_size,
                                seq_of_token.data_ptr(), T, heads, kv_heads, head_dim, hidden, intermediate, eps,
                                max_len, qkv.data_ptr(), q.data_ptr(), o.data_ptr(), proj.data_ptr(), gate_up.data_ptr(),
                                act.data_ptr(), scratch.data_ptr(), threads)
        return h

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               gelu: bool = False) -> torch.Tensor:
        """x [..., K] bf16 @ the packed weight^T (+ bias) -> [..., N] bf16, each row alone; ``gelu``:
        then gelu_tanh on the float32 result, rounded once."""
        K = x.shape[-1]
        rows = x.reshape(-1, K).contiguous()
        y = torch.empty((rows.shape[0], out_features), dtype=torch.bfloat16)
        self._fn["linear_gelu_bf16" if gelu else "linear_bf16"](
            rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            rows.shape[0], K, out_features, torch.get_num_threads())
        return y.view(*x.shape[:-1], out_features)

    def full_attention(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """Non-causal attention of each row of qkv [B, T, 3 H D] bf16 (q, k, v side by side, as the
        fused projection writes them) over its own T tokens -> [B, T, H D] (AMX only: see
        :attr:`has_matmul`)."""
        B, T, width = qkv.shape
        D = width // 3 // heads
        qkv = qkv.contiguous()
        out = torch.empty((B, T, heads * D), dtype=torch.bfloat16)
        self._fn["full_attention_bf16"](qkv.data_ptr(), out.data_ptr(), B, T, heads, D, D ** -0.5,
                                          torch.get_num_threads())
        return out

    def partial_rope_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                        kv_heads: int) -> torch.Tensor:
        """Moondream's rotary (``moondream.apply_partial_rope``, the same bits) on q and k of the
        fused qkv rows [T, (H + 2 Hkv) D] bf16 at ``positions`` (float32 tables [len, rot / 2]);
        k and v written into the cache slots ``slot_mapping``; -> q [T, H, D]."""
        T, width = qkv.shape
        D = width // (heads + 2 * kv_heads)
        qkv = qkv.contiguous()
        q = torch.empty((T, heads, D), dtype=torch.bfloat16)
        self._fn["partial_rope_kv_bf16"](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                         slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(),
                                         T, heads, kv_heads, D, 2 * cos.shape[1], torch.get_num_threads())
        return q

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, starts: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] bf16 (the rows of sequence s are ``starts[s] .. starts[s + 1] - 1``) over the
        keys of one layer's caches [pages, page_size, Hkv, D] (page_size a multiple of 16): row t
        sees its sequence's positions 0 .. ``last[t]`` -> [T, H * D]. On AMX; each row's result
        does not depend on the rows computed with it."""
        T, H, D = q.shape
        q = q.contiguous()
        out = torch.empty((T, H * D), dtype=torch.bfloat16)
        self._fn["paged_attention_amx_bf16"](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                             block_tables.data_ptr(), block_tables.shape[1], k_cache.shape[1],
                                             starts.data_ptr(), last.data_ptr(), out.data_ptr(), block_tables.shape[0],
                                             H, k_cache.shape[2], D, D ** -0.5, torch.get_num_threads())
        return out

    def add_rmsnorm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += y`` in place (rounded as the eager add), then rmsnorm(x) * weight -> a new tensor."""
        h = torch.empty_like(x)
        self._fn["add_rmsnorm", x.dtype](x.data_ptr(), None if y is None else y.data_ptr(), weight.data_ptr(),
                                         h.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return h

    def rope_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int) -> torch.Tensor:
        """Rotary on q and k of the fused qkv rows [T, (H + 2 Hkv) D] at ``positions`` (float32 tables
        [len, D / 2]); k and v written into the cache slots ``slot_mapping``; -> q [T, H, D]."""
        T = qkv.shape[0]
        q = torch.empty((T, heads, head_dim), dtype=qkv.dtype)
        self._fn["rope_kv", qkv.dtype](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                       slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(),
                                       T, heads, kv_heads, head_dim, torch.get_num_threads())
        return q

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_of_token: torch.Tensor, positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Causal attention of q [T, H, D] over the pages of each token's sequence -> [T, H * D]."""
        T, H, D = q.shape
        page_size = k_cache.shape[1]
        max_len = block_tables.shape[1] * page_size
        threads = torch.get_num_threads()
        scratch = self._attention_scratch(threads, H // kv_heads, max_len)
        out = torch.empty((T, H * D), dtype=q.dtype)
        self._fn["attention", q.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                       block_tables.shape[1], page_size, seq_of_token.data_ptr(), positions.data_ptr(),
                                       out.data_ptr(), T, H, kv_heads, D, max_len, scratch.data_ptr(), threads)
        return out

    def _attention_scratch(self, threads: int, group: int, max_len: int) -> torch.Tensor:
        """The attention kernel's float32 scores, ``group * max_len`` per thread (kept, grown as needed)."""
        if self._scratch.numel() < threads * group * max_len:
            self._scratch = torch.empty(threads * group * max_len, dtype=torch.float32)
        return self._scratch

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [T, 2 I] rows -> [T, I]."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._fn["silu_mul", gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                                            torch.get_num_threads())
        return out


def load(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels for this machine, or None (logged) where they cannot be built."""
    try:
        return CpuKernels(build(cache_dir))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("fused CPU kernels unavailable, using the eager forward: %s", e)
        return None

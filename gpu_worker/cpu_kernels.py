"""The fused CPU kernels of ``kernels/``: built per ISA level, the level picked at run time, each
registered as the torch.library op ``tandem::<name>`` (the profiler shows it, torch.compile keeps it
whole) whose kernel calls the level's library through ctypes.

``kernels/`` holds the C sources: ``vec.h`` (the vector layer, one ``vf`` type per ISA) and the
kernels by family (``fused.c`` Llama's portable kernels, ``moondream.c`` Moondream's, ``amx.c`` the
AMX matmul and attention). :func:`build` compiles every ``kernels/*.c`` into one shared library per
level (explicit ``-m`` flags, never ``-march=native``, so a build runs on any CPU that has its
level) under the cache directory's ``kernels/`` (``~/.cache/tandem/kernels/`` by default), named
by a hash of the sources, the flags and the compiler. :func:`load` picks the highest level the CPU
has and the kernel grants (AMX is granted per process), capped by ``TANDEM_CPU_LEVEL`` or its
``level`` argument, and logs which and why; without a compiler it returns None and the model keeps
its eager path (``Llama.forward`` uses the kernels only when a :class:`CpuKernels` is attached).

Each method takes contiguous CPU tensors of one dtype (bfloat16 or float32), allocates its output
and calls its op. ctypes drops the GIL for the call, so another Python thread runs while a kernel does. A
function the level lacks is absent from its library: calling it raises (``has_matmul`` says
whether the AMX ones are there).

At level amx, :meth:`CpuKernels.linear` is also the bf16 matmul of every linear layer
(``gpu_worker.cpu_backend.PackedLinear``): a weight packed once by :meth:`CpuKernels.pack_linear`, each
row's result independent of the batch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.arith import ceil_div
from shared.models.cache import cache_root

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("kernels")
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared", "-fPIC")
LEVEL_ENV = "TANDEM_CPU_LEVEL"


@dataclass(frozen=True)
class Level:
    """One build of the kernels: its compiler flags and the CPU features (``/proc/cpuinfo``'s
    names) it needs."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]


_AVX2 = Level("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))
_AVX512 = Level("avx512", _AVX2.flags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
                _AVX2.needs + ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
# VNNI with BF16: every CPU with AVX512-BF16 has it (Cooper Lake, Sapphire Rapids on, Zen 4 on); the
# tiled kernel's int16 sums use it (kernels/tiled.c).
_AVX512_BF16 = Level("avx512_bf16", _AVX512.flags + ("-mavx512bf16", "-mavx512vnni"),
                     _AVX512.needs + ("avx512_bf16", "avx512_vnni"))
# Each architecture's levels, lowest first; each runs on a CPU that has its `needs`.
LEVELS = {
    "x86_64": (Level("scalar", (), ()), _AVX2, _AVX512, _AVX512_BF16,
               Level("amx", _AVX512_BF16.flags + ("-mamx-tile", "-mamx-bf16"), _AVX512_BF16.needs + ("amx_tile", "amx_bf16"))),
    # NEON is in every aarch64 CPU (gcc's default); the scalar build turns it off.
    "aarch64": (Level("scalar", ("-march=armv8-a+nosimd",), ()), Level("neon", (), ("asimd",))),
}


def levels(arch: str | None = None) -> tuple[Level, ...]:
    """The levels of ``arch`` (this machine's by default), lowest first."""
    arch = arch or platform.machine()
    if arch not in LEVELS:
        raise RuntimeError(f"no CPU kernels for {arch} (they are built for {', '.join(LEVELS)})")
    return LEVELS[arch]


def level_named(name: str, arch: str | None = None) -> Level:
    for level in levels(arch):
        if level.name == name:
            return level
    raise ValueError(f"{name!r} is not a CPU kernels level; the levels are {', '.join(lv.name for lv in levels(arch))}")


def cpu_features() -> frozenset[str]:
    """The CPU's features: ``/proc/cpuinfo``'s ``flags`` (x86) or ``Features`` (aarch64); without it
    (not Linux), what torch's own dispatch level implies."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    implied = {"AVX2": _AVX2.needs, "AVX512": _AVX512.needs}.get(torch.backends.cpu.get_cpu_capability(), ())
    return frozenset(implied + (("asimd",) if platform.machine() == "aarch64" else ()))


def _amx_granted() -> bool:
    """Whether Linux lets this process use AMX's tile state: it is granted on request
    (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); a tile instruction without it kills the process."""
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 Linux numbers
    return ctypes.CDLL(None).syscall(arch_prctl, req_xcomp_perm, xtiledata) == 0


@functools.cache
def runnable_levels() -> tuple[tuple[Level, ...], str]:
    """The levels this CPU runs, lowest first, and why the next one is not among them ("" when
    none is left), e.g. ``"amx: not on this CPU (no amx_tile, amx_bf16)"``."""
    have, ok = cpu_features(), []
    for level in levels():
        missing = [f for f in level.needs if f not in have]
        if missing:
            return tuple(ok), f"{level.name}: not on this CPU (no {', '.join(missing)})"
        if level.name == "amx" and not _amx_granted():
            return tuple(ok), f"{level.name}: not granted by the kernel"
        ok.append(level)
    return tuple(ok), ""


def choose_level(cap: str | None = None) -> tuple[Level, str]:
    """The level to run: the highest this CPU runs, at most ``cap`` (else ``$TANDEM_CPU_LEVEL``), and
    why (for the log). A cap above what the CPU runs is an error that names what the CPU has."""
    cap = cap or os.environ.get(LEVEL_ENV) or None
    ok, above = runnable_levels()
    if cap is None:
        return ok[-1], f"{above or 'the highest level'}; cap: none"
    wanted = level_named(cap)
    if wanted not in ok:
        known = sorted({f for lv in levels() for f in lv.needs} & cpu_features())
        raise ValueError(f"the CPU kernels' cap {cap!r} ({LEVEL_ENV} or load(level=)) is above this CPU: it runs up "
                         f"to {ok[-1].name} ({above}); it has {' '.join(known) or 'none of their features'}")
    i = ok.index(wanted)
    return wanted, f"{ok[i + 1].name + ': capped' if i + 1 < len(ok) else above or 'the highest level'}; cap: {cap}"


def choosable_levels(cap: str | None = None) -> tuple[Level, ...]:
    """The levels this CPU runs up to the one :func:`choose_level` picks: the ones a test can run."""
    ok = runnable_levels()[0]
    return ok[:ok.index(choose_level(cap)[0]) + 1]


def build(level: Level, cache_dir: Path | None = None, compiler: str | None = None) -> Path:
    """The shared library of ``level`` (every ``kernels/*.c``), compiled if this cache has none yet;
    raises if it cannot be. ``compiler``: e.g. a cross compiler, for a level of another arch."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    files = sorted(SOURCES.glob("*.[ch]"))
    flags = (*FLAGS, *level.flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(" ".join((cc, version, *flags)).encode())
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    cache_dir = cache_dir or cache_root().parent / "kernels"  # beside the converted models
    lib = cache_dir / f"tandem-kernels-{level.name}-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"tandem: compiling CPU kernels (level {level.name}) ...", file=sys.stderr, flush=True)
    # Compile beside the target and rename: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")
    os.close(fd)
    try:
        sources = [str(f) for f in files if f.suffix == ".c"]
        done = subprocess.run([cc, *flags, "-o", tmp, *sources, "-lm"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cc} failed on the level {level.name} kernels: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Exported per element type, as <name>_bf16 and <name>_f32 (fused.c).
_PER_DTYPE = {
    "add_rmsnorm": (_P, _P, _P, _P, _I, _I, _F, ctypes.c_int),
    "rope_kv": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int),
    "attention": (_P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _P, ctypes.c_int),
    "silu_mul": (_P, _P, _I, _I, ctypes.c_int),
    "layers": (_P, _P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _F, _I,
               _P, _P, _P, _P, _P, _P, _P, ctypes.c_int),
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# The kernels that write or read the KV cache, also over a cache of another type than the activations':
# float32 activations over bf16 caches (the weight-only quantized models': half the bytes a step reads).
_CACHE_TYPED = ("rope_kv", "attention", "layers")
_KV_SUFFIX = {(torch.float32, torch.bfloat16): "f32_kvbf16"}
# bf16 only: moondream.c's (every level) and amx.c's (level amx).
_BF16_ONLY = {
    "partial_rope_kv_bf16": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int),
    "linear_pack_bf16": (_P, _P, _I, _I), "linear_bf16": (_P, _P, _P, _P, _I, _I, _I, ctypes.c_int),
    "linear_gelu_bf16": (_P, _P, _P, _P, _I, _I, _I, ctypes.c_int),
    "full_attention_bf16": (_P, _P, _I, _I, _I, _I, _F, ctypes.c_int),
    "paged_attention_amx_bf16": (_P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int),
}
# quant.c's weight-only linears (every level; gpu_worker/quant.py calls them).
_C = ctypes.c_int
_QUANT = {"wlinear": (_C, _P, _C, _P, _P, _P, _I, _P, _P, _C, _I, _I, _I, _I, _C),
          "wgather": (_C, _P, _P, _P, _I, _I, _P, _I, _P)}
# The functions that return a value (every level): (argtypes, restype).
_RETURNS = {"attention_scratch_floats": ((_I, _I, _I, _I), _I), "wlinear_bf16_dot": ((), _C),
            "wlinear_tile_rows": ((), _C)}


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for ctypes; None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def _types(x: torch.Tensor, cache: torch.Tensor):
    """The key of a cache-typed kernel: the activations' dtype, or (activations', cache's) where they differ."""
    return x.dtype if x.dtype == cache.dtype else (x.dtype, cache.dtype)


class _Functions(dict):
    """The library's functions by name; one its level lacks raises when looked up."""

    def __init__(self, level: str):
        super().__init__()
        self.level = level

    def __missing__(self, name):
        raise NotImplementedError(f"{name} is not in the level {self.level} CPU kernels")


class CpuKernels:
    """Typed wrappers of a level's library; see ``kernels/*.c`` for what each computes."""

    def __init__(self, lib: Path, level: str):
        self.path, self.level = lib, level
        dll = ctypes.CDLL(str(lib))
        self._fn = _Functions(level)
        exported = {f"{name}_{sfx}": (argtypes, (name, dtype)) for name, argtypes in _PER_DTYPE.items()
                    for dtype, sfx in _SUFFIX.items()}
        exported.update({f"{name}_{sfx}": (_PER_DTYPE[name], (name, types)) for name in _CACHE_TYPED
                         for types, sfx in _KV_SUFFIX.items()})
        exported.update({name: (argtypes, name) for name, argtypes in (_BF16_ONLY | _QUANT).items()})
        for symbol, (argtypes, key) in exported.items():
            fn = getattr(dll, symbol, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, None
                self._fn[key] = fn
        for symbol, (argtypes, restype) in _RETURNS.items():
            fn = getattr(dll, symbol)
            fn.argtypes, fn.restype = argtypes, restype
            self._fn[symbol] = fn
        self._scratch = torch.empty(0)
        self._layer_buffer = torch.empty(0)
        self.handle = next(_handles)  # the ops' first argument (see _OPS)
        _LIVE[self.handle] = self
        # The AMX matmul (and what is built on it): level amx, which runs only where the kernel granted AMX.
        self.has_matmul = "linear_bf16" in self._fn

    def function(self, name: str):
        """The library's function ``name`` (typed), for the modules that wrap their own (quant.py)."""
        return self._fn[name]

    def can_matmul(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`linear` computes with ``weight`` [N, K]: bf16 on a CPU with AMX (any
        shape: the packed copy is zero-padded to multiples of 32)."""
        return self.has_matmul and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] (see :meth:`can_matmul`) in the tile layout :meth:`linear` reads, N and
        K zero-padded to multiples of 32."""
        N, K = weight.shape
        packed = torch.empty(ceil_div(N, 32) * 32 * ceil_div(K, 32) * 32, dtype=torch.bfloat16)
        self.run("pack_linear", weight.detach().contiguous(), packed)
        return packed

    def layers(self, x: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, positions: torch.Tensor, kv_index: torch.Tensor, block_tables: torch.Tensor,
               seq_of_token: torch.Tensor, heads: int, kv_heads: int, head_dim: int, intermediate: int,
               eps: float) -> torch.Tensor:
        """Every decoder layer in one call (``kernels/layers.c``): x [T, hidden] updated in place as the
        residual stream; ``weights`` the int64 table of ``cpu_backend.layer_table``; the caches k, v
        [layers, pages, kv_heads, page_size, head_dim]. -> norm(x) after the last layer."""
        h = torch.empty_like(x)
        self.run("layers", x, h, weights, k, v, cos, sin, positions, kv_index, block_tables, seq_of_token, heads,
                 kv_heads, head_dim, intermediate, eps)
        return h

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               gelu: bool = False) -> torch.Tensor:
        """x [..., K] bf16 @ the packed weight^T (+ bias) -> [..., N] bf16, each row alone; ``gelu``:
        then gelu_tanh on the float32 result, rounded once."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty((rows.shape[0], out_features), dtype=torch.bfloat16)
        self.run("linear", rows, packed, bias, y, gelu)
        return y.view(*x.shape[:-1], out_features)

    def full_attention(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """Non-causal attention of each row of qkv [B, T, 3 H D] bf16 (q, k, v side by side, as the
        fused projection writes them) over its own T tokens -> [B, T, H D] (AMX only: see
        :attr:`has_matmul`)."""
        B, T, width = qkv.shape
        out = torch.empty((B, T, width // 3), dtype=torch.bfloat16)
        self.run("full_attention", qkv.contiguous(), out, heads)
        return out

    def partial_rope_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        kv_index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                        kv_heads: int) -> torch.Tensor:
        """Moondream's rotary (``moondream.apply_partial_rope``, the same bits) on q and k of the
        fused qkv rows [T, (H + 2 Hkv) D] bf16 at ``positions`` (float32 tables [len, rot / 2]);
        k and v written at ``kv_index`` in the caches [pages, Hkv, page_size, D]; -> q [T, H, D]."""
        T, width = qkv.shape
        q = torch.empty((T, heads, width // (heads + 2 * kv_heads)), dtype=torch.bfloat16)
        self.run("partial_rope_kv", qkv.contiguous(), cos, sin, positions, kv_index, k_cache, v_cache, q, kv_heads)
        return q

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, starts: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] bf16 (the rows of sequence s are ``starts[s] .. starts[s + 1] - 1``) over the
        keys of one layer's caches [pages, Hkv, page_size, D] (page_size a multiple of 16): row t
        sees its sequence's positions 0 .. ``last[t]`` -> [T, H * D]. On AMX; each row's result
        does not depend on the rows computed with it."""
        T, H, D = q.shape
        out = torch.empty((T, H * D), dtype=torch.bfloat16)
        self.run("paged_attention", q.contiguous(), k_cache, v_cache, block_tables, starts, last, out)
        return out

    def add_rmsnorm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += y`` in place (rounded as the eager add), then rmsnorm(x) * weight -> a new tensor."""
        h = torch.empty_like(x)
        self.run("add_rmsnorm", x, y, weight, h, eps)
        return h

    def rope_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                kv_index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int) -> torch.Tensor:
        """Rotary on q and k of the fused qkv rows [T, (H + 2 Hkv) D] at ``positions`` (float32 tables
        [len, D / 2]); k and v written at ``kv_index`` in the caches [pages, Hkv, page_size, D]; -> q [T, H, D]."""
        q = torch.empty((qkv.shape[0], heads, head_dim), dtype=qkv.dtype)
        self.run("rope_kv", qkv, cos, sin, positions, kv_index, k_cache, v_cache, q, kv_heads)
        return q

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_of_token: torch.Tensor, positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Causal attention of q [T, H, D] over the pages of each token's sequence -> [T, H * D]."""
        T, H, D = q.shape
        out = torch.empty((T, H * D), dtype=q.dtype)
        self.run("attention", q, k_cache, v_cache, block_tables, seq_of_token, positions, out, kv_heads)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [T, 2 I] rows -> [T, I]."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self.run("silu_mul", gate_up, out)
        return out

    def run(self, op: str, *args) -> None:
        """The op ``tandem::<op>`` on ``args`` (its schema's, after the handle: see _OPS). Through the
        dispatcher where something watches it (the profiler, torch.compile or export, a dispatch mode
        such as FakeTensorMode), else its kernel directly: the dispatcher adds ~3 µs a call, 0.8 ms
        to a bf16 step's Python loop of ~180 calls (BENCHMARKS.md "The kernels as torch.library ops")."""
        if torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled() \
                or torch._C._len_torch_dispatch_stack():
            getattr(torch.ops.tandem, op)(self.handle, *args)
        else:
            _OPS[op][1](self, *args)

    # What the ops' kernels keep between calls (the compute thread is their one user).

    def activations(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The layers' activation buffer of at least ``numel`` elements of ``dtype`` (kept, grown as
        needed)."""
        if self._layer_buffer.dtype != dtype or self._layer_buffer.numel() < numel:
            self._layer_buffer = torch.empty(numel, dtype=dtype)
        return self._layer_buffer

    def attention_scratch(self, threads: int, group: int, head_dim: int, max_len: int) -> torch.Tensor:
        """The attention kernel's float32 scratch: a chunk's scores and the chunks' results (kept, grown
        as needed)."""
        floats = self._fn["attention_scratch_floats"](threads, group, head_dim, max_len)
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch


# ---- the kernels as torch.library ops ------------------------------------------------------------
# Each kernel is the op ``tandem::<name>``: the profiler names it and torch.compile keeps it whole (a
# ctypes call is neither seen nor traced). An op writes its outputs into tensors it is given (the
# CpuKernels method that calls it allocates them) and returns nothing, so one fake kernel serves
# every op. Its first argument is the handle of the CpuKernels whose library runs it: a process may
# hold several levels (the tests do). CpuKernels.run calls an op.

def _layers(kn: CpuKernels, x, h, weights, k, v, cos, sin, positions, kv_index, block_tables, seq_of_token, heads,
            kv_heads, head_dim, intermediate, eps):
    T, hidden = x.shape
    page_size = k.shape[3]
    max_len = block_tables.shape[1] * page_size
    threads = torch.get_num_threads()
    scratch = kn.attention_scratch(threads, heads // kv_heads, head_dim, max_len)
    # qkv, q, o, proj, gate_up and act: the layers' activations, in one kept buffer (a CPU forward
    # leaves the caches cold, where each allocation costs ~15 µs: BENCHMARKS.md "Python after a
    # CPU forward runs cold")
    widths = ((heads + 2 * kv_heads) * head_dim, heads * head_dim, heads * head_dim, hidden, 2 * intermediate,
              intermediate)
    spans = [ceil_div(T * w, 64) * 64 for w in widths]  # each a whole number of 64-element blocks
    at = kn.activations(sum(spans), x.dtype).data_ptr()
    starts = []
    for span in spans:
        starts.append(at)
        at += span * x.element_size()
    kn._fn["layers", _types(x, k)](
        x.data_ptr(), h.data_ptr(), weights.data_ptr(), weights.shape[0], k.data_ptr(), v.data_ptr(), k[0].numel(),
        cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), kv_index.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], page_size, seq_of_token.data_ptr(), T, heads, kv_heads, head_dim, hidden,
        intermediate, eps, max_len, *starts, scratch.data_ptr(), threads)


def _linear(kn: CpuKernels, x, packed, bias, y, gelu):
    kn._fn["linear_gelu_bf16" if gelu else "linear_bf16"](
        x.data_ptr(), packed.data_ptr(), _ptr(bias), y.data_ptr(), x.shape[0], x.shape[1], y.shape[1],
        torch.get_num_threads())


def _full_attention(kn: CpuKernels, qkv, out, heads):
    B, T, width = qkv.shape
    D = width // 3 // heads
    kn._fn["full_attention_bf16"](qkv.data_ptr(), out.data_ptr(), B, T, heads, D, D ** -0.5, torch.get_num_threads())


def _partial_rope_kv(kn: CpuKernels, qkv, cos, sin, positions, kv_index, k_cache, v_cache, q, kv_heads):
    T, heads, D = q.shape
    kn._fn["partial_rope_kv_bf16"](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                   kv_index.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(), T, heads,
                                   kv_heads, D, 2 * cos.shape[1], k_cache.shape[2], torch.get_num_threads())


def _paged_attention(kn: CpuKernels, q, k_cache, v_cache, block_tables, starts, last, out):
    T, H, D = q.shape
    kn._fn["paged_attention_amx_bf16"](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                       block_tables.shape[1], k_cache.shape[2], starts.data_ptr(), last.data_ptr(),
                                       out.data_ptr(), block_tables.shape[0], H, k_cache.shape[1], D, D ** -0.5,
                                       torch.get_num_threads())


def _add_rmsnorm(kn: CpuKernels, x, y, weight, h, eps):
    kn._fn["add_rmsnorm", x.dtype](x.data_ptr(), _ptr(y), weight.data_ptr(), h.data_ptr(), x.shape[0], x.shape[1], eps,
                                   torch.get_num_threads())


def _rope_kv(kn: CpuKernels, qkv, cos, sin, positions, kv_index, k_cache, v_cache, q, kv_heads):
    T, heads, head_dim = q.shape
    kn._fn["rope_kv", _types(qkv, k_cache)](
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), kv_index.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), q.data_ptr(), T, heads, kv_heads, head_dim, k_cache.shape[2], torch.get_num_threads())


def _attention(kn: CpuKernels, q, k_cache, v_cache, block_tables, seq_of_token, positions, out, kv_heads):
    T, H, D = q.shape
    page_size = k_cache.shape[2]
    max_len = block_tables.shape[1] * page_size
    threads = torch.get_num_threads()
    scratch = kn.attention_scratch(threads, H // kv_heads, D, max_len)
    kn._fn["attention", _types(q, k_cache)](
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], page_size,
        seq_of_token.data_ptr(), positions.data_ptr(), out.data_ptr(), T, H, kv_heads, D, max_len, scratch.data_ptr(),
        threads)


def _silu_mul(kn: CpuKernels, gate_up, out):
    kn._fn["silu_mul", gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
                                      torch.get_num_threads())


def _pack_linear(kn: CpuKernels, w, packed):
    kn._fn["linear_pack_bf16"](w.data_ptr(), packed.data_ptr(), w.shape[0], w.shape[1])


def _wlinear(kn: CpuKernels, fmt, x, data, scale, offset, group, n, bias, y):
    kn._fn["wlinear"](fmt, x.data_ptr(), x.dtype == torch.bfloat16, data.data_ptr(), _ptr(scale), _ptr(offset), group,
                      _ptr(bias), y.data_ptr(), y.dtype == torch.bfloat16, y.stride(0), x.shape[0], x.shape[1], n,
                      torch.get_num_threads())


def _wgather(kn: CpuKernels, fmt, data, scale, offset, group, ids, out):
    kn._fn["wgather"](fmt, data.data_ptr(), _ptr(scale), _ptr(offset), group, out.shape[1], ids.data_ptr(), ids.numel(),
                      out.data_ptr())


# Each op: its schema (after the handle) and its kernel. ``(a!)``: a tensor the op writes.
_OPS = {
    "layers": ("Tensor(a!) x, Tensor(b!) h, Tensor weights, Tensor(c!) k, Tensor(d!) v, Tensor cos, Tensor sin, "
               "Tensor positions, Tensor kv_index, Tensor block_tables, Tensor seq_of_token, int heads, "
               "int kv_heads, int head_dim, int intermediate, float eps", _layers),
    "linear": ("Tensor x, Tensor packed, Tensor? bias, Tensor(a!) y, bool gelu", _linear),
    "full_attention": ("Tensor qkv, Tensor(a!) out, int heads", _full_attention),
    "partial_rope_kv": ("Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor kv_index, Tensor(a!) k_cache, "
                        "Tensor(b!) v_cache, Tensor(c!) q, int kv_heads", _partial_rope_kv),
    "paged_attention": ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, Tensor last, "
                        "Tensor(a!) out", _paged_attention),
    "add_rmsnorm": ("Tensor(a!) x, Tensor? y, Tensor weight, Tensor(b!) h, float eps", _add_rmsnorm),
    "rope_kv": ("Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor kv_index, Tensor(a!) k_cache, "
                "Tensor(b!) v_cache, Tensor(c!) q, int kv_heads", _rope_kv),
    "attention": ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_of_token, "
                  "Tensor positions, Tensor(a!) out, int kv_heads", _attention),
    "silu_mul": ("Tensor gate_up, Tensor(a!) out", _silu_mul),
    "pack_linear": ("Tensor w, Tensor(a!) packed", _pack_linear),
    "wlinear": ("int fmt, Tensor x, Tensor data, Tensor? scale, Tensor? offset, int group, int n, Tensor? bias, "
                "Tensor(a!) y", _wlinear),
    "wgather": ("int fmt, Tensor data, Tensor? scale, Tensor? offset, int group, Tensor ids, Tensor(a!) out", _wgather),
}
_LIVE: weakref.WeakValueDictionary[int, CpuKernels] = weakref.WeakValueDictionary()  # by handle
_handles = itertools.count()
_LIBRARY = torch.library.Library("tandem", "DEF")


def _register(name: str, schema: str, kernel) -> None:
    _LIBRARY.define(f"{name}(int kernels, {schema}) -> ()")
    _LIBRARY.impl(name, lambda handle, *args: kernel(_LIVE[handle], *args), "CPU")
    torch.library.register_fake(f"tandem::{name}", lambda *args: None, lib=_LIBRARY)  # writes only what it is given


for _name, (_schema, _kernel) in _OPS.items():
    _register(_name, _schema, _kernel)


BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)  # not ValueError: a wrong cap is an error


def builds() -> bool:
    """Whether the kernels build here at the level :func:`choose_level` picks (a C compiler that takes
    the level's flags); the library stays in the cache, where :func:`load` finds it."""
    try:
        build(choose_level()[0])
    except BUILD_ERRORS:
        return False
    return True


def load(cache_dir: Path | None = None, level: str | None = None) -> CpuKernels | None:
    """The kernels for this CPU at the level :func:`choose_level` picks (``level``: a cap, else
    ``$TANDEM_CPU_LEVEL``), or None (logged) where they cannot be built. A cap above what the CPU
    runs raises ValueError."""
    try:
        chosen, why = choose_level(level)
        kernels = CpuKernels(build(chosen, cache_dir), chosen.name)
    except BUILD_ERRORS as e:
        log.warning("fused CPU kernels unavailable, using the eager forward: %s", e)
        return None
    log.info("cpu kernels: level %s (%s)", chosen.name, why)
    return kernels

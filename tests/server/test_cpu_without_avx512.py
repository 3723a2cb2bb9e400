"""A CPU without AVX-512 (AMD Zen 2/3, Intel before Skylake-SP): the worker starts and serves bf16.

No such CPU is at hand in CI, so the worker runs under QEMU's user-mode emulation of one
(``qemu-x86_64 -cpu Haswell-v4``: AVX2, FMA and F16C, no AVX-512, no TSX). torch and oneDNN
read its cpuid as they would a real one's, and oneDNN refuses bf16 there: the start-up crash of
bf16 on such a CPU (``mkldnn_reorder_linear_weight: bf16 path needs ...``). QEMU shows the
host's /proc/cpuinfo, from which the CPU kernels choose their level, so the level is capped at avx2,
the one such a CPU's /proc/cpuinfo gives (that choice: tests/kernels/test_cpu_kernels.py).
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
from prerequisites import unavailable

from frontend.server.service import Service, ServiceConfig
from gpu_worker import cpu_kernels
from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [7] * 11, list(range(20, 60, 3))]
PROBE = """
import torch
try:
    torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=torch.bfloat16), 64)
    refused = ""
except RuntimeError as e:
    refused = str(e)
print(torch.backends.cpu.get_cpu_capability(), refused, sep="|")
"""


@pytest.fixture(scope="module")
def emulated_python(tmp_path_factory):
    """A ``python`` that runs this interpreter on QEMU's CPU without AVX-512."""
    if platform.machine() != "x86_64":
        pytest.skip("QEMU's CPU here is an x86-64 one")
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        unavailable("no qemu-x86_64 (apt-get install qemu-user) to run the worker on a CPU without AVX-512")
    path = tmp_path_factory.mktemp("qemu") / "python"
    path.write_text(f'#!/bin/sh\nexec {qemu} -cpu Haswell-v4 {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def greedy_tokens(max_tokens: int = 12) -> tuple[list[list[int]], str]:
    """Each prompt's greedy tokens from a bf16 service, and the executable its worker ran."""
    svc = Service(ServiceConfig(model="tiny-random", device="cpu", dtype="bfloat16", max_batch=8, kv_pages=64,
                                page_size=8))
    try:
        reqs = [svc.submit(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        svc.run_until(lambda: all(r.ended for r in reqs), 300)
        assert all(r.error is None for r in reqs), [r.error for r in reqs]
        return [list(r.token_ids) for r in reqs], os.readlink(f"/proc/{svc.worker_pid}/exe")
    finally:
        svc.close()


def test_bf16_serves_on_a_cpu_without_avx512_as_on_this_one_at_avx2(emulated_python, monkeypatch):
    # The emulated CPU is one where oneDNN's bf16 prepack raises (non-vacuity: the crash's condition).
    probe = subprocess.run([emulated_python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    capability, refused = probe.stdout.strip().split("|")
    assert capability == "AVX2" and "bf16 path needs the cpu support" in refused, probe
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "avx2")
    native, native_exe = greedy_tokens()
    monkeypatch.setattr(sys, "executable", emulated_python)  # the worker's interpreter (worker_handle.py)
    emulated, emulated_exe = greedy_tokens()
    assert os.path.basename(emulated_exe) == "qemu-x86_64" and os.path.basename(native_exe) != "qemu-x86_64"
    assert emulated == native and all(len(t) == 12 for t in native), (emulated, native)

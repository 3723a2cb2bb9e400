"""Token-ring latency and throughput across two processes.

    python -m bench.ring_latency [--quick]

The parent plays the frontend (creates the arena, reads); a child spawned with
``pass_fds`` plays the worker (attaches by fd, publishes). The writer stamps
``time.monotonic_ns()`` (system-wide clock) into each entry's step, so the
reader's ``now - step`` is the publish -> reader-sees latency, including the
publish call itself.

* busy-poll: the reader spins on ``poll()``; an entry every ~200 us.
* eventfd:   entries every 5 ms, so the reader's spin window has expired and
             it is asleep on the tokens eventfd when the entry lands.
* throughput: 32-row entries published back to back; the reader consumes each.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

from shared.shm import Arena, Kind, Layout

ROWS = 32


def child(spec: str, mode: str, count: int, interval_s: float) -> None:
    arena = Arena.attach_spec(spec)
    w = arena.token_writer()
    seq = np.arange(ROWS, dtype=np.uint32)
    tok = np.arange(ROWS, dtype=np.int32)
    flags = np.zeros(ROWS, np.uint32)
    rows = ROWS if mode == "throughput" else 1
    time.sleep(0.2)  # let the reader settle into its loop
    next_t = time.perf_counter()
    cost = np.empty(count, np.int64)
    for i in range(count):
        if interval_s:
            next_t += interval_s
            while (d := next_t - time.perf_counter()) > 0:
                time.sleep(d if d > 2e-4 else 0)
        t = time.monotonic_ns()
        w.publish(t, Kind.DECODE, seq[:rows], tok[:rows], flags[:rows], timeout=30)
        cost[i] = time.monotonic_ns() - t
    us = cost / 1e3
    print(f"    writer: publish call p50 {np.percentile(us, 50):.1f} us p99 {np.percentile(us, 99):.1f} us;"
          f" blocked {w.blocked}x, slept {w.sleeps}x", file=sys.stderr)


def run(arena: Arena, mode: str, count: int, interval_s: float, use_wait: bool):
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.ring_latency", "--child", arena.fd_spec(), mode,
         str(count), str(interval_s)], pass_fds=arena.pass_fds)
    r = arena.token_reader()
    lat = np.empty(count, np.int64)
    t0 = t1 = 0.0
    for i in range(count):
        while True:
            if use_wait:
                r.wait(timeout=10)
            e = r.poll()
            if e is not None:
                break
        now = time.monotonic_ns()
        lat[i] = now - e.step
        if i == 0:
            t0 = time.perf_counter()
        t1 = time.perf_counter()
        r.consume(e.seq)
    proc.wait(timeout=60)
    return lat / 1e3, t1 - t0, r.sleeps


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    k = 4 if args.quick else 1
    layout = Layout(vocab_size=32000, ring_entries=64, max_rows=256, max_batch_rows=64)

    def pct(us):
        return f"p50 {np.percentile(us, 50):7.1f} us   p99 {np.percentile(us, 99):7.1f} us"

    with Arena.create(layout) as arena:
        us, _, _ = run(arena, "latency", 4000 // k, 200e-6, use_wait=False)
        print(f"busy-poll  latency: {pct(us[10:])}  (n={len(us) - 10})")
    with Arena.create(layout) as arena:
        us, _, sleeps = run(arena, "latency", 400 // k, 5e-3, use_wait=True)
        print(f"eventfd    latency: {pct(us[2:])}  (n={len(us) - 2}, reader slept {sleeps}x)")
    with Arena.create(layout) as arena:
        n = 20000 // k
        us, dt, _ = run(arena, "throughput", n, 0.0, use_wait=False)
        print(f"throughput: {n} entries x {ROWS} rows in {dt:.3f} s = "
              f"{(n - 1) / dt:,.0f} entries/s = {(n - 1) * ROWS / dt:,.0f} tokens/s")


if __name__ == "__main__":
    main()

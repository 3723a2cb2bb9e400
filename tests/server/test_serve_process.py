"""``tandem serve`` as a subprocess under a fake systemd ``NOTIFY_SOCKET``: readiness, the watchdog,
worker restarts, the SIGTERM drain (on the simulated device, so what finishes within the drain does not
depend on the CPU)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from live_server import LONG, TERMINAL, LiveServer, Raw, check_request
from processes import ROOT, free_port

from shared.finish import FinishReason

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- `tandem serve` under systemd



class ServeProcess:
    """``tandem serve`` in a subprocess with a fake systemd notify socket."""

    def __init__(self, tmp_path: Path, bind: str, *extra: str, abstract: bool = False, device: str = "cpu") -> None:
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"tandem-test-{os.getpid()}-{time.monotonic_ns()}"
            self.notify.bind("\0" + name)
            addr = "@" + name
        else:
            addr = str(tmp_path / "notify.sock")
            self.notify.bind(addr)
        self.notify.settimeout(0.1)
        self.notes: list[tuple[float, str]] = []  # (monotonic time, datagram)
        self.stderr: list[str] = []
        self.worker_pid: int | None = None
        self.bind = bind
        env = dict(os.environ, NOTIFY_SOCKET=addr, WATCHDOG_USEC="200000", PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontend.cli.main", "serve", "--model", "tiny-random", "--device", device,
             "--bind", bind, "--http", f"127.0.0.1:{free_port()}", "--exit-on-worker-failure", *extra],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._done = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._read_notify, daemon=True).start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            m = re.search(r"worker pid (\d+)", line)
            if m:
                self.worker_pid = int(m.group(1))

    def _read_notify(self) -> None:
        while not self._done.is_set():
            try:
                data = self.notify.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.notes.append((time.monotonic(), data.decode()))

    def states(self) -> list[str]:
        return [s for _, s in self.notes]

    def wait_note(self, prefix: str, timeout: float) -> int:
        """Index of the first notification starting with prefix."""
        deadline = time.monotonic() + timeout
        while True:
            for i, s in enumerate(self.states()):
                if s.startswith(prefix):
                    return i
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}): {''.join(self.stderr)[-2000:]}"
            assert time.monotonic() < deadline, f"no {prefix} in {self.states()}"
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            time.sleep(0.1)  # the last datagrams
            self._done.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._done.set()
        self.notify.close()
        if self.worker_pid and _alive(self.worker_pid):
            os.kill(self.worker_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True if pid is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gpu_workers_of(pid: int) -> list[int]:
    """Processes running gpu_worker whose parent is pid."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"gpu_worker" in cmd:
            out.append(int(d.name))
    return out


def test_closed_connection_cancels_its_requests_even_without_streaming(live, ctx):
    """A client that closes its socket gets its requests cancelled at once, stream: false
    included (nothing is ever sent to it, so no failed send can tell). A client connecting
    right after, likely on the reused fd, is not affected."""
    gone = Raw(ctx, live.endpoint)
    for rid in ("quiet", "quiet2"):  # no chunk is ever sent to this client
        gone.generate(rid, max_tokens=LONG, ignore_eos=True, stream=False)
    gone.ping()

    def running():
        reqs = {rid: r for (_ident, rid), r in live.server.live.items() if rid in ("quiet", "quiet2")}
        return reqs if len(reqs) == 2 and all(r.token_ids for r in reqs.values()) else None

    deadline = time.monotonic() + 30
    while not (reqs := live.on_server_thread(running)):
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    gone.close()
    fresh = Raw(ctx, live.endpoint)
    try:
        fresh.generate("after", max_tokens=6, ignore_eos=True, stream=False)
        done = check_request(fresh.request("after", timeout_s=30), stream=False)
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        deadline = time.monotonic() + 10
        while not live.on_server_thread(lambda: all(r.ended for r in reqs.values())):
            assert time.monotonic() < deadline, "the closed client's requests are still running"
            time.sleep(0.02)
        for r in reqs.values():
            assert r.finish_reason == FinishReason.CANCELLED and len(r.token_ids) < LONG, (r.finish_reason, len(r.token_ids))
        live.assert_no_leak()
    finally:
        fresh.close()


def test_second_stop_ends_the_drain_at_once(ctx):
    """While draining the server answers pings and refuses new requests; a second stop
    request ends the drain at once, and the request still in flight gets its error."""
    srv = LiveServer(drain_timeout_s=600)
    c = Raw(ctx, srv.endpoint)
    try:
        c.generate("long", max_tokens=LONG, ignore_eos=True)
        c.wait_for(lambda: len(c.by_id["long"]) >= 1, what="a chunk")
        srv.server.stop()
        c.ping()
        assert srv.server.draining and srv.thread.is_alive()
        c.generate("new", max_tokens=2)
        assert check_request(c.request("new"))["code"] == "overloaded"
        srv.server.stop()  # the second one: no more waiting
        srv.thread.join(30)
        assert not srv.thread.is_alive()
        term = check_request(c.request("long", timeout_s=10))
        assert term["type"] == "error" and "shutting down" in term["message"]
    finally:
        c.close()
        if srv.thread.is_alive():
            srv.close()


def test_worker_restart_keeps_the_server_answering(ctx):
    """kill -9 of the worker: its requests fail with worker_failed, and while the next
    worker generation loads the server still answers pings and info, and queues new
    requests, which are served once it is ready."""
    srv = LiveServer()  # its own server: this test kills the worker
    c = Raw(ctx, srv.endpoint)
    try:
        c.generate("inflight", max_tokens=LONG, ignore_eos=True)
        c.wait_for(lambda: len(c.by_id["inflight"]) >= 1, what="a chunk")
        os.kill(srv.svc.worker_pid, signal.SIGKILL)
        err = check_request(c.request("inflight", timeout_s=10))
        assert err["type"] == "error" and err["code"] == "worker_failed", err
        c.ping()  # a fresh interpreter importing torch takes seconds: the new worker is still loading
        c.send({"type": "info"})
        info = c.reply()
        assert info["generation"] == 2 and info["worker_ready"] is False and "kv_pages_free" not in info, info
        c.generate("queued", max_tokens=5, ignore_eos=True)
        done = check_request(c.request("queued", timeout_s=120))
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        c.send({"type": "info"})
        info = c.reply()
        assert info["generation"] == 2 and info["worker_ready"] is True and "kv_pages_free" in info, info
        srv.assert_no_leak()
        c.assert_quiet(0.1)
    finally:
        c.close()
        srv.close()


def test_serve_ready_after_warmup_watchdog_and_worker_kill(tmp_path, ctx):
    srv = ServeProcess(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    try:
        ready = srv.wait_note("READY=1", 180)
        assert ready == 0, f"something before READY: {srv.states()[:ready]}"  # no WATCHDOG before READY
        assert "STATUS=serving on tcp://127.0.0.1:" in srv.states()[0]
        assert re.search(r"tandem: worker: loading \S*tiny-random\S* on cpu\n", "".join(srv.stderr))  # start-up progress
        # READY means warmed up: the worker exists and a request is served at once.
        deadline = time.monotonic() + 10
        while srv.worker_pid is None:
            assert time.monotonic() < deadline, srv.stderr
            time.sleep(0.02)
        assert _alive(srv.worker_pid) and srv.worker_pid in _gpu_workers_of(srv.proc.pid)
        c = Raw(ctx, srv.bind)  # closed by the ctx fixture if the test fails
        c.generate("first", max_tokens=4)
        assert check_request(c.request("first", timeout_s=30))["type"] == "done"
        # WATCHDOG=1 repeatedly while healthy (every WATCHDOG_USEC/2 = 0.1 s).
        t0 = time.monotonic()
        time.sleep(1.2)
        n_healthy = sum(1 for t, s in srv.notes if s == "WATCHDOG=1" and t >= t0)
        assert n_healthy >= 3, srv.states()
        # kill -9 the worker while a request streams.
        c.generate("inflight", max_tokens=LONG, ignore_eos=True)
        c.wait_for(lambda: len(c.by_id["inflight"]) >= 1, what="a chunk")
        n_before = len(srv.notes)
        os.kill(srv.worker_pid, signal.SIGKILL)
        rc = srv.wait_exit(60)
        assert rc != 0, "the server must exit non-zero when the worker dies (--exit-on-worker-failure)"
        after = srv.states()[n_before:]
        # At most one WATCHDOG=1 can race the kill (sent in the same loop iteration); none after STOPPING.
        assert after.count("WATCHDOG=1") <= 1, after
        if "STOPPING=1" in after:
            assert "WATCHDOG=1" not in after[after.index("STOPPING=1"):]
        err = check_request(c.request("inflight", timeout_s=10))
        assert err["type"] == "error" and err["code"] == "worker_failed", err
        c.assert_quiet(0.2)  # one terminal message only
        stderr = "".join(srv.stderr)  # the failure, then one line for the operator (no class name, no traceback)
        assert "worker generation 1 failed" in stderr and re.search(r"^Error: \S", stderr, re.M), stderr
        assert "Traceback" not in stderr and "WorkerDown" not in stderr, stderr
        assert not _alive(srv.worker_pid)
        c.close()
    finally:
        srv.close()


# The SIGTERM drain runs on the simulated device: a decode step takes at least SIM_STEP_MS, so
# LONG tokens (38 s) cannot finish within the drain on any CPU, and SHORT tokens (2 s of device
# time) do on any CPU whose real work for a step of three rows fits in DRAIN_S / SHORT (60 ms).
SIM_STEP_MS, DRAIN_S, SHORT = 20, 6, 100


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory, ctx) -> dict:
    """SIGTERM to a healthy ``tandem serve`` (drain DRAIN_S) with three requests in flight: two
    too long to finish in the drain, one short; and a request sent while draining."""
    tmp = tmp_path_factory.mktemp("sigterm")
    srv = ServeProcess(tmp, f"ipc://{tmp}/api.sock", "--max-queue", "3", "--drain-timeout", str(DRAIN_S),
                       abstract=True, device=f"sim:{SIM_STEP_MS}")
    c = Raw(ctx, srv.bind)
    try:
        srv.wait_note("READY=1", 180)
        c.generate("a", max_tokens=LONG, ignore_eos=True)
        c.generate("b", max_tokens=LONG, ignore_eos=True, stream=False)
        c.wait_for(lambda: len(c.by_id["a"]) >= 2, what="chunks")
        c.generate("short", max_tokens=SHORT, ignore_eos=True)
        c.generate("c", max_tokens=2)  # --max-queue 3 is wired through
        overloaded = check_request(c.request("c"))
        c.wait_for(lambda: len(c.by_id["short"]) >= 1, what="a chunk of the short request")
        worker = srv.worker_pid
        assert worker and _alive(worker)
        n_before = len(srv.notes)
        srv.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        short_chunks_at_term = len(c.by_id["short"])
        srv.wait_note("STOPPING=1", 10)
        c.generate("late", max_tokens=2)  # while draining
        late = check_request(c.request("late"))
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            c.pump(0.05)  # keep reading: a client that stops reading is cut off at its queue limit
        rc = srv.wait_exit(10)
        stopped_after_s = time.monotonic() - t_term
        c.pump(0.5)
        return {"rc": rc, "after": srv.states()[n_before:], "stderr": "".join(srv.stderr), "worker": worker,
                "server_pid": srv.proc.pid, "overloaded": overloaded, "late": late,
                "short_chunks_at_term": short_chunks_at_term, "stopped_after_s": stopped_after_s,
                "messages": {rid: c.by_id.pop(rid, []) for rid in ("a", "b", "short")}, "other": list(c.other),
                "rest": dict(c.by_id)}
    finally:
        c.close()
        srv.close()


def test_serve_sigterm_stops_cleanly(sigterm_run):
    r = sigterm_run
    assert r["overloaded"]["type"] == "error" and r["overloaded"]["code"] == "overloaded"
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert "STOPPING=1" in r["after"], r["after"]
    assert "WATCHDOG=1" not in r["after"][r["after"].index("STOPPING=1"):]
    # In-flight requests got a terminal message, after their chunks in order.
    for rid, stream in (("a", True), ("b", False), ("short", True)):
        msgs = r["messages"][rid]
        first_terminal = next(i for i, m in enumerate(msgs) if m["type"] in TERMINAL)
        term = check_request(msgs[:first_terminal + 1], stream=stream)
        assert term["type"] in TERMINAL
    assert not r["other"] and not any(r["rest"].values()), (r["other"], r["rest"])
    assert "tandem: stopped" in r["stderr"]
    assert not _alive(r["worker"]), "the gpu_worker outlived the server"
    assert _gpu_workers_of(r["server_pid"]) == []


def test_serve_sigterm_drains_in_flight_requests(sigterm_run):
    """The short request, in flight at SIGTERM, finished normally during the drain; the long
    ones were cut at the drain deadline; a request sent while draining got overloaded."""
    r = sigterm_run
    short = check_request(r["messages"]["short"])
    assert r["short_chunks_at_term"] < SHORT and short["type"] == "done" and short["finish_reason"] == "length"
    assert len(short["token_ids"]) == SHORT
    for rid in ("a", "b"):
        term = check_request(r["messages"][rid], stream=rid == "a")
        assert term["type"] == "error" and "shutting down" in term["message"], term
    assert r["late"]["type"] == "error" and r["late"]["code"] == "overloaded", r["late"]
    assert "shutting down" in r["late"]["message"]
    assert DRAIN_S - 0.5 < r["stopped_after_s"] < DRAIN_S + 25  # waited for the drain deadline, not for LONG tokens


def test_serve_sigterm_sends_exactly_one_terminal_per_request(sigterm_run):
    for rid in ("a", "b", "short"):
        terminals = [m for m in sigterm_run["messages"][rid] if m["type"] in TERMINAL]
        assert len(terminals) == 1, terminals

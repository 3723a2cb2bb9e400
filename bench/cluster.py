"""Cluster benchmark: what the Ray Serve hop costs, and what session affinity buys the prefix cache.

    python -m bench.cluster --model tiny-random --device cpu            (or: tandem bench cluster ...)

Both parts start their servers here (``tandem serve`` / ``tandem cluster`` as
child processes, HTTP on loopback, every process with the same
``OMP_NUM_THREADS``) and stop them at the end.

1. **The hop.** One ``tandem serve`` and one ``tandem cluster --replicas 1``
   with the same options run side by side; for each level (``--streams``,
   default 1 and 16) ``bench.serve``'s HTTP client (streamed chat
   completions, ``ignore_eos``) loads the direct server, then the cluster,
   with the same requests, ``--repeats`` times alternately: the medians of
   TTFT p50 and output tokens/s of each, and the cluster's over the direct
   server's; and where the cluster's CPU went during its runs (per second and
   per output token, by process role: Serve's HTTP proxy (none since the
   ingress serves the address itself), the ingress, the replica's actor, its
   ``tandem serve``, the worker). ``--variant
   NAME:VAR=VALUE,...`` measures another cluster too, with those environment
   variables (Ray's Serve settings, e.g. Ray's defaults in place of
   ``frontend.cluster.HOP_ENV``), after the first and beside the same direct
   server: a before/after within one run.
   ``--part latency``: where one request's time goes on the way, from the
   medians of ``--latency-requests`` sequential requests to each server,
   alternated: ``GET /v1/models`` (the ingress answers it alone: ``tandem
   cluster`` has it serve HTTP itself), ``GET /metrics`` (the ingress asks a replica: one handle
   call, the replica's actor, its ``tandem serve``'s ``info``) and a
   one-token chat completion (the whole path); the cluster's extra for each.
2. **Affinity.** ``tandem cluster --replicas 2`` with the affinity router,
   then with Serve's default router (``--router ray``): ``--sessions``
   sessions of ``--turns`` turns (each session its own system prompt and
   ``X-Session-Id``; turn t of every session at once, then turn t+1, each
   turn carrying the conversation so far). The prefix cache hit rate is the
   replicas' ``prefix_cache.hit_tokens`` over ``query_tokens`` for the
   workload (from each replica's ``info``, read over its ``ipc://`` endpoint).

``LocalCluster`` (a ``tandem cluster`` child process, its replicas found by
``ps``) is also what ``tests/cluster/test_cluster.py`` drives.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from .serve import make_work, run_level

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CLI = [sys.executable, "-m", "frontend.cli.main"]
CPU_ROLES = {"proxy": "ProxyActor", "ingress": "TandemIngress", "replica actor": "TandemReplica",
             "tandem serve": "--http none", "worker": "gpu_worker.worker"}  # role: what its command line has


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(what: str, ready, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit code {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


class LocalCluster:
    """``tandem cluster`` as a child process (its own session: a kill of the group takes everything)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*CLI, "cluster", "--http", f"127.0.0.1:{self.port}", *args], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.seen: set[int] = set()  # every descendant pid ever seen (what must be gone after a stop)
        self.replica_dirs: dict[str, Path] = {}  # every replica's private directory seen, by its name (likewise)

    def wait_ready(self, replicas: int, timeout: float = 300) -> "LocalCluster":
        _wait_for("tandem cluster", lambda: "tandem: serving on" in self.log.read_text(), self.proc, self.log,
                  timeout)
        self.wait_replicas(replicas, timeout=timeout)
        return self

    def cpu_seconds_by_role(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of each process role of the cluster (``CPU_ROLES``)."""
        import psutil

        out = dict.fromkeys(CPU_ROLES, 0.0)
        for p in self.processes():
            try:
                cmd, times = " ".join(p.cmdline()), p.cpu_times()
            except psutil.Error:
                continue
            role = next((role for role, tag in CPU_ROLES.items() if tag in cmd), None)
            if role is not None:
                out[role] += times.user + times.system
        return out

    def processes(self) -> list:
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen |= {p.pid for p in procs}
        return procs

    def replicas(self) -> dict:
        """Replica name -> its ``tandem serve`` process (the name is in the ``ipc://`` path it serves)."""
        import psutil

        out = {}
        for p in self.processes():
            try:
                cmd = p.cmdline()
                if "serve" in cmd and "--bind" in cmd and p.status() != psutil.STATUS_ZOMBIE:
                    home = Path(cmd[cmd.index("--bind") + 1][len("ipc://"):]).parent
                    name = home.name.split("-")[1]
                    self.replica_dirs[name] = home
                    out[name] = p
            except psutil.Error:
                continue
        return out

    def endpoint(self, name: str) -> str:
        cmd = self.replicas()[name].cmdline()
        return cmd[cmd.index("--bind") + 1]

    def info(self, name: str) -> dict:
        from frontend.client import Client

        with Client(self.endpoint(name)) as c:
            return c.info(timeout=10)

    def wait_replicas(self, count: int, exclude: frozenset | set = frozenset(), timeout: float = 120) -> dict:
        """The ``count`` replicas (not named in ``exclude``) once each one's worker is ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reps = {n: p for n, p in self.replicas().items() if n not in exclude}
            if len(reps) == count and all(self._ready(n) for n in reps):
                return reps
            time.sleep(0.5)
        raise AssertionError(f"not {count} ready replicas (besides {sorted(exclude)}) after {timeout} s: "
                             f"{sorted(self.replicas())}\n{self.log.read_text()[-3000:]}")

    def _ready(self, name: str) -> bool:
        try:
            return bool(self.info(name).get("worker_ready"))
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class DirectServer:
    """``tandem serve`` with HTTP, as a child process."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self._dir = tempfile.mkdtemp(prefix="tandem-bench-")
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*CLI, "serve", "--http", self.url[len("http://"):], "--bind",
                                          f"ipc://{self._dir}/serve.sock", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env)
        _wait_for("tandem serve", self._healthy, self.proc, log, 300)

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        shutil.rmtree(self._dir, ignore_errors=True)


# --------------------------------------------------------------------------- the two parts


def hop(serve_args: list[str], streams: list[int], requests: int, max_tokens: int, repeats: int, workdir: Path,
        env: dict, variants: dict[str, dict[str, str]]) -> list:
    """One row per (cluster variant, streams): ``variants`` maps a name to the environment it adds
    to the cluster's (Ray reads its Serve settings from it); each variant's cluster runs beside the
    one direct server, alone (started, measured, stopped in turn)."""
    direct = DirectServer(serve_args, workdir / "serve.log", env)
    try:
        model = json.loads(_get(f"{direct.url}/v1/models"))["data"][0]["id"]
        rows = []
        for variant, extra in variants.items():
            cluster = LocalCluster(["--replicas", "1", *serve_args], workdir / f"cluster-{len(rows)}.log",
                                   {**env, **extra})
            try:
                cluster.wait_ready(1)
                rows += [{"variant": variant, "env": extra, **row} for row in
                         _hop_levels(direct, cluster, model, streams, requests, max_tokens, repeats)]
            finally:
                cluster.stop()
        return rows
    finally:
        direct.stop()


def _hop_levels(direct: DirectServer, cluster: LocalCluster, model: str, streams: list[int], requests: int,
                max_tokens: int, repeats: int) -> list:
    for target in (direct, cluster):  # warm both paths (connections, the ingress's first tokenization)
        asyncio.run(run_level("", 2, make_work(4, (16, 16), (4, 4), 1), True, True, 120, http=(target.url, model)))
    rows = []
    for n in streams:
        work = make_work(max(requests, n * 2), (32, 32), (max_tokens, max_tokens), 7)
        runs: dict[str, list] = {"serve": [], "cluster": []}
        cpu: list[dict[str, float]] = []  # per run: CPU seconds of each role
        walls, tokens = [], []
        for _ in range(repeats):  # alternated, so a change in the machine's load hits both alike
            for name, target in (("serve", direct), ("cluster", cluster)):
                before = cluster.cpu_seconds_by_role()
                level = asyncio.run(run_level("", n, work, True, True, 300, http=(target.url, model)))
                assert level["errors"] == 0, level["error_samples"]
                runs[name].append(level)
                if target is cluster:
                    after = cluster.cpu_seconds_by_role()
                    cpu.append({role: after[role] - before[role] for role in after})
                    walls.append(level["wall_s"])
                    tokens.append(level["output_tokens"])
        row = {"streams": n}
        for name, levels in runs.items():
            row[name] = {"ttft_p50_ms": statistics.median(lv["ttft_ms"]["p50"] for lv in levels),
                         "tokens_per_s": statistics.median(lv["output_tokens_per_s"] for lv in levels)}
        row["tokens_per_s_ratio"] = round(row["cluster"]["tokens_per_s"] / row["serve"]["tokens_per_s"], 3)
        row["ttft_p50_extra_ms"] = round(row["cluster"]["ttft_p50_ms"] - row["serve"]["ttft_p50_ms"], 2)
        # where the cluster's CPU went: per second of its runs, and per output token (the figure the machine's
        # load moves least: a starved process is slower, not busier)
        row["cluster_cpu_per_wall_s"] = {role: round(statistics.median(c[role] / w for c, w in zip(cpu, walls)), 2)
                                         for role in CPU_ROLES}
        row["cluster_cpu_ms_per_token"] = {role: round(statistics.median(1e3 * c[role] / t for c, t in
                                                                         zip(cpu, tokens)), 3) for role in CPU_ROLES}
        rows.append(row)
    return rows


LATENCY_CASES = {  # what each request crosses in the cluster (module docstring)
    "GET /v1/models": ("GET", "/v1/models", None),
    "GET /metrics": ("GET", "/metrics", None),
    "chat, 1 token": ("POST", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "time river stone light " * 8}], "max_tokens": 1}),
}


def latency(serve_args: list[str], requests: int, rounds: int, workdir: Path, env: dict,
            variants: dict[str, dict[str, str]]) -> list:
    """One row per (cluster variant, case), as ``hop``'s."""
    direct = DirectServer(serve_args, workdir / "serve.log", env)
    try:
        rows = []
        for variant, extra in variants.items():
            cluster = LocalCluster(["--replicas", "1", *serve_args], workdir / f"cluster-latency-{len(rows)}.log",
                                   {**env, **extra})
            try:
                cluster.wait_ready(1)
                rows += [{"variant": variant, "env": extra, **row}
                         for row in _latency_cases(direct.url, cluster.url, requests, rounds)]
            finally:
                cluster.stop()
        return rows
    finally:
        direct.stop()


def _latency_cases(direct_url: str, cluster_url: str, requests: int, rounds: int) -> list:
    import httpx

    ms: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):  # alternated, so a change in the machine's load hits both alike
        for name, url in (("serve", direct_url), ("cluster", cluster_url)):
            with httpx.Client(base_url=url, timeout=60) as client:
                for case, (method, path, body) in LATENCY_CASES.items():
                    client.request(method, path, json=body).raise_for_status()  # warm
                    for _ in range(requests):
                        start = time.perf_counter()
                        client.request(method, path, json=body).raise_for_status()
                        ms.setdefault((case, name), []).append(1e3 * (time.perf_counter() - start))
    rows = []
    for case in LATENCY_CASES:
        serve_ms, cluster_ms = (statistics.median(ms[(case, n)]) for n in ("serve", "cluster"))
        rows.append({"case": case, "serve_ms": round(serve_ms, 2), "cluster_ms": round(cluster_ms, 2),
                     "extra_ms": round(cluster_ms - serve_ms, 2)})
    return rows


def affinity(serve_args: list[str], sessions: int, turns: int, workdir: Path, env: dict) -> dict:
    out = {}
    for router in ("affinity", "ray"):
        cluster = LocalCluster(["--replicas", "2", "--router", router, *serve_args], workdir / f"cluster-{router}.log",
                               env)
        try:
            names = sorted(cluster.wait_ready(2).replicas())
            before = {n: cluster.info(n)["prefix_cache"] for n in names}
            served = asyncio.run(_conversations(cluster.url, sessions, turns))
            after = {n: cluster.info(n)["prefix_cache"] for n in names}
        finally:
            cluster.stop()
        hit = sum(after[n]["hit_tokens"] - before[n]["hit_tokens"] for n in names)
        query = sum(after[n]["query_tokens"] - before[n]["query_tokens"] for n in names)
        out[router] = {"hit_rate": round(hit / query, 3) if query else None, "hit_tokens": hit, "query_tokens": query,
                       "sessions_on_one_replica": sum(len(set(s)) == 1 for s in served.values()),
                       "requests_per_replica": {n: sum(r.count(n) for r in served.values()) for n in names}}
    return out


async def _conversations(url: str, sessions: int, turns: int) -> dict[str, list[str]]:
    """``sessions`` chats of ``turns`` turns; the replicas (``x-tandem-replica``) each turn went to."""
    import httpx

    chats = {f"session-{i}": [{"role": "system", "content": f"You are assistant number {i}. " * 8}]
             for i in range(sessions)}
    served: dict[str, list[str]] = {s: [] for s in chats}

    async def turn(client, session: str, t: int) -> None:
        messages = chats[session]
        messages.append({"role": "user", "content": f"Turn {t}: tell me about rivers and stones, part {t}."})
        r = await client.post("/v1/chat/completions", headers={"X-Session-Id": session}, timeout=120,
                              json={"messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        served[session].append(r.headers.get("x-tandem-replica"))

    async with httpx.AsyncClient(base_url=url) as client:
        for t in range(turns):
            await asyncio.gather(*(turn(client, s, t) for s in chats))
    return served


def _variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition(":")
    pairs = [a.partition("=") for a in assignments.split(",") if a]
    if not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise click.BadParameter(f"{text!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]", param_hint="--variant")
    return name, {k: v for k, _, v in pairs}


def _get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=30).text


@click.command("cluster")
@click.option("--model", default="tiny-random", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--streams", default="1,16", show_default=True, help="Concurrency levels of the hop's cost.")
@click.option("--requests", default=32, show_default=True, help="Requests per level (at least 2 per stream).")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True,
              help="Runs of each level per server (the hop), or rounds (latency); medians reported.")
@click.option("--sessions", default=8, show_default=True)
@click.option("--turns", default=4, show_default=True)
@click.option("--threads", default=1, show_default=True, help="OMP_NUM_THREADS of every process (the same for all).")
@click.option("--latency-requests", default=15, show_default=True,
              help="--part latency: sequential requests per case, server and round (medians reported).")
@click.option("--part", type=click.Choice(["both", "hop", "latency", "affinity"]), default="both", show_default=True,
              help="both: hop and affinity.")
@click.option("--variant", "variants", multiple=True, metavar="NAME:VAR=VALUE,...",
              help="The hop and latency: also a cluster with these environment variables (Ray's Serve settings), e.g. "
                   "serve-defaults:RAY_SERVE_USE_GRPC_BY_DEFAULT=0; repeatable. The cluster as configured is "
                   "measured first.")
@click.option("--json", "as_json", is_flag=True)
def cluster_command(model, device, streams, requests, max_tokens, repeats, sessions, turns, threads, latency_requests,
                    part, variants, as_json):
    """The Ray hop's cost (tandem cluster --replicas 1 against tandem serve) and the prefix cache hit rate of
    multi-turn sessions with the affinity router against Serve's default over 2 replicas.

    \b
    Example:
      tandem bench cluster --model tiny-random --device cpu --streams 1,16
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    serve_args = ["--model", model, "--device", device, "--max-batch", "32", "--drain-timeout", "2"]
    result = {"model": model, "device": device, "threads": threads, "load_before": os.getloadavg(),
              "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    variants = {"as configured": {}, **dict(map(_variant, variants))}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-cluster-") as tmp:
        if part in ("both", "hop"):
            result["hop"] = hop(serve_args, [int(s) for s in streams.split(",")], requests, max_tokens, repeats,
                                Path(tmp), env, variants)
        if part == "latency":
            result["latency"] = latency(serve_args, latency_requests, repeats, Path(tmp), env, variants)
        if part in ("both", "affinity"):
            result["affinity"] = affinity(serve_args, sessions, turns, Path(tmp), env)
    result["load_after"] = os.getloadavg()
    click.echo(json.dumps(result, indent=None if as_json else 2))
    return result


if __name__ == "__main__":
    cluster_command()

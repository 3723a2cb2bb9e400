"""``tandem cluster`` on Ray Serve: the routing function (pure), the option mapping, the manifests,
then one real cluster for the module (``tandem cluster --replicas 2``, tiny-random on CPU, loopback):
streaming through the ingress, session affinity with prefix-cache hits in the owner's counters,
sessionless spread, a replica's ``tandem serve`` killed mid-stream, a worker that never gets ready,
a replica's actor killed mid-stream, and SIGTERM leaving nothing running."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from bench.cluster import LocalCluster
from frontend.cluster.routing import NOT_STARTED, OVERFLOW_SLACK, Load, choose, owner, session_key, usable

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"


# --------------------------------------------------------------------------- routing (pure)

REPLICAS = ["r-a", "r-b", "r-c", "r-d"]


def test_rendezvous_moves_only_the_dead_replicas_sessions():
    keys = [f"s:{i}" for i in range(2000)]
    before = {k: owner(k, REPLICAS) for k in keys}
    after = {k: owner(k, [r for r in REPLICAS if r != "r-b"]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r-b"}
    assert 300 < len(moved) < 700  # r-b owned about a quarter (non-vacuity: something moved)
    assert all(owner(k, list(reversed(REPLICAS))) == before[k] for k in keys)  # order does not matter


def test_a_keyed_request_stays_with_its_owner_until_the_owner_is_clearly_hotter():
    key = "s:chat-1"
    own = owner(key, REPLICAS)
    other = next(r for r in REPLICAS if r != own)
    idle = {r: Load() for r in REPLICAS}
    assert choose(key, idle) == own
    # within 2 * least + slack the owner keeps it (its prefix cache is worth a little queue)
    assert choose(key, {**idle, own: Load(running=OVERFLOW_SLACK)}) == own
    hot = {r: Load(running=1) for r in REPLICAS} | {own: Load(running=2 + OVERFLOW_SLACK + 1)}
    assert choose(key, hot) != own
    waiting = {**idle, own: Load(waiting=3)}  # 3 waiting = 12 > 0 * 2 + 8
    assert choose(key, waiting) != own
    assert choose(key, {**idle, own: Load(queue_full=True)}) != own
    # overflow goes to the least loaded
    loads = {r: Load(running=5) for r in REPLICAS} | {own: Load(waiting=20), other: Load(running=1)}
    assert choose(key, loads) == other
    # nowhere better to go: stay
    assert choose(key, {r: Load(queue_full=True) for r in REPLICAS}) == own


def test_sessionless_requests_spread_by_load():
    rng = random.Random(0)
    idle = {r: Load() for r in REPLICAS}
    counts = {r: 0 for r in REPLICAS}
    for _ in range(400):
        counts[choose(None, idle, rng)] += 1
    assert all(60 < c < 140 for c in counts.values()), counts
    busy = {r: Load(running=10) for r in REPLICAS} | {"r-c": Load()}
    picks = [choose(None, busy, rng) for _ in range(400)]
    assert picks.count("r-c") > 150  # r-c wins every draw it is in (half of them)
    assert all(p == "r-c" for p in (choose(None, {"r-c": Load(), "r-d": Load(waiting=1)}, rng) for _ in range(20)))


def test_session_key_precedence():
    page = list(range(16))
    assert session_key("abc", page) == "s:abc"
    assert session_key(None, page) == session_key(None, list(page)) != session_key(None, [1] * 16)
    assert session_key(None, page).startswith("p:")
    assert session_key(None, None) is None and session_key("", None) is None
    assert Load.from_stats(None) == Load() and Load.from_stats({"running": 2, "waiting": 1}).score == 6


def test_failed_and_avoided_replicas_are_not_usable_unless_nothing_else_is():
    loads = {r: Load() for r in REPLICAS} | {"r-a": Load.from_stats({"failed": True})}
    assert Load.from_stats({"failed": True}).failed and not Load.from_stats({}).failed
    assert sorted(usable(loads)) == ["r-b", "r-c", "r-d"]
    assert sorted(usable(loads, ("r-b", "r-c"))) == ["r-d"]
    assert usable(loads, ("r-b", "r-c", "r-d")) == loads  # nothing else: all of them (the ingress gives up)
    key = next(f"s:{i}" for i in range(100) if owner(f"s:{i}", REPLICAS) == "r-a")
    assert choose(key, loads) == "r-a" and choose(key, usable(loads)) != "r-a"  # non-vacuity: r-a owns key


class _FakeStream:
    """What ``handle.options(stream=True).generate.remote(...)`` returns: a script of items, where an
    exception in the script is raised at that point."""

    def __init__(self, script) -> None:
        self._script, self.cancelled = list(script), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._script:
            raise StopAsyncIteration
        item = self._script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _FakeReplicas:
    """A stand-in for the replicas' DeploymentHandle: call i streams ``scripts[i]``; ``avoids`` records
    each call's ``avoid`` argument (what the router would leave out)."""

    def __init__(self, *scripts) -> None:
        self._scripts, self.avoids = list(scripts), []
        self.generate = self

    def options(self, stream: bool):
        return self

    def remote(self, fields, session_key=None, avoid=()):
        self.avoids.append(avoid)
        return _FakeStream(self._scripts[len(self.avoids) - 1])


def _run_call(replicas: _FakeReplicas) -> list[dict]:
    import asyncio

    from frontend.cluster import ingress

    async def go():
        bridge = ingress.ClusterBridge(replicas, tokenizer=None)
        return [m async for m in bridge.generate({"prompt_token_ids": [1, 2]}).events()]

    return asyncio.run(go())


DONE = [{"type": "chunk", "id": "x", "token_ids": [7]}, {"type": "done", "id": "x", "finish_reason": "length"}]


def test_a_request_no_replica_began_goes_to_another_and_a_begun_one_never_twice(monkeypatch):
    from ray.exceptions import ActorDiedError

    from frontend.cluster.ingress import RETRIES

    monkeypatch.setattr("frontend.cluster.ingress.RETRY_DELAY_S", 0)
    # refused by a replica whose tandem serve had exited, then by a dead actor: the third replica answers
    replicas = _FakeReplicas(["r-a", {NOT_STARTED: "replica r-a: tandem serve exited (code -9)"}],
                             [ActorDiedError()], ["r-b", DONE])
    assert _run_call(replicas) == DONE
    assert replicas.avoids == [(), ("r-a",), ("r-a",)]
    # refused every time: one worker_failed error naming why, after RETRIES more tries
    replicas = _FakeReplicas(*[["r-a", {NOT_STARTED: "tandem serve exited"}]] * (RETRIES + 2))
    (err,) = _run_call(replicas)
    assert err["type"] == "error" and err["code"] == "worker_failed" and "tandem serve exited" in err["message"]
    assert len(replicas.avoids) == RETRIES + 1
    # the actor died after it began the request (tokens may have reached the client): not sent again
    replicas = _FakeReplicas(["r-a", DONE[:1], ActorDiedError()], ["r-b", DONE])
    out = _run_call(replicas)
    assert out[0] == DONE[0] and out[1]["code"] == "worker_failed" and len(out) == 2
    assert len(replicas.avoids) == 1


# --------------------------------------------------------------------------- options, metrics, manifests


def test_metrics_compat_vllm_exports_the_same_values_under_vllms_names():
    from frontend.metrics import Metrics

    info = {"model": "m", "worker_ready": True, "running": 3, "waiting": 2, "unsent": 1, "kv_pages_free": 25,
            "kv_pages_total": 100}
    page = Metrics("vllm").render(info).decode()
    for tandem, vllm in [("num_requests_running", "num_requests_running"), ("num_requests_waiting",
                         "num_requests_waiting"), ("kv_cache_usage_perc", "kv_cache_usage_perc"),
                         ("kv_cache_usage_perc", "gpu_cache_usage_perc")]:
        value = next(line.split()[-1] for line in page.splitlines() if line.startswith(f"tandem:{tandem} "))
        assert f'vllm:{vllm}{{model_name="m"}} {value}' in page
    assert "vllm:num_requests_waiting{model_name=\"m\"} 3.0" in page and "vllm:kv_cache_usage_perc" in page
    assert "vllm:" not in Metrics().render(info).decode()
    with pytest.raises(ValueError, match="sglang"):
        Metrics("sglang")


def test_serve_argv_maps_serve_options_and_refuses_unknown_ones():
    from frontend.cluster.app import serve_argv

    argv = serve_argv({"model": "tiny-random", "device": "cpu", "max_batch": 8, "no_pipeline": True,
                       "no_prefix_cache": False, "lora": ["a=/x", "b=/y"], "metrics_compat": "vllm"})
    assert argv == ["--model", "tiny-random", "--device", "cpu", "--max-batch", "8", "--no-pipeline",
                    "--lora", "a=/x", "--lora", "b=/y", "--metrics-compat", "vllm"]
    for bad in ("bind", "http", "curve_clients", "max_batchez"):
        with pytest.raises(ValueError, match=repr(bad)):
            serve_argv({bad: 1})


def test_cluster_refuses_http_beyond_loopback_without_a_key():
    out = subprocess.run([sys.executable, "-m", "frontend.cli", "cluster", "--http", "0.0.0.0:8000"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "TANDEM_API_KEY": ""})
    assert out.returncode == 2 and "refusing to serve HTTP on 0.0.0.0:8000" in out.stderr, out.stderr
    assert "ray" not in out.stderr.lower()  # refused before Ray was started


def _manifests() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def _validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_kubernetes_core_objects_validate_strictly(tmp_path):
    core = [d for d in _manifests() if d["kind"] != "RayService"]
    assert sorted(d["kind"] for d in core) == ["Deployment", "PodDisruptionBudget", "Service"]
    assert _validate(K8S / "tandem.yaml").returncode == 0
    broken = tmp_path / "broken.yaml"  # non-vacuity: --strict refuses a field the schema lacks
    broken.write_text((K8S / "tandem.yaml").read_text().replace("terminationGracePeriodSeconds:",
                                                                "terminationGracePeriod:"))
    assert _validate(broken).returncode != 0
    deployment = next(d for d in core if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    drain = float(container["args"][container["args"].index("--drain-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > drain
    assert all(container[p]["httpGet"]["path"] == "/health" for p in ("startupProbe", "readinessProbe",
                                                                       "livenessProbe"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    key = next(e for e in container["env"] if e["name"] == "TANDEM_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["name"] == "tandem-api-key"


def test_ray_service_serve_config_validates_and_its_args_are_serve_options():
    from ray.serve.schema import ServeDeploySchema

    from frontend.cluster.app import CLUSTER_ARGS, serve_argv

    service = next(d for d in _manifests() if d["kind"] == "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    app = config.applications[0]
    assert app.import_path == "frontend.cluster:build_app"
    serve_argv({k: v for k, v in app.args.items() if k not in CLUSTER_ARGS})  # raises on an unknown option
    replica = next(d for d in app.deployments if d.name == "TandemReplica")
    assert replica.ray_actor_options.num_gpus == 1 and replica.num_replicas == app.args["replicas"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0"  # KubeRay talks to the dashboard
    with pytest.raises(ValueError):  # non-vacuity (pydantic.ValidationError): the schema does refuse a broken config
        ServeDeploySchema.model_validate({"applications": [{"name": "x"}]})


# --------------------------------------------------------------------------- one real cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("cluster") / "cluster.log"
    c = LocalCluster(["--replicas", "2", "--model", "tiny-random", "--device", "cpu", "--max-batch", "8",
                      "--kv-pages", "256", "--drain-timeout", "2", "--not-ready-grace", "3",
                      "--metrics-compat", "vllm"], log)
    try:
        yield c.wait_ready(2, timeout=240)
    finally:
        c.kill()  # a no-op unless a test failed: the SIGTERM test stops it cleanly


def _chat(c: LocalCluster, messages, session=None, max_tokens=4, **kw) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(f"{c.url}/v1/chat/completions", headers=headers, timeout=60,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r


def test_the_openai_client_streams_through_one_address(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused-on-loopback")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-random", max_tokens=12, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Name three rivers."}])
    assert raw.headers["x-tandem-replica"] in cluster.replicas()
    chunks = [ch for ch in raw.parse() if ch.choices and ch.choices[0].delta.content]
    assert len(chunks) >= 3  # tokens arrive as they are produced, not as one block
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    bad = httpx.post(f"{cluster.url}/v1/chat/completions", json={"messages": "nope"}, timeout=30)
    assert bad.status_code == 400 and "messages must be a non-empty array" in bad.text  # serve's own validation
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=30)  # the replicas' serve took --metrics-compat too
    assert metrics.headers["x-tandem-replica"] in cluster.replicas()
    assert 'vllm:num_requests_running{model_name="tiny-random"}' in metrics.text


def test_a_sessions_turns_stay_on_one_replica_and_hit_its_prefix_cache(cluster):
    names = sorted(cluster.replicas())
    hits = {n: cluster.info(n)["prefix_cache"]["hit_tokens"] for n in names}
    messages = [{"role": "system", "content": "You answer in one word. " * 6}]
    served = set()
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}: what is {turn} plus one?"})
        r = _chat(cluster, messages, session="chat-affinity")
        served.add(r.headers["x-tandem-replica"])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert len(served) == 1
    (home,) = served
    after = {n: cluster.info(n)["prefix_cache"]["hit_tokens"] for n in names}
    assert after[home] - hits[home] >= 3 * 32  # turns 2-4 each found the earlier turns' pages
    assert all(after[n] == hits[n] for n in names if n != home)
    # the OpenAI user field is a session too, and it is not the header's
    users = {_chat(cluster, [{"role": "user", "content": "hi"}], user=f"user-{i}").headers["x-tandem-replica"]
             for i in range(12)}
    assert users == set(names)  # twelve sessions, rendezvous-hashed over both replicas
    # without either, the prompt's first KV page: a shared system prompt meets one replica, other ones spread
    shared = {_chat(cluster, [{"role": "system", "content": "Be brief. " * 8},
                              {"role": "user", "content": f"question {i}"}]).headers["x-tandem-replica"]
              for i in range(6)}
    assert len(shared) == 1
    own = {_chat(cluster, [{"role": "system", "content": f"Persona {i}. " * 8}]).headers["x-tandem-replica"]
           for i in range(12)}
    assert own == set(names)


def test_sessionless_requests_reach_every_replica(cluster):
    def one(i, out):
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                       json={"prompt": f"x{i}", "max_tokens": 8, "ignore_eos": True})
        out.append((r.status_code, r.headers.get("x-tandem-replica")))

    out: list = []
    threads = [threading.Thread(target=one, args=(i, out)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {s for s, _ in out} == {200}
    assert {n for _, n in out} == set(cluster.replicas())


def _stream_through_a_kill(cluster: LocalCluster, session: str, replica: str, kill) -> None:
    """A long stream of ``session`` on ``replica``; ``kill()`` once it streams: the stream gets one
    ``worker_failed`` error event, then its end (it never hangs)."""
    events, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", headers={"X-Session-Id": session},
                          timeout=60, json={"messages": [{"role": "user", "content": "go"}], "stream": True,
                                            "max_tokens": 100000, "ignore_eos": True}) as r:
            assert r.headers["x-tandem-replica"] == replica
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    kill()
    reader.join(30)
    assert not reader.is_alive(), "the stream lost its replica and hangs"
    assert events[-1] == "[DONE]"
    errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "worker_failed", events[-3:]
    assert all("error" not in json.loads(e) for e in events[:-2])


def test_killed_and_never_ready_replicas_are_replaced(cluster):
    old = cluster.replicas()
    a, b = sorted(old)
    session_a = next(f"s{i}" for i in range(100) if owner(f"s:s{i}", [a, b]) == a)
    session_b = next(f"s{i}" for i in range(100) if owner(f"s:s{i}", [a, b]) == b)

    # a stream on A; A's tandem serve is killed mid-stream: one error event, then the end
    _stream_through_a_kill(cluster, session_a, a, old[a].kill)
    # B keeps answering meanwhile, and A's sessions are served elsewhere without an error before Serve
    # has replaced A (A refuses them unstarted until its routing stats say failed)
    assert _chat(cluster, [{"role": "user", "content": "still there?"}], session=session_b).headers[
        "x-tandem-replica"] == b
    for turn in range(3):
        assert _chat(cluster, [{"role": "user", "content": f"moved {turn}"}], session=session_a).headers[
            "x-tandem-replica"] != a

    # B's worker is killed and its next generation stopped before it is ready: B's tandem serve lives on,
    # answers info, but its worker_ready stays false, so check_health fails after --not-ready-grace
    worker = next(p for p in old[b].children() if "gpu_worker.worker" in p.cmdline())
    worker.kill()
    deadline = time.monotonic() + 30
    while True:
        fresh = [p for p in old[b].children() if p.pid != worker.pid and "gpu_worker.worker" in p.cmdline()]
        if fresh:
            fresh[0].suspend()
            break
        assert time.monotonic() < deadline, "no new worker generation"
        time.sleep(0.01)
    assert cluster.info(b)["worker_ready"] is False

    new = cluster.wait_replicas(2, exclude={a, b}, timeout=150)
    assert not old[a].is_running() and not old[b].is_running()
    assert not psutil.pid_exists(fresh[0].pid) or psutil.Process(fresh[0].pid).status() == psutil.STATUS_ZOMBIE
    assert _chat(cluster, [{"role": "user", "content": "back?"}]).headers["x-tandem-replica"] in new


def test_a_killed_replica_actor_takes_its_tandem_serve_along_and_is_replaced(cluster):
    """kill -9 of a Serve replica's actor process itself (not its child): its stream ends with one
    error, its tandem serve exits with it (PR_SET_PDEATHSIG), its sessions are answered by the
    other replica meanwhile (a request sent to the dead actor before Serve drops it is sent
    again), and Serve starts a new replica."""
    old = cluster.wait_replicas(2, timeout=60)
    a, b = sorted(old)
    session_a = next(f"t{i}" for i in range(100) if owner(f"s:t{i}", [a, b]) == a)
    actor = old[a].parent()
    assert "TandemReplica" in " ".join(actor.cmdline()), actor.cmdline()  # non-vacuity: the actor, not raylet
    _stream_through_a_kill(cluster, session_a, a, actor.kill)
    old[a].wait(timeout=60)  # raises if A's tandem serve outlives its actor
    for turn in range(3):
        assert _chat(cluster, [{"role": "user", "content": f"after {turn}"}], session=session_a).headers[
            "x-tandem-replica"] != a
    new = cluster.wait_replicas(2, exclude={a}, timeout=150)
    assert b in new and old[b].is_running()


def test_sigterm_leaves_nothing_running(cluster):
    procs = cluster.processes()
    assert any("raylet" in p.name() for p in procs) and len(cluster.replicas()) == 2  # non-vacuity
    assert cluster.stop() == 0, cluster.log.read_text()[-3000:]
    time.sleep(1)
    alive = [p for p in cluster.seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, [psutil.Process(p).cmdline() for p in alive]
    assert "tandem: stopped" in cluster.log.read_text()
    assert len(cluster.replica_dirs) == 5 and not any(d.exists() for d in cluster.replica_dirs)  # 2 + 2 + 1 replaced

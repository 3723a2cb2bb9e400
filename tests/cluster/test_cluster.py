"""``tandem cluster`` on Ray Serve: the ingress's retries, its direct path (against a fake ``tandem
serve`` process: same node direct, another through Ray, a killed one's streams), the option mapping,
the manifests, then one real cluster for the module (``tandem cluster --replicas 2``, tiny-random on
CPU, loopback): streaming through the ingress, session affinity with prefix-cache hits in the owner's
counters, a sessionless burst spread over both replicas, a stream completing while its replica's actor
is stopped (the direct path), a replica's ``tandem serve`` killed mid-stream, a worker that never gets
ready, a replica's actor killed mid-stream, and SIGTERM leaving nothing running. (The routing
itself, pure: tests/cluster/test_routing.py.)

No test here depends on the machine's speed: a test follows the replica that answered, not the one
it expects the router to choose (save where no timing enters the choice: one request at a time, a
session's goes to its first replica), and waits for what it needs to have happened, not for a time."""
from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from processes import ROOT

from bench.cluster import LocalCluster, free_port
from frontend.cluster.routing import NOT_STARTED, rendezvous
from shared.config import EngineConfig
from shared.models.random_weights import TINY_RANDOM_CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

K8S = ROOT / "deploy" / "kubernetes"


# --------------------------------------------------------------------------- the ingress's bridge (no cluster)


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

    def options(self, **options):
        return self

    def remote(self, fields, avoid=(), session=None, prefix_pages=()):
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
    replicas = _FakeReplicas([("r-a", {NOT_STARTED: "replica r-a: tandem serve exited (code -9)"})],
                             [ActorDiedError()], [("r-b", DONE)])
    assert _run_call(replicas) == DONE
    assert replicas.avoids == [(), ("r-a",), ("r-a",)]
    # refused every time: one worker_failed error naming why, after RETRIES more tries
    replicas = _FakeReplicas(*[[("r-a", {NOT_STARTED: "tandem serve exited"})]] * (RETRIES + 2))
    (err,) = _run_call(replicas)
    assert err["type"] == "error" and err["code"] == "worker_failed" and "tandem serve exited" in err["message"]
    assert len(replicas.avoids) == RETRIES + 1
    # the actor died after it began the request (tokens may have reached the client): not sent again
    replicas = _FakeReplicas([("r-a", DONE[:1]), ActorDiedError()], [("r-b", DONE)])
    out = _run_call(replicas)
    assert out[0] == DONE[0] and out[1]["code"] == "worker_failed" and len(out) == 2
    assert len(replicas.avoids) == 1


def test_serve_is_given_the_routers_choice_alone():
    """Serve sends a request to the first rank with room and passes over a replica that answers its
    queue-length probe late (a busy host): a second rank would take a session off its replica below the
    bound. So one rank, and Serve backs off and asks again when that replica has no room."""
    import asyncio
    from types import SimpleNamespace

    from frontend.cluster.router import AffinityRouter

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n), routing_stats={}) for n in ("r-a", "r-b")]

    async def ranks(i: int):
        router = AffinityRouter.__new__(AffinityRouter)  # (Serve's constructor needs a running deployment)
        router.initialize_state()
        pending = SimpleNamespace(kwargs={"session": f"chat-{i}"}, metadata=SimpleNamespace(internal_request_id="q"),
                                  future=asyncio.get_running_loop().create_future(),
                                  routing_context=SimpleNamespace(should_backoff=False))
        out = await router.choose_replicas(replicas, pending)
        assert pending.routing_context.should_backoff and router.routing.sent(out[0][0].replica_id.unique_id) == 1
        return [[r.replica_id.unique_id for r in rank] for rank in out]

    for i in range(8):
        assert asyncio.run(ranks(i)) == [[rendezvous(f"s:chat-{i}", ["r-a", "r-b"])[0]]]


def test_a_request_the_ingress_sends_itself_is_counted_until_it_reports_its_end():
    """The direct path asks Serve for the router's choice only (Serve never sees the request end): the
    router counts it at the choice and the ingress's ``Counted.end()`` uncounts it, once."""
    import asyncio
    from types import SimpleNamespace

    from frontend.cluster.router import AffinityRouter, Counted

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n), routing_stats={}) for n in ("r-a", "r-b")]

    async def go():
        router = AffinityRouter.__new__(AffinityRouter)  # (Serve's constructor needs a running deployment)
        router.initialize_state()
        counted = Counted()
        counted.end()  # before the choice: nothing to uncount
        pending = SimpleNamespace(kwargs={"session": "chat-1", "counted": counted},
                                  metadata=SimpleNamespace(internal_request_id="q"),
                                  future=asyncio.get_running_loop().create_future(),
                                  routing_context=SimpleNamespace(should_backoff=False))
        ((chosen,),) = await router.choose_replicas(replicas, pending)
        name = chosen.replica_id.unique_id
        assert router.routing.sent(name) == 1
        counted.end()
        counted.end()
        return router.routing.sent(name)

    assert asyncio.run(go()) == 0


_FAKE_SERVE = """
import json, sys, msgpack, zmq
from frontend.protocol.encode import encode_message
replies = json.loads(sys.argv[2])
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    peer, _, body = sock.recv_multipart()
    msg = msgpack.unpackb(body)
    print(json.dumps(msg), flush=True)
    if msg["type"] == "generate":
        for reply in replies.pop(0):
            sock.send_multipart([peer, *encode_message({**reply, "id": msg["id"]})])
"""


class _FakeServe:
    """A replica's ``tandem serve`` as the ingress's direct path sees it: a process with a ROUTER on
    ``endpoint`` answering the i-th generate with ``replies[i]`` (its id filled in); ``received()``
    waits for the next message it got."""

    def __init__(self, endpoint: str, replies) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _FAKE_SERVE, endpoint, json.dumps(replies)],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout.readline() == "ready\n"
        self.metadata = {"endpoint": endpoint, "node": "node-here", "pid": self.proc.pid}

    async def received(self) -> dict:
        import asyncio

        return json.loads(await asyncio.to_thread(self.proc.stdout.readline))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _FakeChoosing(_FakeReplicas):
    """``_FakeReplicas`` with the router's choice (``choose_replica(..., _reserve=False)``): the i-th
    choice is ``choices[i]``, (replica, its reported metadata); ``ended`` lists the replicas whose
    count the ingress ended, ``chosen_avoiding`` each choice's ``avoid``."""

    def __init__(self, choices, *scripts) -> None:
        super().__init__(*scripts)
        self._choices, self.ended, self.chosen_avoiding = list(choices), [], []

    def choose_replica(self, avoid=(), counted=None, _reserve=True, session=None, prefix_pages=()):
        from contextlib import asynccontextmanager
        from types import SimpleNamespace

        assert _reserve is False  # pick only: the replica's actor is not asked
        replica, metadata = self._choices.pop(0)
        self.chosen_avoiding.append(avoid)
        counted.bind(lambda: self.ended.append(replica))

        @asynccontextmanager
        async def selection():
            yield SimpleNamespace(replica_id=replica, replica_metadata=metadata)

        return selection()


def _direct_bridge(replicas):
    from frontend.cluster import ingress
    from frontend.cluster.direct import DirectPath

    return ingress.ClusterBridge(replicas, tokenizer=None, direct=DirectPath("node-here"))


def test_a_same_node_replica_is_read_directly_and_another_nodes_through_ray(tmp_path):
    import asyncio

    serve = _FakeServe(f"ipc://{tmp_path}/here.sock", [DONE])
    there = {**serve.metadata, "node": "node-there"}  # (as if elsewhere: its actor is called)

    async def go():
        replicas = _FakeChoosing([("r-here", serve.metadata), ("r-there", there)], [("r-there", DONE)])
        bridge = _direct_bridge(replicas)
        direct = [m async for m in bridge.generate({"prompt_token_ids": [1, 2]}, rid="q1").events()]
        via_ray = [m async for m in bridge.generate({"prompt_token_ids": [1, 2]}, rid="q2").events()]
        await bridge.close()
        return await serve.received(), direct, via_ray, replicas

    try:
        received, direct, via_ray, replicas = asyncio.run(go())
    finally:
        serve.kill()
    assert received["type"] == "generate" and received["id"] == "q1"  # the HTTP request's id
    assert direct == [{**m, "id": "q1"} for m in DONE]
    assert via_ray == DONE and len(replicas.avoids) == 1  # the other node's replica: its actor's stream
    assert replicas.ended == ["r-here", "r-there"]  # each choice's count ended (r-there's: before the handle's call)


def test_a_direct_stream_whose_serve_exits_ends_with_one_worker_failed_or_goes_elsewhere_unbegun(tmp_path, monkeypatch):
    """The replica's ``tandem serve`` is killed: a stream that had begun ends with exactly one
    ``worker_failed`` error at once; one that had received nothing is sent to another replica
    (avoiding the dead one, as every later request does) and answered there."""
    import asyncio

    monkeypatch.setattr("frontend.cluster.ingress.RETRY_DELAY_S", 0)

    async def begun():
        serve = _FakeServe(f"ipc://{tmp_path}/a.sock", [DONE[:1]])  # one chunk, then nothing: it dies mid-stream
        replicas = _FakeChoosing([("r-a", serve.metadata)])
        bridge = _direct_bridge(replicas)
        out = []
        async for msg in bridge.generate({"prompt_token_ids": [1, 2]}, rid="q1").events():
            out.append(msg)
            if len(out) == 1:
                serve.kill()
        await bridge.close()
        return out, replicas

    out, replicas = asyncio.run(begun())
    assert out[0] == {**DONE[0], "id": "q1"} and len(out) == 2
    assert out[1]["type"] == "error" and out[1]["code"] == "worker_failed" and "r-a" in out[1]["message"]
    assert replicas.ended == ["r-a"] and replicas.chosen_avoiding == [()]

    async def unbegun():
        dying = _FakeServe(f"ipc://{tmp_path}/a2.sock", [[]])  # takes the request, answers nothing, dies
        serve_b = _FakeServe(f"ipc://{tmp_path}/b.sock", [DONE, DONE])
        replicas = _FakeChoosing([("r-a", dying.metadata), ("r-b", serve_b.metadata), ("r-b", serve_b.metadata)])
        bridge = _direct_bridge(replicas)
        events = bridge.generate({"prompt_token_ids": [1, 2]}, rid="q1").events()
        first = asyncio.ensure_future(events.__anext__())
        assert (await dying.received())["type"] == "generate"
        dying.kill()
        out = [await first] + [m async for m in events]
        later = [m async for m in bridge.generate({"prompt_token_ids": [3]}, rid="q2").events()]
        await bridge.close()
        serve_b.kill()
        return out, later, replicas

    out, later, replicas = asyncio.run(unbegun())
    assert out == [{**m, "id": "q1"} for m in DONE] and later == [{**m, "id": "q2"} for m in DONE]
    assert replicas.chosen_avoiding == [(), ("r-a",), ("r-a",)]
    assert replicas.ended == ["r-a", "r-b", "r-b"]


def test_a_closed_bridge_ends_every_call_with_one_error_never_a_hang(tmp_path):
    import asyncio

    from frontend.http.bridge import Bridge

    serve = _FakeServe(f"ipc://{tmp_path}/s.sock", [DONE[:1]])

    async def go():
        bridge = Bridge(serve.metadata["endpoint"])
        await bridge.start()
        call = bridge.generate({"prompt_token_ids": [1]}, rid="q1")
        batches = []
        async for batch in call.batches():
            batches.append(batch)
            if len(batches) == 1:
                await bridge.close("worker_failed", "gone")
        later = bridge.generate({"prompt_token_ids": [1]}, rid="q2")
        return batches, call.lost, [b async for b in later.batches()], later.lost

    try:
        batches, lost, later, later_lost = asyncio.run(go())
    finally:
        serve.kill()
    assert batches[0] == [{**DONE[0], "id": "q1"}] and lost and later_lost
    assert batches[1] == later[0] == [{"type": "error", "id": None, "code": "worker_failed", "message": "gone"}]
    assert len(batches) == 2 and len(later) == 1


# --------------------------------------------------------------------------- options, metrics, manifests


def test_metrics_compat_vllm_exports_the_same_values_under_vllms_names():
    from frontend.server.metrics import Metrics

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
    out = subprocess.run([sys.executable, "-m", "frontend.cli.main", "cluster", "--http", "0.0.0.0:8000"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "TANDEM_API_KEY": ""})
    assert out.returncode == 2 and "refusing to serve HTTP on 0.0.0.0:8000" in out.stderr, out.stderr
    assert "ray" not in out.stderr.lower()  # refused before Ray was started


def test_cluster_names_a_taken_address_before_starting_ray():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "frontend.cli.main", "cluster", "--http", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"cannot listen for HTTP on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "starting a local Ray instance" not in out.stderr


def test_serve_run_of_the_application_serves_through_serves_proxy(tmp_path):
    """``serve run`` (and KubeRay's serveConfigV2) deploys ``build_app`` without ``listen``: Serve's
    HTTP proxy serves the ingress's routes (``tandem cluster`` has the ingress serve them itself)."""
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "tandem", "import_path": "frontend.cluster:build_app", "route_prefix": "/",
                          "args": {"replicas": 1, "model": "tiny-random", "device": "cpu"}}]}))
    log = tmp_path / "serve-run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while True:  # ready: Serve's proxy answers the ingress's route (a 503 or a refused connection before)
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                                "ignore_eos": True}) as r:
            assert r.status_code == 200 and r.headers["x-tandem-replica"]
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 5, events  # a role delta, 4 tokens, the end
        owners = {p.info["pid"]: " ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["pid", "cmdline"])}
        listener = next(c.pid for c in psutil.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
        assert "ProxyActor" in owners[listener], owners[listener]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
    probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    # live (200 while a worker restarts) for startup and liveness; ready (503 then) takes the pod out of the Service
    assert probes == {"startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health"}
    from frontend.http.app import OPEN_PATHS

    assert set(probes.values()) <= OPEN_PATHS  # a probe carries no API key
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
    # every Ray node starts with the hop's Serve settings (Serve's proxy reads them from its node's environment)
    from frontend.cluster import HOP_ENV

    groups = [head, *service["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for group in groups:
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert {name: env.get(name) for name in HOP_ENV} == HOP_ENV, group.get("groupName", "head")
    with pytest.raises(ValueError):  # non-vacuity (pydantic.ValidationError): the schema does refuse a broken config
        ServeDeploySchema.model_validate({"applications": [{"name": "x"}]})


# --------------------------------------------------------------------------- one real cluster


BURST_ROOM = 16  # requests a replica runs at once: above either replica's share of _burst's 24 under the bound
# a request's KV when it may fill the context (by default tiny-random's own limit)
CONTEXT_PAGES = TINY_RANDOM_CONFIG["max_position_embeddings"] // EngineConfig.page_size


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("cluster") / "cluster.log"
    # --max-batch and --kv-pages: room for BURST_ROOM of _burst's whole-context streams at once per replica
    c = LocalCluster(["--replicas", "2", "--model", "tiny-random", "--device", "cpu",
                      "--max-batch", str(BURST_ROOM), "--kv-pages", str(BURST_ROOM * CONTEXT_PAGES),
                      "--drain-timeout", "2", "--not-ready-grace", "3", "--metrics-compat", "vllm"], log)
    try:
        c.wait_ready(2, timeout=240)
        # both workers answer; the ingress's router hears of a replica from Serve a moment after its
        # constructor returns: every test starts once sessionless traffic has reached both
        _sessionless_until_answered_by(c, set(c.replicas()))
        yield c
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
    # the ingress's actor serves the address itself: no Serve proxy on the path (frontend/cluster/run.py)
    procs = {p.pid: " ".join(p.cmdline()) for p in cluster.processes()}
    (listener,) = {c.pid for c in psutil.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == cluster.port}
    assert "TandemIngress" in procs[listener], procs.get(listener)
    assert not any("ProxyActor" in cmd for cmd in procs.values()), procs


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
    # the OpenAI user field is a session too, and it is not the header's: one after another (nothing in
    # flight, so each below the bound), every user's request goes to its session's first replica, whatever
    # the replicas' reports of a moment ago say and however late a replica answers Serve's probe
    # (twelve users, six owned by each replica: both are asked for)
    owners = {f"user-{i}": rendezvous(f"s:user-{i}", names)[0] for i in range(200)}
    users = [u for n in names for u in [u for u, owner in owners.items() if owner == n][:6]]
    assert len(users) == 12
    for user in sorted(users):
        assert _chat(cluster, [{"role": "user", "content": "hi"}], user=user).headers[
            "x-tandem-replica"] == owners[user], user
    # without either, the prompt's pages: prompts that mostly repeat one sent before follow it (a system
    # prompt filling both pages of these prompts), others spread
    shared = {_chat(cluster, [{"role": "system", "content": "Be brief. " * 8},
                              {"role": "user", "content": f"question {i}"}]).headers["x-tandem-replica"]
              for i in range(6)}
    assert len(shared) == 1
    # others spread by what is in flight (sent at once: the bound's spread, whatever order they arrive in)
    with ThreadPoolExecutor(12) as pool:
        own = set(pool.map(lambda i: _chat(cluster, [{"role": "system", "content": f"Persona {i}. " * 8}],
                                           max_tokens=16, ignore_eos=True).headers["x-tandem-replica"], range(12)))
    assert own == set(names)


def _burst(cluster: LocalCluster, tag: str, n: int = 24) -> dict[str, int]:
    """``n`` concurrent sessionless chats sharing the chat template's first KV page (its default system
    prompt), each its own after it (``tag``: never sent before, or each would follow its earlier copy's
    replica): how many each replica answered.

    The router balances what it has in flight, so the spread is its bound's only while the whole burst
    is in flight: a short request could end during the burst (how soon depends on the machine), and the
    replica that happens to be faster then gets more. So each request is a stream as long as the
    context allows, every replica runs its whole share at once (the fixture's ``BURST_ROOM``), and each
    stream is held open, unread, from its first event (which names its replica) until every one of the
    burst has been answered; then all are closed (cancelled)."""
    outcomes: list[tuple] = []  # (status, replica) of each request, or (the exception, None)
    lock, all_answered = threading.Lock(), threading.Event()

    def answered(outcome: tuple) -> None:
        with lock:
            outcomes.append(outcome)
            if len(outcomes) == n:
                all_answered.set()

    def one(i):
        outcome = None
        try:
            with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=120,
                              json={"messages": [{"role": "user", "content": f"request {tag}{i} " + "x " * 40}],
                                    "stream": True, "max_tokens": 100000, "ignore_eos": True}) as r:
                outcome = (r.status_code, r.headers.get("x-tandem-replica"))
                answered(outcome)
                all_answered.wait()
        except Exception as e:  # noqa: BLE001 - the assertion below names it (and nothing waits for it in vain)
            if outcome is None:
                answered((e, None))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s for s, _ in outcomes] == [200] * n, outcomes
    return {name: sum(r == name for _, r in outcomes) for name in {r for _, r in outcomes}}


def test_a_sessionless_burst_is_spread_over_both_replicas(cluster):
    counts = _burst(cluster, "first")
    assert sorted(counts) == sorted(cluster.replicas()) and min(counts.values()) >= 8, counts


def test_a_request_streams_from_a_replica_whose_actor_is_stopped(cluster):
    """The direct path: the ingress sends the request to the chosen replica's ``tandem serve`` and reads
    its tokens itself, so a stream completes while the replicas' Ray actors are stopped (SIGSTOP): no
    token passes through an actor. (Through the actor it would wait until Serve's health check gave the
    actor up.) Both actors are stopped, so the test holds whichever replica the router weighs the
    request to. The stream is short beside the health check's timeout."""
    replicas = cluster.wait_replicas(2, timeout=300)
    actors = {name: child.parent() for name, child in replicas.items()}
    for actor in actors.values():
        assert "TandemReplica" in " ".join(actor.cmdline()), actor.cmdline()  # non-vacuity: the actor, not raylet
    for actor in actors.values():
        actor.suspend()
    try:
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "go"}], "stream": True,
                                "max_tokens": 16, "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            served_by = r.headers["x-tandem-replica"]
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert all(actor.status() == psutil.STATUS_STOPPED for actor in actors.values())  # stopped all along
    finally:
        for actor in actors.values():
            actor.resume()
    assert served_by in replicas, (served_by, sorted(replicas))
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events[-3:]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 16


def _gone(path: Path, timeout: float = 60) -> bool:
    """Whether ``path`` is removed within ``timeout`` s (by a replica: the ingress may see its child
    exit, and end the stream, before the replica's actor has removed the directory)."""
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stream_through_a_kill(cluster: LocalCluster, session: str, kill) -> str:
    """A long stream of ``session``; once it streams, ``kill(replica)`` of the replica serving it: the
    stream gets one ``worker_failed`` error event, then its end (it never hangs). Returns that replica."""
    events, served_by, started = [], [], threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", headers={"X-Session-Id": session},
                              timeout=120, json={"messages": [{"role": "user", "content": "go"}], "stream": True,
                                                 "max_tokens": 100000, "ignore_eos": True}) as r:
                served_by.append(r.headers["x-tandem-replica"])
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        finally:
            started.set()  # (ended before its first event: the assertions below say how)

    reader = threading.Thread(target=stream)
    reader.start()
    started.wait()
    assert served_by and events, "the stream ended before its first event"
    (replica,) = served_by
    kill(replica)
    reader.join(60)
    assert not reader.is_alive(), "the stream lost its replica and hangs"
    assert events[-1] == "[DONE]"
    errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "worker_failed", events[-3:]
    assert all("error" not in json.loads(e) for e in events[:-2])
    return replica


def _sessionless_until_answered_by(cluster: LocalCluster, names: set, timeout: float = 150) -> None:
    """Sessionless chats, one at a time, until each of ``names`` has answered one (the ingress's router
    hears of a new replica from Serve a moment after the replica is ready; no preference: in turn)."""
    answered: set = set()
    deadline = time.monotonic() + timeout
    for i in itertools.count():
        answered.add(_chat(cluster, [{"role": "user", "content": f"anyone there {i}? " * 4}]).headers[
            "x-tandem-replica"])
        if names <= answered:
            return
        assert time.monotonic() < deadline, f"sessionless requests never reached {sorted(names - answered)}"


def test_killed_and_never_ready_replicas_are_replaced(cluster):
    old = cluster.replicas()
    assert len(old) == 2

    # a stream on A; A's tandem serve is killed mid-stream: one error event, then the end
    a = _stream_through_a_kill(cluster, "s-killed", lambda name: old[name].kill())
    (b,) = set(old) - {a}
    assert _gone(cluster.replica_dirs[a])  # A's replica removed its directory when its child exited
    # B keeps answering meanwhile, and A's sessions are served elsewhere without an error before Serve
    # has replaced A (A refuses them unstarted until its routing stats say failed)
    assert _chat(cluster, [{"role": "user", "content": "still there?"}], session="s-other").headers[
        "x-tandem-replica"] == b
    for turn in range(3):
        assert _chat(cluster, [{"role": "user", "content": f"moved {turn}"}], session="s-killed").headers[
            "x-tandem-replica"] == b

    # B's worker is killed and its next generation stopped before it is ready: B's tandem serve lives on,
    # answers info, but its worker_ready stays false, so check_health fails after --not-ready-grace
    worker = next(p for p in old[b].children() if "gpu_worker.worker" in p.cmdline())
    worker.kill()
    deadline = time.monotonic() + 60
    while True:
        fresh = [p for p in old[b].children() if p.pid != worker.pid and "gpu_worker.worker" in p.cmdline()]
        if fresh:
            fresh[0].suspend()
            break
        assert time.monotonic() < deadline, "no new worker generation"
        time.sleep(0.01)
    assert cluster.info(b)["worker_ready"] is False

    new = cluster.wait_replicas(2, exclude={a, b}, timeout=300)
    old[a].wait(60)  # (psutil: raises if it is still running then)
    old[b].wait(60)
    assert not psutil.pid_exists(fresh[0].pid) or psutil.Process(fresh[0].pid).status() == psutil.STATUS_ZOMBIE
    # sessionless traffic reaches the new replicas again, and a burst is spread over them
    _sessionless_until_answered_by(cluster, set(new))
    counts = _burst(cluster, "after the kills")
    assert sorted(counts) == sorted(new) and min(counts.values()) >= 8, counts


def test_a_killed_replica_actor_takes_its_tandem_serve_along_and_is_replaced(cluster):
    """kill -9 of a Serve replica's actor process itself (not its child): its stream ends with one
    error, its tandem serve exits with it (PR_SET_PDEATHSIG), its sessions are answered by the
    other replica meanwhile (a request sent to the dead actor before Serve drops it is sent
    again), the next replica removes its directory, and Serve starts a new replica."""
    old = cluster.wait_replicas(2, timeout=300)

    def kill_actor(name):
        actor = old[name].parent()
        assert "TandemReplica" in " ".join(actor.cmdline()), actor.cmdline()  # non-vacuity: the actor, not raylet
        actor.kill()

    a = _stream_through_a_kill(cluster, "t-killed", kill_actor)
    (b,) = set(old) - {a}
    old[a].wait(timeout=60)  # raises if A's tandem serve outlives its actor
    for turn in range(3):
        assert _chat(cluster, [{"role": "user", "content": f"after {turn}"}], session="t-killed").headers[
            "x-tandem-replica"] == b
    new = cluster.wait_replicas(2, exclude={a}, timeout=300)
    assert b in new and old[b].is_running()
    assert _gone(cluster.replica_dirs[a])  # the new replica removed the killed actor's directory


def test_sigterm_leaves_nothing_running(cluster):
    procs = cluster.processes()
    assert any("raylet" in p.name() for p in procs) and len(cluster.replicas()) == 2  # non-vacuity
    assert cluster.stop() == 0, cluster.log.read_text()[-3000:]
    assert "tandem: stopped" in cluster.log.read_text()
    deadline = time.monotonic() + 60  # (a process the stop ended may take a moment to be reaped)
    while alive := [p for p in cluster.seen if psutil.pid_exists(p) and _status(p) != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, [psutil.Process(p).cmdline() for p in alive]
        time.sleep(0.1)
    # every replica's directory this module saw: the last two, and those of the replicas replaced above
    dirs = list(cluster.replica_dirs.values())
    assert len(dirs) >= 2 and not any(d.exists() for d in dirs), dirs


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_ZOMBIE  # gone meanwhile: as good as reaped

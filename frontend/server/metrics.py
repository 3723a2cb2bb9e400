"""Prometheus metrics of a running server (``GET /metrics``), names under ``tandem:``.

Where a figure means what vLLM's does, the name mirrors vLLM's (``vllm:`` ->
``tandem:``); the rest is what only Tandem measures. Two sources:

- Request events, counted by the server loop as they happen (every request,
  ZeroMQ and HTTP alike): prompt / generation tokens, finished requests by
  reason, failed requests by error code, time to first token, inter-token and
  end-to-end latency histograms.
- The engine's figures, read from a snapshot of the server's ``info`` answer
  (the worker's stats) taken when the page is rendered: requests running and
  waiting, KV cache usage, prefix cache queries and hits, device idle
  fraction, zombie rows, steps and host ms per step. Counters kept by the
  worker restart from 0 with a new worker generation (Prometheus' ``rate``
  treats that as a counter reset).

With ``compat="vllm"`` (``tandem serve --metrics-compat vllm``) the figures
routers and dashboards built for vLLM read are also exported under vLLM's
names, with vLLM's ``model_name`` label and the same values
(``VLLM_ALIASES``): vLLM production-stack, the Gateway API Inference
Extension / llm-d and vLLM's dashboards then work unmodified.

Each ``Metrics`` has its own registry, so several servers can live in one
process (tests). ``prometheus_client`` is thread-safe: the server loop
observes, the HTTP thread renders.
"""
from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
COMPAT = ("vllm",)
VLLM_ALIASES = {  # tandem name -> vLLM's names for the same figure (gpu_cache_usage_perc: before vLLM v1)
    "tandem:num_requests_running": ("vllm:num_requests_running",),
    "tandem:num_requests_waiting": ("vllm:num_requests_waiting",),
    "tandem:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    def __init__(self, compat: str | None = None) -> None:
        if compat not in (None, *COMPAT):
            raise ValueError(f"unknown metrics compatibility {compat!r}; known: {', '.join(COMPAT)}")
        self.compat = compat
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.success = Counter("tandem:request_success", "Requests that ended with done, by finish reason.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("tandem:request_failure", "Requests that ended with an error, by error code.",
                               ["code"], registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time from admission to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between two tokens of one request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Time from admission to the terminal message.",
                             buckets=E2E_BUCKETS, registry=r)
        self._snapshot: dict[str, Any] = {}
        r.register(_EngineCollector(self))

    # ------------------------------------------------------------------ events (server loop)
    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def done(self, payload: Mapping[str, Any]) -> None:
        usage, m = payload["usage"], payload["metrics"]
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        self.success.labels(payload["finish_reason"]).inc()
        if m.get("ttft_ms") is not None:
            self.ttft.observe(m["ttft_ms"] / 1e3)
        if m.get("total_ms") is not None:
            self.e2e.observe(m["total_ms"] / 1e3)

    def error(self, code: str) -> None:
        self.failure.labels(code).inc()

    # ------------------------------------------------------------------ rendering (any thread)
    def render(self, info: Mapping[str, Any] | None) -> bytes:
        """The text page; ``info`` is the server's ``info`` answer (None: engine figures left out)."""
        self._snapshot = dict(info or {})
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's figures from the last ``info`` snapshot."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self):
        return []  # figures appear only once a snapshot exists

    def collect(self):
        s = self._metrics._snapshot
        for family in self._families(s):
            yield family
            for alias in VLLM_ALIASES.get(family.name, ()) if self._metrics.compat == "vllm" else ():
                same = GaugeMetricFamily(alias, f"{family.documentation} (vLLM's name)", labels=["model_name"])
                same.add_metric([str(s.get("served_model_name") or s.get("model", ""))], family.samples[0].value)
                yield same

    def _families(self, s: Mapping[str, Any]):
        if not s:
            return
        yield _gauge("tandem:worker_ready", "1 once the worker is ready to serve.", float(bool(s.get("worker_ready"))))
        yield _gauge("tandem:worker_generation", "Worker generation (restarts so far + 1).", s.get("generation"))
        yield _gauge("tandem:num_requests_live", "Requests the server holds (admitted, not ended).",
                     s.get("live_requests"))
        if "running" not in s:  # the worker is starting: no engine figures
            return
        yield _gauge("tandem:num_requests_running", "Requests in the engine's running batch.", s["running"])
        yield _gauge("tandem:num_requests_waiting", "Requests waiting for admission to the batch.",
                     s["waiting"] + s.get("unsent", 0))
        total = s.get("kv_pages_total") or 0
        yield _gauge("tandem:kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1).",
                     (total - s["kv_pages_free"]) / total if total else 0.0)
        yield _gauge("tandem:device_idle_fraction", "Fraction of the decode loop's time the device sat idle.",
                     s.get("device_idle_fraction"))
        steps = s.get("steps", 0)
        yield _gauge("tandem:host_ms_per_step", "Host (CPU) time per engine step, averaged since worker start.",
                     1e3 * s.get("host_s", 0.0) / steps if steps else 0.0)
        yield _counter("tandem:engine_steps", "Engine steps (launches) since worker start.", steps)
        yield _counter("tandem:zombie_rows", "Rows computed for sequences already ended (pipelining's cost).",
                       s.get("zombie_rows"))
        yield _counter("tandem:grammar_cache_hits", "Compiled-grammar cache hits.", s.get("grammar_cache_hits"))
        if "prefix_query_tokens" in s:  # vLLM's prefix_cache_queries / _hits, in tokens
            yield _counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           s["prefix_query_tokens"])
            yield _counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           s["prefix_hit_tokens"])


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value or 0.0))


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value or 0.0))

"""Serving benchmark: a load generator over the ZeroMQ protocol (``docs/PROTOCOL.md``) and
over HTTP (OpenAI chat completions, streamed), one after the other or side by side.

    tandem serve --model smollm2-135m --device cpu &
    tandem bench serve --connect tcp://127.0.0.1:5557 --concurrency 1,8,32 --requests 64
    tandem bench serve --transport both --http-url http://127.0.0.1:8000 --concurrency 1,8,32
    tandem bench serve --spawn --model tiny-random --device cpu --concurrency 1,4 --requests 8 --json
    python -m bench.serve ...                      (the same options)

``--transport zmq`` (default), ``http`` or ``both`` (each level runs over
ZeroMQ, then over HTTP, on the same server; the table has one row per
transport and level). HTTP requests are ``POST /v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage`` (or ``stream: false``
with ``--no-stream``) from ``httpx``, one connection per client; their prompt
is ``--prompt-len`` random words (chat needs text), so their prompt tokens
differ from the ZeroMQ requests' exact token ids by the chat template and the
tokenizer; the answer lengths are the same (``ignore_eos``). HTTP TTFT/ITL are
measured on content chunks (``--no-stream``: E2E only).

What is measured, per concurrency level C (levels run one after another):
- C closed-loop clients, each its own connection (``AsyncClient``, one asyncio
  loop): a client sends a request, waits for its end, sends the next, until
  ``--requests`` requests of the level have been sent. The level's wall time
  runs from the first send to the last terminal message.
- Each request has a prompt of ``--prompt-len`` random token ids (sent as
  ``prompt_token_ids``, so the length is exact and no tokenizer is needed
  here) and asks for ``--max-tokens`` tokens with ``ignore_eos`` (so every
  answer has exactly that length; ``--no-ignore-eos`` lets EOS end it).
  A length is a number (``16``) or a uniform integer range (``8:64``), drawn
  per request from ``--seed``: every level sees the same sequence.
- Streaming (default): TTFT = first chunk's arrival - send time; inter-token
  latency (ITL) = the gaps between consecutive chunk arrivals, divided by the
  tokens in the later chunk (a server sends one chunk per step, so normally
  one token each); end-to-end = terminal message - send time. All on the
  client's clock (``time.perf_counter``), including the socket and msgpack.
- ``--no-stream``: there are no chunks, so TTFT and ITL come from the server's
  ``done.metrics`` (``ttft_ms``; ITL = (total_ms - ttft_ms) / (tokens - 1)), and
  end-to-end is still the client's.
- requests/s = successful requests / wall time; output tokens/s = their
  completion tokens / wall time. Percentiles are linear-interpolated (p50,
  p90, p99) over successful requests (TTFT, E2E) or over all gaps (ITL).
- ``--warmup N`` requests (default 2) run before the first level, untimed.
- errors = requests that ended with an ``error`` (or timed out); the first few
  messages are kept in ``error_samples``.

``--spawn`` starts a server in this process for the run (a thread running
``frontend.server.zmq_server.Server`` in front of a two-process ``Service``; tiny-random
on the CPU unless ``--model``/``--device`` say otherwise). The client and the
server loop then share one interpreter, so prefer a separate ``tandem serve``
and ``--connect`` for numbers you publish.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_HTTP = "http://127.0.0.1:8000"
PCTS = (50, 90, 99)


# --------------------------------------------------------------------------- options


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``16`` -> (16, 16); ``8:64`` -> (8, 64) (a uniform integer range, both ends included)."""
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not N or LO:HI", param_hint=name) from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise click.BadParameter(f"{text!r}: expected N or LO:HI with 1 <= LO <= HI", param_hint=name)
    return parts[0], parts[1]


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers",
                                 param_hint="--concurrency") from None
    if not levels or any(c < 1 for c in levels):
        raise click.BadParameter(f"{text!r}: concurrency levels must be >= 1", param_hint="--concurrency")
    return levels


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 by linear interpolation (None when there are no values)."""
    if not values:
        return {f"p{p}": None for p in PCTS}
    xs = sorted(values)
    out = {}
    for p in PCTS:
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 3)
    return out


# --------------------------------------------------------------------------- the load


@dataclass
class Work:
    prompt_ids: list[int]
    max_tokens: int
    images: list[bytes] = field(default_factory=list)  # with images the prompt is text: IMAGE_PROMPT

    def prompt_fields(self) -> dict:
        if self.images:
            return {"prompt": "<image>" * len(self.images) + IMAGE_PROMPT, "images": self.images}
        return {"prompt_token_ids": self.prompt_ids}

    @property
    def text(self) -> str:
        """The prompt as words, for HTTP chat (one word per token id, deterministic)."""
        return " ".join(WORDS[t % len(WORDS)] for t in self.prompt_ids)


WORDS = ("time", "river", "stone", "light", "green", "house", "quiet", "north", "paper", "music", "table", "cloud",
         "bread", "glass", "horse", "field")


@dataclass
class Sample:
    ok: bool
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    reconnects: int = 0  # HTTP: connections the server closed before answering, opened again


# Prompt token ids are drawn from this range: inside any real vocabulary (the server's info does not
# report the vocabulary size) and past the special tokens most vocabularies put first.
PROMPT_IDS = (100, 16000)


IMAGE_PROMPT = "Describe this image."


@dataclass(frozen=True)
class ImageLoad:
    per_request: int = 0  # images per request (0: text prompts of --prompt-len tokens)
    size: tuple[int, int] = (512, 384)
    distinct: int = 0  # distinct images cycled through (0: every image is new: encoder-cache misses)


def noise_png(size: tuple[int, int], seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def make_work(n: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], seed: int,
              images: ImageLoad = ImageLoad()) -> list[Work]:
    rng = random.Random(seed)
    out = []
    pool = [noise_png(images.size, seed * 1000 + i) for i in range(images.distinct)]
    for i in range(n):
        length = rng.randint(*prompt_len)
        work = Work([rng.randrange(*PROMPT_IDS) for _ in range(length)], rng.randint(*max_tokens))
        for k in range(images.per_request):
            j = i * images.per_request + k
            work.images.append(pool[j % len(pool)] if pool else noise_png(images.size, rng.randrange(1 << 30)))
        out.append(work)
    return out


async def _one(client, work: Work, stream: bool, ignore_eos: bool, timeout: float) -> Sample:
    from frontend.client import TandemError

    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.generate(**work.prompt_fields(), max_tokens=work.max_tokens, ignore_eos=ignore_eos,
                                      timeout=timeout)
            e2e = (time.perf_counter() - t0) * 1e3
            n = len(r.token_ids)
            ttft = r.metrics.get("ttft_ms")
            total = r.metrics.get("total_ms")
            itl = [(total - ttft) / (n - 1)] * (n - 1) if n > 1 and ttft is not None and total is not None else []
            return Sample(True, ttft, e2e, itl, n)
        s = client.stream(**work.prompt_fields(), max_tokens=work.max_tokens, ignore_eos=ignore_eos,
                          timeout=timeout)
        first = last = None
        itl: list[float] = []
        async for ch in s:
            now = time.perf_counter()
            if not ch.token_ids:
                continue
            if first is None:
                first = now
            else:
                gap = (now - last) * 1e3 / len(ch.token_ids)
                itl.extend([gap] * len(ch.token_ids))
            last = now
        e2e = (time.perf_counter() - t0) * 1e3
        ttft = None if first is None else (first - t0) * 1e3
        return Sample(True, ttft, e2e, itl, len(s.result.token_ids))
    except (TandemError, asyncio.TimeoutError) as e:
        return Sample(False, error=str(e)[:200])


async def _one_http(client, model: str, work: Work, stream: bool, ignore_eos: bool, timeout: float) -> Sample:
    """One OpenAI chat completion over HTTP (``client``: an ``httpx.AsyncClient``).

    A kept-alive connection that the server closed before answering (llama.cpp's server closes
    idle ones: "Server disconnected without sending a response") is opened again once, as HTTP
    clients do (the OpenAI SDK retries connection errors): the request never reached the engine.
    Its latency counts from the first attempt."""
    import httpx

    t0 = time.perf_counter()
    for attempt in range(2):
        answered: list[bool] = []
        try:
            sample = await _http_attempt(client, model, work, stream, ignore_eos, timeout, t0, answered)
        except httpx.RemoteProtocolError as e:
            if attempt or answered:
                sample = Sample(False, error=f"{type(e).__name__}: {e}"[:200])
            else:
                continue
        except (httpx.HTTPError, asyncio.TimeoutError) as e:
            sample = Sample(False, error=f"{type(e).__name__}: {e}"[:200])
        sample.reconnects = attempt
        return sample


async def _http_attempt(client, model: str, work: Work, stream: bool, ignore_eos: bool, timeout: float,
                        t0: float, answered: list) -> Sample:
    """``_one_http``'s request on ``client``; appends to ``answered`` once a response status came."""
    body = {"model": model, "messages": [{"role": "user", "content": work.text}], "max_tokens": work.max_tokens,
            "temperature": 0, "ignore_eos": ignore_eos, "stream": stream}
    if not stream:
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
            answered.append(True)
            text = (await r.aread()).decode(errors="replace")
        if r.status_code != 200:
            return Sample(False, error=f"HTTP {r.status_code}: {text[:160]}")
        return Sample(True, None, (time.perf_counter() - t0) * 1e3, [], json.loads(text)["usage"]["completion_tokens"])
    body["stream_options"] = {"include_usage": True}
    first = last = None
    itl: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
        answered.append(True)
        if r.status_code != 200:
            return Sample(False, error=f"HTTP {r.status_code}: {(await r.aread())[:160]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            if "error" in event:
                return Sample(False, error=str(event["error"])[:200])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if not (event["choices"] and event["choices"][0]["delta"].get("content")):
                continue
            if first is None:
                first = now
            else:
                itl.append((now - last) * 1e3)
            last = now
    e2e = (time.perf_counter() - t0) * 1e3
    return Sample(True, None if first is None else (first - t0) * 1e3, e2e, itl, tokens)


async def run_level(endpoint: str, concurrency: int, work: list[Work], stream: bool, ignore_eos: bool,
                    timeout: float, on_done=None, http: tuple[str, str] | None = None) -> dict:
    """One level; over HTTP when ``http`` is (base URL, model name), else over ZeroMQ at ``endpoint``."""
    if http is None:
        from frontend.client import AsyncClient

        clients = [AsyncClient(endpoint, timeout=timeout) for _ in range(concurrency)]
        one = lambda c, w: _one(c, w, stream, ignore_eos, timeout)  # noqa: E731
    else:
        import httpx

        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        clients = [httpx.AsyncClient(base_url=http[0], limits=limits, timeout=timeout) for _ in range(concurrency)]
        one = lambda c, w: _one_http(c, http[1], w, stream, ignore_eos, timeout)  # noqa: E731
    queue = list(reversed(work))
    samples: list[Sample] = []

    async def worker(client) -> None:
        while queue:
            w = queue.pop()
            samples.append(await one(client, w))
            if on_done is not None:
                on_done()

    try:
        for c in clients:  # connect before the clock starts
            await (c.ping(timeout=timeout) if http is None else c.get("/health"))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await (c.close() if http is None else c.aclose())
    ok = [s for s in samples if s.ok]
    out_tokens = sum(s.output_tokens for s in ok)
    return {
        "transport": "zmq" if http is None else "http",
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "reconnects": sum(s.reconnects for s in samples),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "ttft_ms": percentiles([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "itl_ms": percentiles([g for s in ok for g in s.itl_ms]),
        "e2e_ms": percentiles([s.e2e_ms for s in ok if s.e2e_ms is not None]),
        "error_samples": [s.error for s in samples if not s.ok][:5],
    }


# --------------------------------------------------------------------------- an in-process server


class SpawnedServer:
    """``Server`` + ``Service`` on a thread of this process, for ``--spawn``."""

    def __init__(self, model: str, device: str, max_batch: int, kv_pages: int | None) -> None:
        from frontend.http import HttpListener
        from frontend.server.zmq_server import Server
        from frontend.server.service import Service, ServiceConfig

        self.service = Service(ServiceConfig(model=model, device=device, max_batch=max_batch, kv_pages=kv_pages))
        try:
            self.server = Server(self.service, "tcp://127.0.0.1:0")
            self.http = HttpListener(self.server, "127.0.0.1", 0).start()
        except Exception:
            self.service.close()
            raise
        self.endpoint = self.server.endpoint
        self.thread = threading.Thread(target=self.server.serve_forever, name="tandem-bench-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.stop()
        self.server.stop()
        self.thread.join(60)


# --------------------------------------------------------------------------- the command


def _fmt(p: dict) -> str:
    return " / ".join("-" if v is None else f"{v:.1f}" for v in (p["p50"], p["p90"], p["p99"]))


def table(result: dict) -> str:
    lines = [
        f"model {result['model']} on {result['device']} via {result['endpoint']}; stream={result['stream']}, "
        f"prompt_len={result['prompt_len']}, max_tokens={result['max_tokens']}, ignore_eos={result['ignore_eos']}, "
        f"images={result['images']}",
        "",
        "| transport | concurrency | requests | errors | req/s | output tok/s | TTFT ms p50/p90/p99 "
        "| ITL ms p50/p90/p99 | E2E ms p50/p90/p99 |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for lv in result["levels"]:
        lines.append(f"| {lv['transport']} | {lv['concurrency']} | {lv['requests']} | {lv['errors']} | "
                     f"{lv['requests_per_s']:.2f} | "
                     f"{lv['output_tokens_per_s']:.1f} | {_fmt(lv['ttft_ms'])} | {_fmt(lv['itl_ms'])} | "
                     f"{_fmt(lv['e2e_ms'])} |")
    return "\n".join(lines)


def run(connect: str | None, spawn: bool, model: str | None, device: str | None, concurrency: list[int],
        requests: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], stream: bool, ignore_eos: bool,
        warmup: int, seed: int, timeout: float, max_batch: int, kv_pages: int | None, quiet: bool,
        transport: str = "zmq", http_url: str | None = None, images: ImageLoad = ImageLoad()) -> dict:
    from frontend.client import Client

    spawned = None
    if spawn:
        model = model or "tiny-random"
        device = device or "cpu"
        if not quiet:
            click.echo(f"bench serve: starting {model} on {device} in-process (worker warm-up) ...", err=True)
        spawned = SpawnedServer(model, device, max_batch, kv_pages)
        endpoint = spawned.endpoint
        http_url = spawned.http.url
    else:
        endpoint = connect or DEFAULT_ENDPOINT
    try:
        with Client(endpoint, timeout=min(timeout, 30.0)) as c:
            try:
                info = c.info()
            except TimeoutError:
                raise click.ClickException(f"no Tandem server answered at {endpoint} within "
                                           f"{min(timeout, 30.0):g} s (start one with `tandem serve`, "
                                           f"or use --spawn)") from None
        max_len = int(info.get("max_model_len") or 2048)
        if prompt_len[1] + max_tokens[1] >= max_len:
            raise click.BadParameter(f"prompt_len + max_tokens must stay below the server's max_model_len "
                                     f"{max_len}", param_hint="--prompt-len/--max-tokens")
        http_url = http_url or DEFAULT_HTTP
        transports = {"zmq": [None], "http": [(http_url, info.get("model"))],
                      "both": [None, (http_url, info.get("model"))]}[transport]
        levels = []
        total = (warmup + requests * len(concurrency)) * len(transports)
        bar_file = open(os.devnull, "w") if quiet else sys.stderr
        try:
            with click.progressbar(length=total, label="bench serve", file=bar_file, show_pos=True,
                                   show_eta=True) as bar:
                for http in transports:
                    if warmup:
                        asyncio.run(run_level(endpoint, 1, make_work(warmup, prompt_len, max_tokens, seed + 1,
                                                                     images),
                                              stream, ignore_eos, timeout, lambda: bar.update(1), http))
                for conc in concurrency:
                    for http in transports:  # side by side: each level over each transport in turn
                        bar.label = f"bench serve c={conc} {'zmq' if http is None else 'http'}"
                        work = make_work(requests, prompt_len, max_tokens, seed, images)
                        levels.append(asyncio.run(run_level(endpoint, conc, work, stream, ignore_eos, timeout,
                                                            lambda: bar.update(1), http)))
        finally:
            if quiet:
                bar_file.close()
    finally:
        if spawned is not None:
            spawned.close()
    return {
        "model": info.get("model"),
        "device": info.get("device"),
        "pipeline": info.get("pipeline"),
        "max_batch": info.get("max_batch"),
        "endpoint": "spawned in-process" if spawn else endpoint,
        "transport": transport,
        "http_url": None if transport == "zmq" else ("spawned in-process" if spawn else http_url),
        "stream": stream,
        "prompt_len": _range_text(prompt_len),
        "max_tokens": _range_text(max_tokens),
        "ignore_eos": ignore_eos,
        "images": {"per_request": images.per_request, "size": "x".join(map(str, images.size)),
                   "distinct": images.distinct},
        "requests_per_level": requests,
        "warmup": warmup,
        "seed": seed,
        "timing": "client clock (chunk arrivals)" if stream else "server metrics for TTFT/ITL, client clock for E2E",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "levels": levels,
    }


def _range_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


@click.command("serve")
@click.option("--connect", default=None, help=f"Endpoint of a running server [default: {DEFAULT_ENDPOINT}].")
@click.option("--spawn", is_flag=True, help="Start a server in this process for the run (tiny-random on cpu "
              "unless --model/--device).")
@click.option("--model", default=None, help="With --spawn: smollm2-135m | tiny-random | PATH [default: tiny-random].")
@click.option("--device", default=None, help="With --spawn: auto | cpu | cuda | sim:MS [default: cpu].")
@click.option("--max-batch", default=64, show_default=True, help="With --spawn: batch rows.")
@click.option("--kv-pages", type=int, default=None, help="With --spawn: KV cache pages (default: sized to memory).")
@click.option("--transport", type=click.Choice(["zmq", "http", "both"]), default="zmq", show_default=True,
              help="ZeroMQ, HTTP (OpenAI chat streaming), or both side by side.")
@click.option("--http-url", default=None, help=f"The server's HTTP address [default: {DEFAULT_HTTP}].")
@click.option("--concurrency", default="1,8,32", show_default=True, help="Comma-separated concurrent clients.")
@click.option("--requests", "n_requests", default=32, show_default=True, type=click.IntRange(1),
              help="Requests per concurrency level.")
@click.option("--prompt-len", default="32", show_default=True, help="Prompt tokens: N or LO:HI (uniform).")
@click.option("--max-tokens", default="64", show_default=True, help="Answer tokens: N or LO:HI (uniform).")
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Every answer runs to its max_tokens (comparable lengths).")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0), help="Untimed requests first.")
@click.option("--seed", default=0, show_default=True)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds per request.")
@click.option("--images", "n_images", default=0, show_default=True, type=click.IntRange(0, 8),
              help="Images per request (a vision model; the prompt is then '<image>...Describe this image.').")
@click.option("--image-size", default="512x384", show_default=True, help="WxH of the random images.")
@click.option("--distinct-images", default=0, show_default=True, type=click.IntRange(0),
              help="Cycle through this many distinct images (encoder-cache hits); 0: every image new (misses).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def serve_command(connect, spawn, model, device, max_batch, kv_pages, transport, http_url, concurrency, n_requests,
                  prompt_len, max_tokens, stream, ignore_eos, warmup, seed, timeout, n_images, image_size,
                  distinct_images, as_json, quiet):
    """Load a Tandem server over ZeroMQ and/or HTTP: throughput and TTFT / inter-token / end-to-end latency.

    \b
    Examples:
      tandem bench serve --connect tcp://127.0.0.1:5557 --concurrency 1,8,32 --requests 64
      tandem bench serve --spawn --concurrency 1,4 --requests 8 --max-tokens 8:32 --json
      tandem bench serve --connect ipc:///run/tandem/api.sock --no-stream --prompt-len 128:512
      tandem bench serve --spawn --transport both --concurrency 1,8,32
      tandem bench serve --spawn --model random-smolvlm-256m --images 1 --distinct-images 1 --concurrency 1
    """
    if connect and spawn:
        raise click.UsageError("use either --connect or --spawn")
    if not spawn and (model or device):
        raise click.UsageError("--model/--device choose what --spawn starts; a running server reports its own")
    try:
        width, height = (int(x) for x in image_size.lower().split("x"))
    except ValueError:
        raise click.BadParameter("expected WxH, e.g. 512x384", param_hint="--image-size") from None
    if n_images and transport != "zmq":
        raise click.BadParameter("images are sent over the ZeroMQ transport only", param_hint="--images")
    images = ImageLoad(n_images, (width, height), distinct_images)
    result = run(connect, spawn, model, device, parse_levels(concurrency), n_requests,
                 parse_range(prompt_len, "--prompt-len"), parse_range(max_tokens, "--max-tokens"), stream,
                 ignore_eos, warmup, seed, timeout, max_batch, kv_pages, quiet, transport, http_url, images)
    click.echo(json.dumps(result) if as_json else table(result))
    return result


def main(argv=None) -> dict:
    """Run the command (``python -m bench.serve ...``); returns the result dict."""
    return serve_command.main(args=argv, prog_name="tandem bench serve", standalone_mode=False)


if __name__ == "__main__":
    try:
        main()
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)

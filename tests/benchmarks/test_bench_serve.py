"""Smoke tests of the serving benchmark on the tiny model: it runs in seconds against a server it
spawns in-process and emits every field of its JSON. No timing thresholds (timings belong to
BENCHMARKS.md)."""
from __future__ import annotations

import asyncio
import json

import click
import pytest
from click.testing import CliRunner

from bench import serve

pytestmark = pytest.mark.slow

LEVEL_FIELDS = {"transport", "concurrency", "requests", "errors", "reconnects", "requests_per_s", "output_tokens_per_s", "ttft_ms", "itl_ms",
                "e2e_ms"}
PCT_FIELDS = {"p50", "p90", "p99"}
QUICK = ["--spawn", "--model", "tiny-random", "--device", "cpu", "--max-batch", "8", "--kv-pages", "200",
         "--requests", "4", "--prompt-len", "4:12", "--max-tokens", "3:6", "--warmup", "1", "--seed", "5"]


def check_result(result: dict, levels: list[int], stream: bool, transports=("zmq",)) -> None:
    assert result["model"] == "tiny-random" and result["device"] == "cpu"
    assert result["stream"] is stream
    assert [(lv["concurrency"], lv["transport"]) for lv in result["levels"]] == \
        [(c, t) for c in levels for t in transports]
    for lv in result["levels"]:
        assert LEVEL_FIELDS <= lv.keys(), LEVEL_FIELDS - lv.keys()
        assert lv["requests"] == 4 and lv["errors"] == 0, lv.get("error_samples")
        assert lv["requests_per_s"] > 0 and lv["output_tokens_per_s"] > 0
        assert 4 * 3 <= lv["output_tokens"] <= 4 * 6  # ignore_eos: every answer is max_tokens long
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            p = lv[key]
            assert set(p) == PCT_FIELDS, (key, p)
            assert all(isinstance(p[k], float) and p[k] >= 0 for k in PCT_FIELDS), (key, p)
            assert p["p50"] <= p["p90"] <= p["p99"], (key, p)
        assert lv["ttft_ms"]["p50"] <= lv["e2e_ms"]["p99"]


def test_spawn_two_levels_json():
    res = CliRunner().invoke(serve.serve_command, [*QUICK, "--concurrency", "1,3", "--json"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    result = json.loads(res.stdout)  # exactly one JSON object on stdout; the progress bar is on stderr
    check_result(result, [1, 3], stream=True)
    assert result["endpoint"] == "spawned in-process"
    assert "bench serve" in res.stderr


def test_no_stream_and_table(capsys):
    result = serve.main([*QUICK, "--concurrency", "2", "--no-stream", "--quiet"])
    check_result(result, [2], stream=False)
    out = capsys.readouterr().out
    assert "| transport | concurrency | requests | errors |" in out and "\n| zmq | 2 | 4 | 0 |" in out


def test_both_transports_side_by_side():
    res = CliRunner().invoke(serve.serve_command, [*QUICK, "--concurrency", "2", "--transport", "both", "--json"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    result = json.loads(res.stdout)
    check_result(result, [2], stream=True, transports=("zmq", "http"))
    zmq_level, http_level = result["levels"]
    assert zmq_level["output_tokens"] == http_level["output_tokens"]  # the same answers' lengths over both


def test_option_errors():
    assert serve.parse_range("16", "--x") == (16, 16) and serve.parse_range("8:64", "--x") == (8, 64)
    for bad in ("0", "9:3", "a", "1:2:3"):
        with pytest.raises(click.BadParameter):
            serve.parse_range(bad, "--x")
    assert serve.parse_levels("1,8,32") == [1, 8, 32]
    assert serve.percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert serve.percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"p50": 3.0, "p90": 4.6, "p99": 4.96}
    runner = CliRunner()
    for argv, text in ((["--concurrency", "0"], "concurrency"), (["--spawn", "--connect", "tcp://x:1"], "either"),
                       (["--model", "tiny-random"], "--spawn")):
        res = runner.invoke(serve.serve_command, argv)
        assert res.exit_code != 0 and text in res.output, res.output


class _DroppingServer:
    """A loopback HTTP/1.1 chat-completions stand-in: it reads request number n (1, 2, ...) and,
    if n is in ``drop``, closes the connection without a response (as a server closing a
    kept-alive connection the client just sent on); it answers the others with three tokens (SSE
    when asked to stream), keeping the connection alive."""

    def __init__(self, drop: set[int]):
        self.drop, self.requests = drop, 0

    async def handle(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = json.loads(await reader.readexactly(length))
                self.requests += 1
                if self.requests in self.drop:
                    writer.close()
                    return
                if body.get("stream"):
                    events = [{"choices": [{"delta": {"content": "x"}}]}] * 3 + [
                        {"choices": [], "usage": {"completion_tokens": 3}}]
                    payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                    kind = "text/event-stream"
                else:
                    payload, kind = json.dumps({"usage": {"completion_tokens": 3}}), "application/json"
                data = payload.encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (kind.encode(), len(data), data))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.CancelledError, ConnectionError):
            return  # the client closed its connection: the test is over


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_http_client_reopens_a_connection_the_server_closed_once(stream):
    """A connection closed before any response (llama.cpp's server closes idle kept-alive ones)
    is opened again once: the request succeeds. Closed twice in a row, it is an error sample."""
    import httpx

    async def go(drop: set[int]):
        server = _DroppingServer(drop)
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            async with httpx.AsyncClient(base_url=url) as client:
                work = serve.Work([1, 2, 3], 3)
                return [await serve._one_http(client, "m", work, stream, True, 10.0) for _ in range(3)], server
        finally:
            srv.close()

    samples, server = asyncio.run(go({2}))  # the 2nd request's connection is dropped: retried as the 3rd
    assert [s.ok for s in samples] == [True] * 3 and server.requests == 4
    assert all(s.output_tokens == 3 for s in samples) and [s.reconnects for s in samples] == [0, 1, 0]
    samples, server = asyncio.run(go({1, 2}))  # dropped, and dropped again on the new connection
    assert not samples[0].ok and "RemoteProtocolError" in samples[0].error and samples[0].reconnects == 1
    assert [s.ok for s in samples[1:]] == [True, True] and server.requests == 4

"""frontend.client against a small fake ROUTER server (using frontend.protocol) in a thread."""
from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import threading
import time

import pytest
import zmq

from frontend import client as C
from frontend.protocol.wire import (CHAT_TEMPLATE_FIELDS, CancelRequest, ERROR_CODES, GenerateRequest, InfoRequest,
                                    PingRequest, SKILL_FIELDS, VERSION_FRAME)
from frontend.protocol.parse import ProtocolError, parse_client_message
from frontend.protocol.encode import encode_chunk, encode_done, encode_error, encode_info, encode_pong
from frontend.client import (
    AsyncClient,
    BadRequest,
    Chunk,
    Client,
    ConnectionClosed,
    DuplicateId,
    Overloaded,
    RequestTimeout,
    Result,
    TandemError,
    TooLong,
)
from shared.sampling import SAMPLING_FIELD_NAMES, SamplingParams


class FakeServer(threading.Thread):
    """Answers generate with one token per tick per live request (so replies of
    concurrent requests interleave), honours cancel, answers ping/info.

    Special prompts: "error" -> overloaded error; "hang" -> no answer at all;
    "unattributed" -> a too_long error with a nil id; "junk" -> garbage frames
    first, then a normal answer.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.halt = threading.Event()
        self.live: dict[tuple[bytes, str], dict] = {}
        self.cancels: list[str] = []
        self.requests: dict[str, GenerateRequest] = {}  # every generate parsed, by id

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        self.sock.send_multipart([ident, *frames])

    def handle(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            req = parse_client_message(frames)
        except ProtocolError as e:
            self.send(ident, e.to_frames())
            return
        if isinstance(req, PingRequest):
            self.send(ident, encode_pong(req.nonce))
        elif isinstance(req, InfoRequest):
            self.send(ident, encode_info("fake-model", 8, 2048, True, "cpu"))
        elif isinstance(req, CancelRequest):
            self.cancels.append(req.id)
            st = self.live.pop((ident, req.id), None)
            if st is not None:
                self.finish(ident, st, "cancelled")
        else:
            self.requests[req.id] = req
            key = (ident, req.id)
            if key in self.live:
                self.send(ident, encode_error(req.id, "duplicate_id", f"id {req.id} is live"))
                return
            if req.prompt == "error":
                self.send(ident, encode_error(req.id, "overloaded", "server is full"))
                return
            if req.prompt == "unattributed":
                self.send(ident, encode_error(None, "too_long", "message too big"))
                return
            if req.prompt == "junk":
                self.send(ident, [b"TANDEM9", b"\x80"])
                self.send(ident, [VERSION_FRAME, b"\xc1"])
                self.send(ident, [VERSION_FRAME])
            if req.prompt == "hang":
                return
            self.live[key] = {"req": req, "n": 0, "text": "", "ids": [], "t0": time.monotonic()}

    def finish(self, ident: bytes, st: dict, reason: str) -> None:
        req = st["req"]
        output = None
        if req.grammar and req.grammar.get("kind") == "point":
            output = {"points": [{"x": 0.25, "y": 0.75}]}
        elif req.grammar and req.grammar.get("kind") == "box":
            output = {"objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4}]}
        self.send(
            ident,
            encode_done(
                req.id, reason, st["text"], st["ids"],
                {"prompt_tokens": 3, "completion_tokens": len(st["ids"])},
                {"ttft_ms": 1.0, "total_ms": (time.monotonic() - st["t0"]) * 1000},
                output=output,
                logprobs=[-0.5] * len(st["ids"]) if req.logprobs else None,
            ),
        )

    def tick(self) -> None:
        for key, st in list(self.live.items()):
            ident, rid = key
            req = st["req"]
            word = req.prompt if req.prompt is not None else (
                req.messages[-1]["content"] if req.messages else f"ids{len(req.prompt_token_ids)}"
            )
            piece, tid = f" {word}{st['n']}", 1000 + st["n"]
            if req.stream:
                self.send(ident, encode_chunk(rid, st["n"], piece, [tid]))
            st["n"] += 1
            st["text"] += piece
            st["ids"].append(tid)
            if st["n"] >= req.max_tokens:
                del self.live[key]
                self.finish(ident, st, "length")

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.halt.is_set():
            if poller.poll(2):
                while True:
                    try:
                        ident, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(ident, frames)
            self.tick()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    s.start()
    yield s
    s.halt.set()
    s.join(5)


@pytest.fixture
def client(server):
    c = Client(server.endpoint, timeout=10)
    yield c
    c.close()


def expected(word: str, n: int) -> str:
    return "".join(f" {word}{i}" for i in range(n))


# --------------------------------------------------------------------------- sync


def test_generate(client):
    r = client.generate("hello", max_tokens=4, temperature=0.7, top_p=0.9, stop=["x"], seed=1)
    assert isinstance(r, Result)
    assert r.text == expected("hello", 4)
    assert r.token_ids == [1000, 1001, 1002, 1003]
    assert r.finish_reason == "length"
    assert r.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    assert set(r.metrics) == {"ttft_ms", "total_ms"}
    assert r.output is None and r.logprobs is None
    assert len(r.id) == 32  # uuid4 hex


def test_generate_messages_token_ids_and_request_id(client):
    r = client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2, request_id="my-id")
    assert r.id == "my-id" and r.text == expected("hi", 2)
    r = client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1, logprobs=True)
    assert r.text == " ids30" and r.logprobs == [-0.5]


def test_choices_are_requests_of_their_own_with_seed_plus_i(client, server):
    rs = client.choices("ch", n=3, max_tokens=2, seed=2 ** 64 - 2, request_id="many")
    assert [r.id for r in rs] == ["many", "many-1", "many-2"] and [r.text for r in rs] == [expected("ch", 2)] * 3
    assert [server.requests[r.id].seed for r in rs] == [2 ** 64 - 2, 2 ** 64 - 1, 0]  # wrapped to 64 bits
    assert client.choices("one", n=1, max_tokens=1)[0].text == " one0"
    for bad in (0, 17, True):
        with pytest.raises(ValueError, match="n must be"):
            client.choices("x", n=bad)
    with pytest.raises(ValueError, match="id"):  # the last choice's id would be too long: nothing is sent
        client.choices("x", n=12, request_id="i" * 127)
    with pytest.raises(Overloaded):  # an error in one choice is raised; the others are cancelled
        client.choices("error", n=2)

    async def main() -> list[Result]:
        async with AsyncClient(server.endpoint, timeout=10) as c:
            return await c.choices("ach", n=2, max_tokens=3, seed=5)

    rs = asyncio.run(main())
    assert [r.text for r in rs] == [expected("ach", 3)] * 2 and [server.requests[r.id].seed for r in rs] == [5, 6]


def test_stream_concatenation_equals_done_text(client):
    s = client.stream("abc", max_tokens=6)
    chunks = list(s)
    assert all(isinstance(c, Chunk) for c in chunks)
    assert [c.seq for c in chunks] == list(range(6))
    assert "".join(c.text for c in chunks) == s.result.text == expected("abc", 6)
    assert [t for c in chunks for t in c.token_ids] == s.result.token_ids
    assert s.result.finish_reason == "length"


def test_concurrent_threads_one_client(client):
    results: dict[int, Result] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            if i % 2:
                results[i] = client.generate(f"p{i}", max_tokens=5 + i % 3)
            else:
                s = client.stream(f"p{i}", max_tokens=5 + i % 3)
                text = "".join(c.text for c in s)
                assert text == s.result.text
                results[i] = s.result
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    for i in range(16):
        assert results[i].text == expected(f"p{i}", 5 + i % 3)


def test_interleaved_streams_one_thread(client):
    streams = [client.stream(f"s{i}", max_tokens=4) for i in range(5)]
    texts = ["" for _ in streams]
    for _ in range(4):  # round-robin: others' chunks are buffered meanwhile
        for i, s in enumerate(streams):
            texts[i] += next(s).text
    for i, s in enumerate(streams):
        assert list(s) == []
        assert texts[i] == s.result.text == expected(f"s{i}", 4)


def test_cancel_stream(client, server):
    s = client.stream("long", max_tokens=100000)
    first = [next(s), next(s)]
    s.cancel()
    rest = list(s)
    assert s.result.finish_reason == "cancelled"
    assert "".join(c.text for c in first + rest) == s.result.text
    assert s.id in server.cancels


def test_abandoned_stream_is_cancelled(client, server):
    import gc

    s = client.stream("long", max_tokens=100000, request_id="abandoned")
    next(s)
    del s
    gc.collect()
    client.ping()  # any later send flushes a cancel deferred by the finaliser
    deadline = time.monotonic() + 2
    while "abandoned" not in server.cancels and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "abandoned" in server.cancels


def test_cancel_generate_from_other_thread(client):
    rid = "to-cancel"
    threading.Timer(0.1, client.cancel, args=(rid,)).start()
    r = client.generate("long", max_tokens=100000, request_id=rid)
    assert r.finish_reason == "cancelled" and r.id == rid
    client.cancel("unknown-id")  # ignored by the server
    assert client.generate("ok", max_tokens=1).text == " ok0"


def test_typed_errors(client):
    with pytest.raises(Overloaded) as ei:
        client.generate("error", request_id="e1")
    assert isinstance(ei.value, TandemError)
    assert ei.value.code == "overloaded" and ei.value.id == "e1" and ei.value.message == "server is full"
    with pytest.raises(BadRequest) as ei:
        client.generate("x", top_p=1.5)
    assert ei.value.code == "bad_request" and ei.value.message == "top_p must be in (0, 1], got 1.5"
    with pytest.raises(TandemError) as ei:
        list(client.stream("error"))
    assert ei.value.code == "overloaded"
    # connection still usable
    assert client.generate("after", max_tokens=1).text == " after0"


def test_unattributed_error_goes_to_sole_waiter(client):
    with pytest.raises(TooLong) as ei:
        client.generate("unattributed")
    assert ei.value.code == "too_long"


def test_garbage_from_server_is_ignored(client):
    assert client.generate("junk", max_tokens=2).text == expected("junk", 2)


def test_timeout_raises_and_cancels(client, server):
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout) as ei:
        client.generate("hang", timeout=0.2, request_id="hang-1")
    assert isinstance(ei.value, TimeoutError) and ei.value.code == "timeout"
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        list(client.stream("long", max_tokens=100000, timeout=0.2))
    deadline = time.monotonic() + 2
    while "hang-1" not in server.cancels and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "hang-1" in server.cancels


def test_client_default_timeout(server):
    with Client(server.endpoint, timeout=0.2) as c:
        with pytest.raises(RequestTimeout):
            c.generate("hang")


def test_ping_info_point_detect(client):
    assert 0 <= client.ping() < 5
    info = client.info()
    assert info == {"protocol": 1, "model": "fake-model", "max_batch": 8, "max_model_len": 2048,
                    "pipeline": True, "device": "cpu"}
    assert client.point(b"img", "the cat", max_objects=3, max_tokens=2) == {"points": [{"x": 0.25, "y": 0.75}]}
    assert client.detect(b"img", "the cat", max_tokens=2)["objects"][0]["x_max"] == 0.3


def test_every_sampling_field_reaches_the_server(client, server):
    """The client's options are SamplingParams' fields: each one set arrives in the parsed request."""
    params = SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9, top_k=5, seed=11,
                            stop_token_ids=(3, 4), ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.1, min_p=0.05, logit_bias={5: -100.0}, min_tokens=2,
                            include_stop_str_in_output=True, skip_special_tokens=False)
    default = SamplingParams()
    unset = [n for n in SAMPLING_FIELD_NAMES if getattr(params, n) == getattr(default, n)]
    assert not unset, f"give these fields a non-default value in this test: {unset}"
    options = {n: getattr(params, n) for n in SAMPLING_FIELD_NAMES}
    client.generate("x", request_id="all-sampling", **options)
    assert server.requests["all-sampling"].sampling == params
    assert C.GENERATE_OPTIONS == set(SAMPLING_FIELD_NAMES) | {"stop", "logprobs", "top_logprobs", "grammar", "adapter", "images",
                                                              "skill", *SKILL_FIELDS, *CHAT_TEMPLATE_FIELDS,
                                                              "truncate_prompt_tokens"}


def test_every_error_code_has_its_exception_class():
    for code in ERROR_CODES:
        e = TandemError.from_code(code, "m", "i")
        assert type(e) is not TandemError and e.code == code and e.id == "i"
    assert type(TandemError.from_code("new_code", "m")) is TandemError  # unknown codes still raise


def test_local_validation(client):
    with pytest.raises(ValueError, match="exactly one of"):
        client.generate()
    with pytest.raises(ValueError, match="exactly one of"):
        client.generate("a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="request_id"):
        client.generate("a", request_id="x" * 129)
    with pytest.raises(TypeError, match="unknown generate option.*max_token;"):
        client.generate("a", max_token=5)
    with pytest.raises(TypeError, match="unknown generate option.*stream;"):  # set by the method called
        client.stream("a", stream=False)
    s = client.stream("long", max_tokens=100000, request_id="dup")
    with pytest.raises(DuplicateId):
        client.generate("a", request_id="dup")
    with pytest.raises(DuplicateId):
        client.stream("a", request_id="dup")
    import gc

    gc.collect()  # the rejected Stream objects must not unregister the live one
    next(s)
    s.cancel()
    list(s)
    assert s.result.finish_reason == "cancelled"


def test_close_fails_waiters_and_later_calls(server):
    c = Client(server.endpoint)
    box: list[BaseException] = []

    def wait() -> None:
        try:
            c.generate("hang")
        except BaseException as e:
            box.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    c.close()
    t.join(5)
    assert len(box) == 1 and isinstance(box[0], ConnectionClosed)
    with pytest.raises(ConnectionClosed):
        c.generate("x")
    c.close()  # idempotent


def test_docs_python_examples_run(server, capsys):
    """The Python examples in docs/PROTOCOL.md run (against the fake server)."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 4
    for code in blocks:
        code = code.replace("tcp://127.0.0.1:5557", server.endpoint)
        exec(compile(code, "docs/PROTOCOL.md", "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    assert "The capital of France is0" in out and "[length]" in out


def test_version_frame_matches_protocol():
    assert C.VERSION_FRAME == VERSION_FRAME


def test_importable_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import frontend.client, frontend.protocol.parse, frontend.protocol.encode\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- async


def test_async_client(server):
    async def main() -> None:
        async with AsyncClient(server.endpoint, timeout=10) as c:
            r = await c.generate("hi", max_tokens=3)
            assert r.text == expected("hi", 3) and r.finish_reason == "length"

            s = c.stream("st", max_tokens=5)
            chunks = [ch async for ch in s]
            assert [ch.seq for ch in chunks] == list(range(5))
            assert "".join(ch.text for ch in chunks) == s.result.text == expected("st", 5)

            rs = await asyncio.gather(*(c.generate(f"a{i}", max_tokens=3 + i % 4) for i in range(12)))
            assert [r.text for r in rs] == [expected(f"a{i}", 3 + i % 4) for i in range(12)]

            async with c.stream("long", max_tokens=100000) as s:
                n = 0
                async for _ in s:
                    n += 1
                    if n == 2:
                        await s.cancel()
            assert s.result.finish_reason == "cancelled"

            with pytest.raises(Overloaded) as ei:
                await c.generate("error")
            assert ei.value.code == "overloaded"
            with pytest.raises(RequestTimeout):
                await c.generate("hang", timeout=0.2)
            with pytest.raises(TimeoutError):
                await c.generate("hang", timeout=0.2)

            assert await c.ping() >= 0
            assert (await c.info())["model"] == "fake-model"
            assert (await c.point(b"img", "x", max_tokens=1))["points"]
            assert (await c.detect(b"img", "x", max_tokens=1))["objects"]
            assert (await c.generate("after", max_tokens=1)).text == " after0"
        with pytest.raises(ConnectionClosed):
            await c.generate("x")

    asyncio.run(main())


def test_async_close_fails_waiters(server):
    async def main() -> None:
        c = AsyncClient(server.endpoint)
        task = asyncio.ensure_future(c.generate("hang"))
        await asyncio.sleep(0.1)
        await c.close()
        with pytest.raises(ConnectionClosed):
            await task

    asyncio.run(main())


def test_skills_send_one_image_with_their_prompt_and_defaults(client, server, tmp_path):
    """caption/query sample with Moondream's defaults (0.5, top_p 0.3), point/detect are greedy under
    their grammar with Moondream's max_objects (50); the image goes as encoded bytes whether given as a
    path, bytes or a PIL image."""
    from PIL import Image

    path = tmp_path / "x.png"
    Image.new("RGB", (4, 3), (255, 0, 0)).save(path)
    data = path.read_bytes()

    def last():
        return list(server.requests.values())[-1]

    assert set(client.caption(str(path), length="short", max_tokens=2)) == {"caption"}
    req = last()
    assert req.images == (data,) and (req.temperature, req.top_p, req.max_tokens) == (0.5, 0.3, 2)
    assert req.messages[0]["content"][0] == {"type": "image"}
    assert set(client.query(data, "What colour?", max_tokens=1)) == {"answer"}
    assert "What colour?" in last().messages[0]["content"][1]["text"] and last().temperature == 0.5
    assert client.point(Image.open(path), "the cat", max_objects=2, max_tokens=1)["points"]
    req = last()
    assert req.temperature == 0.0 and req.grammar == {"kind": "point", "max_objects": 2}
    assert Image.open(io.BytesIO(req.images[0])).getpixel((0, 0)) == (255, 0, 0)
    client.detect(data, "dogs", max_tokens=1)
    assert last().grammar == {"kind": "box", "max_objects": 50}
    with pytest.raises(ValueError, match="length"):
        client.caption(data, length="epic")
    with pytest.raises(TypeError, match="an image must be"):
        client.generate("<image>x", images=[123])

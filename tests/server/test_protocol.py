"""frontend.protocol (parse, encode): validation with precise messages, fuzzing, encoders."""
from __future__ import annotations

import math
import random

import msgpack
import pytest

from frontend.protocol.wire import (DEFAULT_LIMITS, ERROR_CODES, VERSION_FRAME, CancelRequest, GenerateRequest,
                                    InfoRequest, Limits, PingRequest)
from frontend.protocol.parse import ProtocolError, parse_client_message
from frontend.protocol.encode import encode_chunk, encode_done, encode_error, encode_info, encode_pong
from shared.sampling import SAMPLING_FIELDS, SamplingParams


def frames(msg) -> list[bytes]:
    return [VERSION_FRAME, msgpack.packb(msg, use_bin_type=True)]


def parse(msg, limits=None):
    return parse_client_message(frames(msg), limits)


def gen(**kw):
    return {"type": "generate", "id": "r1", "prompt": "hello", **kw}


def err(msg, limits=None) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        parse(msg, limits)
    return ei.value


def decode(fr: list[bytes]) -> dict:
    assert len(fr) == 2 and fr[0] == VERSION_FRAME
    return msgpack.unpackb(fr[1], raw=False)


# --------------------------------------------------------------------------- valid messages


def test_generate_defaults():
    r = parse(gen())
    assert r == GenerateRequest(id="r1", prompt="hello")
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed) == (None, 0.0, 1.0, 0, None)
    assert (r.stop, r.stop_token_ids, r.ignore_eos, r.stream, r.logprobs, r.grammar) == ((), (), False, True, False, None)
    assert r.sampling == SamplingParams()


def test_generate_all_fields():
    g = {"kind": "json_schema", "schema": {"type": "object"}}
    r = parse(gen(max_tokens=7, temperature=1, top_p=0.5, top_k=40, seed=2**64 - 1, stop=["\n", "END"],
                  stop_token_ids=[0, 2], ignore_eos=True, stream=False, logprobs=True, grammar=g))
    assert r.temperature == 1.0 and isinstance(r.temperature, float)
    assert r.stop == ("\n", "END") and r.stop_token_ids == (0, 2) and r.grammar == g
    assert (r.ignore_eos, r.stream, r.logprobs) == (True, False, True)
    sp = r.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop_token_ids, sp.ignore_eos) == (
        7, 1.0, 0.5, 40, 2**64 - 1, (0, 2), True)


def test_generate_messages_and_token_ids():
    msgs = [{"role": r, "content": f"c-{r}"} for r in ("system", "user", "assistant", "tool")]
    r = parse({"type": "generate", "id": "m", "messages": msgs})
    assert r.messages == msgs and r.prompt is None and r.prompt_token_ids is None
    r = parse({"type": "generate", "id": "t", "prompt_token_ids": [0, 5, 9]})
    assert r.prompt_token_ids == [0, 5, 9] and r.prompt is None


def test_nil_means_absent():
    r = parse(gen(messages=None, max_tokens=None, temperature=None, seed=None, stop=None, grammar=None, stream=None))
    assert r == GenerateRequest(id="r1", prompt="hello")


def test_other_types():
    assert parse({"type": "cancel", "id": "x"}) == CancelRequest("x")
    assert parse({"type": "ping"}) == PingRequest(None)
    assert parse({"type": "ping", "nonce": [1, {"a": b"b"}]}) == PingRequest([1, {"a": b"b"}])
    assert parse({"type": "info"}) == InfoRequest()


def test_id_bounds_and_seed_range():
    assert parse(gen(id="x" * 128)).id == "x" * 128
    assert parse(gen(seed=-(2**63))).seed == -(2**63)
    assert len(parse(gen(stop=["s"] * 16)).stop) == 16


def test_frames_may_be_bytearray_or_memoryview():
    f = frames(gen())
    assert parse_client_message([bytearray(f[0]), memoryview(f[1])]).id == "r1"


# --------------------------------------------------------------------------- precise errors

BAD = [
    # (message, code, exact error message)
    (gen(id=None), "bad_request", "missing field 'id'"),
    (gen(id=5), "bad_request", "id must be a string, got int"),
    (gen(id=""), "bad_request", "id must be 1 to 128 characters, got 0"),
    (gen(id="x" * 129), "bad_request", "id must be 1 to 128 characters, got 129"),
    (gen(foo=1), "bad_request", "unknown field 'foo' for generate"),
    (gen(foo=1, bar=2), "bad_request", "unknown fields 'bar', 'foo' for generate"),
    ({"type": "generate", "id": "r1"}, "bad_request",
     "exactly one of prompt, messages, prompt_token_ids, skill is required, got none"),
    (gen(messages=[{"role": "user", "content": "x"}]), "bad_request",
     "exactly one of prompt, messages, prompt_token_ids, skill is required, got prompt and messages"),
    (gen(prompt_token_ids=[1]), "bad_request",
     "exactly one of prompt, messages, prompt_token_ids, skill is required, got prompt and prompt_token_ids"),
    (gen(prompt=b"hi"), "bad_request", "prompt must be a string, got bin"),
    (gen(prompt=""), "bad_request", "prompt must not be empty"),
    ({"type": "generate", "id": "r1", "messages": "hi"}, "bad_request",
     "messages must be an array of {role, content} maps, got str"),
    ({"type": "generate", "id": "r1", "messages": []}, "bad_request", "messages must not be empty"),
    ({"type": "generate", "id": "r1", "messages": [["user", "x"]]}, "bad_request",
     "messages[0] must be a map with role and content, got array"),
    ({"type": "generate", "id": "r1", "messages": [{"role": "user"}]}, "bad_request",
     "messages[0].content is required"),
    ({"type": "generate", "id": "r1", "messages": [{"role": "user", "content": "a"}, {"content": "x"}]},
     "bad_request", "messages[1].role is required"),
    ({"type": "generate", "id": "r1", "messages": [{"role": "bot", "content": "x"}]}, "bad_request",
     "messages[0].role must be one of system, user, assistant, tool, got 'bot'"),
    ({"type": "generate", "id": "r1", "messages": [{"role": 1, "content": "x"}]}, "bad_request",
     "messages[0].role must be a string, got int"),
    ({"type": "generate", "id": "r1", "messages": [{"role": "user", "content": 3}]}, "bad_request",
     "messages[0].content must be a string or an array of parts, got int"),
    ({"type": "generate", "id": "r1", "messages": [{"role": "user", "content": "x", "name": "n"}]},
     "bad_request", "unknown field 'name' for messages[0]"),
    ({"type": "generate", "id": "r1", "prompt_token_ids": "1 2"}, "bad_request",
     "prompt_token_ids must be an array of integers, got str"),
    ({"type": "generate", "id": "r1", "prompt_token_ids": []}, "bad_request", "prompt_token_ids must not be empty"),
    ({"type": "generate", "id": "r1", "prompt_token_ids": [1, -2]}, "bad_request",
     "prompt_token_ids[1] must be >= 0, got -2"),
    ({"type": "generate", "id": "r1", "prompt_token_ids": [1, 2.0]}, "bad_request",
     "prompt_token_ids[1] must be an integer, got float"),
    ({"type": "generate", "id": "r1", "prompt_token_ids": [True]}, "bad_request",
     "prompt_token_ids[0] must be an integer, got bool"),
    (gen(max_tokens=0), "bad_request", "max_tokens must be an integer >= 1, got 0"),
    (gen(max_tokens=-5), "bad_request", "max_tokens must be an integer >= 1, got -5"),
    (gen(max_tokens=1.0), "bad_request", "max_tokens must be an integer >= 1, got float"),
    (gen(max_tokens=True), "bad_request", "max_tokens must be an integer >= 1, got bool"),
    (gen(max_tokens="5"), "bad_request", "max_tokens must be an integer >= 1, got str"),
    (gen(temperature=-0.1), "bad_request", "temperature must be a finite number >= 0, got -0.1"),
    (gen(temperature=math.inf), "bad_request", "temperature must be a finite number >= 0, got inf"),
    (gen(temperature=math.nan), "bad_request", "temperature must be a finite number >= 0, got nan"),
    (gen(temperature=True), "bad_request", "temperature must be a finite number >= 0, got bool"),
    (gen(temperature="hot"), "bad_request", "temperature must be a finite number >= 0, got str"),
    (gen(top_p=1.5), "bad_request", "top_p must be in (0, 1], got 1.5"),
    (gen(top_p=0), "bad_request", "top_p must be in (0, 1], got 0.0"),
    (gen(top_p=math.nan), "bad_request", "top_p must be in (0, 1], got nan"),
    (gen(top_p=[1]), "bad_request", "top_p must be a number in (0, 1], got array"),
    (gen(top_k=-1), "bad_request", "top_k must be an integer >= 0, got -1"),
    (gen(top_k=1.5), "bad_request", "top_k must be an integer >= 0, got float"),
    (gen(seed="42"), "bad_request", "seed must be a 64-bit integer, got str"),
    (gen(seed=False), "bad_request", "seed must be a 64-bit integer, got bool"),
    (gen(stop="END"), "bad_request", "stop must be an array of strings, got str"),
    (gen(stop=["a"] * 17), "bad_request", "stop may hold at most 16 strings, got 17"),
    (gen(stop=["a", ""]), "bad_request", "stop[1] must not be empty"),
    (gen(stop=["a", 1]), "bad_request", "stop[1] must be a string, got int"),
    (gen(stop_token_ids=5), "bad_request", "stop_token_ids must be an array of integers, got int"),
    (gen(stop_token_ids=[-1]), "bad_request", "stop_token_ids[0] must be >= 0, got -1"),
    (gen(stop_token_ids=["a"]), "bad_request", "stop_token_ids[0] must be an integer, got str"),
    (gen(stop_token_ids=list(range(65))), "bad_request", "stop_token_ids may hold at most 64 ids"),
    (gen(ignore_eos=1), "bad_request", "ignore_eos must be a bool, got int"),
    (gen(stream="yes"), "bad_request", "stream must be a bool, got str"),
    (gen(logprobs=0), "bad_request", "logprobs must be a bool, got int"),
    (gen(grammar="point"), "bad_request", "grammar must be a map, got str"),
    (gen(grammar={}), "bad_request", "grammar.kind is required"),
    (gen(grammar={"kind": 1}), "bad_request", "grammar.kind must be a string, got int"),
    (gen(grammar={1: "x", "kind": "point"}), "bad_request", "grammar keys must be strings, got a int key"),
    ({"type": "cancel"}, "bad_request", "missing field 'id'"),
    ({"type": "cancel", "id": 7}, "bad_request", "id must be a string, got int"),
    ({"type": "cancel", "id": "x", "prompt": "p"}, "bad_request", "unknown field 'prompt' for cancel"),
    ({"type": "ping", "id": "x"}, "bad_request", "unknown field 'id' for ping"),
    ({"type": "info", "x": 1}, "bad_request", "unknown field 'x' for info"),
    ({"id": "r1"}, "bad_request", "missing field 'type'"),
    ({"type": 1}, "bad_request", "type must be a string, got int"),
    ({"type": "chunk", "id": "r1"}, "bad_request",
     "unknown message type 'chunk'; expected one of generate, cancel, ping, info"),
    ({1: "x", "type": "info"}, "bad_request", "payload keys must be strings, got a int key"),
    ({b"type": "info"}, "bad_request", "payload keys must be strings, got a bin key"),
    ([1, 2], "bad_request", "payload must be a msgpack map, got array"),
    ("generate", "bad_request", "payload must be a msgpack map, got str"),
    (None, "bad_request", "payload must be a msgpack map, got nil"),
]


@pytest.mark.parametrize("msg,code,message", BAD, ids=[b[2][:50] for b in BAD])
def test_bad_messages(msg, code, message):
    e = err(msg)
    assert (e.code, e.message) == (code, message)
    assert str(e) == message


@pytest.mark.parametrize("f", SAMPLING_FIELDS, ids=lambda f: f.name)
def test_sampling_fields_are_read_as_sampling_params_declares_them(f):
    """Every SamplingParams field is a generate field of the same name; a wrong type is named
    with the field's ``must_be``; absent or nil gives SamplingParams' default."""
    assert getattr(parse(gen(**{f.name: None})).sampling, f.name) == f.default
    e = err(gen(**{f.name: "x"}))
    assert (e.code, e.message, e.id) == ("bad_request", f"{f.name} must be {f.must_be}, got str", "r1")
    value = {int: 1 + (f.default or 0), float: 0.5, bool: not f.default, tuple: [1], dict: {7: 1.5}}[f.type]
    parsed = getattr(parse(gen(**{f.name: value})).sampling, f.name)
    assert parsed == (tuple(value) if f.type is tuple else value) and parsed != f.default


def test_error_carries_id_when_readable():
    assert err(gen(top_p=2)).id == "r1"
    assert err({"type": "generate", "id": "abc", "prompt": 1}).id == "abc"
    assert err({"type": "nope", "id": "abc"}).id == "abc"  # read before the type is checked
    assert err({"type": "cancel", "id": "abc", "x": 1}).id == "abc"
    assert err(gen(id=5)).id is None
    assert err(gen(id="x" * 129)).id is None
    assert err([1]).id is None
    # also for errors raised before the payload is decoded
    big = frames(gen(prompt="x" * 100))
    with pytest.raises(ProtocolError) as ei:
        parse_client_message(big, Limits(max_message_bytes=50))
    assert ei.value.code == "too_long" and ei.value.id == "r1"
    with pytest.raises(ProtocolError) as ei:
        parse_client_message([b"TANDEM2", frames(gen())[1]])
    assert ei.value.code == "unsupported_version" and ei.value.id == "r1"
    with pytest.raises(ProtocolError) as ei:
        parse_client_message(frames(gen()) + [b"image"])
    assert ei.value.code == "bad_request" and ei.value.id == "r1"


def test_long_values_are_not_echoed():
    e = err(gen(messages=None, stop=["a"], top_k="k" * 100000))
    assert e.message == "top_k must be an integer >= 0, got str"
    e = err({"type": "k" * 100000})
    assert len(e.message) < 200
    e = err({"type": "generate", "id": "r", "messages": [{"role": "r" * 100000, "content": ""}]})
    assert len(e.message) < 200


# --------------------------------------------------------------------------- frame-level errors


def perr(fr, limits=None) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        parse_client_message(fr, limits)
    return ei.value


def test_frame_errors():
    payload = frames(gen())[1]
    assert perr([]).code == "unsupported_version"
    e = perr([b"TANDEM0", payload])
    assert e.code == "unsupported_version" and "TANDEM0" in e.message
    assert perr([b"", payload]).code == "unsupported_version"
    assert perr([payload]).code == "unsupported_version"
    e = perr([VERSION_FRAME])
    assert e.code == "bad_request" and e.message.startswith("missing payload frame")
    e = perr([VERSION_FRAME, payload, b"x"])
    assert e.message == "message has 3 frames, expected 2 (further frames are reserved)"
    assert perr([VERSION_FRAME, b"\xc1"]).message == "payload is not valid msgpack (FormatError)"
    assert perr([VERSION_FRAME, payload[:-2]]).message.startswith("payload is not valid msgpack")
    assert perr([VERSION_FRAME, b""]).message.startswith("payload is not valid msgpack")
    assert perr([VERSION_FRAME, payload + b"\x00"]).message == "payload has trailing bytes after the msgpack map"
    assert perr([VERSION_FRAME, b"\xa2\xff\xfe"]).message == "payload contains a string that is not valid UTF-8"
    assert perr([VERSION_FRAME, b"\x91" * 5000 + b"\xc0"]).message == "payload is nested too deeply"
    assert perr([VERSION_FRAME, b"\x81\x91\x01\x01"]).code == "bad_request"  # unhashable key
    assert perr([VERSION_FRAME, "str"]).message == "frames must be bytes"


def test_any_decodable_nonce_is_echoed():
    deep = b"\x82\xa4type\xa4ping\xa5nonce" + b"\x91" * 1023 + b"\xc0"  # deepest msgpack will decode
    req = parse_client_message([VERSION_FRAME, deep])
    assert encode_pong(req.nonce)[1] == b"\x82\xa4type\xa4pong\xa5nonce" + b"\x91" * 1023 + b"\xc0"
    ts = msgpack.Timestamp(1, 2)
    req = parse({"type": "ping", "nonce": [ts, msgpack.ExtType(5, b"x")]})
    assert decode(encode_pong(req.nonce))["nonce"] == [ts, msgpack.ExtType(5, b"x")]


def test_limits_configurable():
    lim = Limits(max_message_bytes=1000, max_prompt_chars=10, max_prompt_tokens=3, vocab_size=100)
    e = err(gen(prompt="x" * 11), lim)
    assert (e.code, e.message, e.id) == ("too_long", "prompt is 11 characters, the limit is 10", "r1")
    assert parse(gen(prompt="x" * 10), lim).prompt == "x" * 10
    e = err({"type": "generate", "id": "r1", "messages": [{"role": "user", "content": "x" * 6}] * 2}, lim)
    assert (e.code, e.message) == ("too_long", "messages hold 12 characters of content, the limit is 10")
    e = err({"type": "generate", "id": "r1", "prompt_token_ids": [1, 2, 3, 4]}, lim)
    assert (e.code, e.message) == ("too_long", "prompt_token_ids has 4 tokens, the limit is 3")
    e = err({"type": "generate", "id": "r1", "prompt_token_ids": [100]}, lim)
    assert e.message == "prompt_token_ids[0] must be < vocab size 100, got 100"
    e = err(gen(stop_token_ids=[99, 100]), lim)
    assert e.message == "stop_token_ids[1] must be < vocab size 100, got 100"
    e = err(gen(prompt="x" * 2000), lim)
    assert e.code == "too_long" and e.message.startswith("message is ")
    # default: 1 MiB
    assert DEFAULT_LIMITS.max_message_bytes == 1 << 20
    e = err(gen(prompt="x" * (1 << 20)))
    assert e.code == "too_long" and e.message.endswith("the limit is 1048576")


# --------------------------------------------------------------------------- encoders


def test_encoders_roundtrip():
    assert decode(encode_chunk("a", 0, "hi", [1, 2])) == {"type": "chunk", "id": "a", "seq": 0, "text": "hi", "token_ids": [1, 2]}
    d = decode(encode_done("a", "stop", "hi", [1, 2], {"prompt_tokens": 3, "completion_tokens": 2},
                           {"ttft_ms": 1.5, "total_ms": 9.0}))
    assert d == {"type": "done", "id": "a", "finish_reason": "stop", "text": "hi", "token_ids": [1, 2],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "metrics": {"ttft_ms": 1.5, "total_ms": 9.0}}
    d = decode(encode_done("a", "length", "", [], {}, {}, output={"points": []}, logprobs=[-1.0]))
    assert d["output"] == {"points": []} and d["logprobs"] == [-1.0]
    assert decode(encode_error(None, "internal", "boom")) == {"type": "error", "id": None, "code": "internal", "message": "boom"}
    assert decode(encode_pong({"n": 1})) == {"type": "pong", "nonce": {"n": 1}}
    assert decode(encode_info("m", 8, 2048, True, "cuda:0")) == {
        "type": "info", "protocol": 1, "model": "m", "max_batch": 8, "max_model_len": 2048,
        "pipeline": True, "device": "cuda:0"}
    assert decode(ProtocolError("too_long", "x", "id1").to_frames())["id"] == "id1"
    for code in ERROR_CODES:
        assert decode(encode_error("i", code, "m"))["code"] == code
    with pytest.raises(ValueError):
        encode_error("i", "nope", "m")
    with pytest.raises(ValueError):
        encode_done("i", "eos", "", [], {}, {})
    with pytest.raises(ValueError):
        ProtocolError("nope", "m")


# --------------------------------------------------------------------------- fuzzing


def _rand_value(rng: random.Random, depth: int = 0):
    k = rng.randrange(12 if depth < 3 else 8)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice([0, 1, -1, 255, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if k == 3:
        return rng.choice([0.0, -0.0, 1.5, -2.5, math.inf, -math.inf, math.nan, rng.random()])
    if k == 4:
        return "".join(rng.choice("ab\x00é😀 ") for _ in range(rng.randrange(6)))
    if k == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(6)))
    if k == 6:
        return msgpack.ExtType(rng.randrange(128), b"x")
    if k == 7:
        return rng.choice(["generate", "cancel", "ping", "info", "user", "point", ""])
    if k in (8, 9):
        return [_rand_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["type", "id", "prompt", "messages", "role", "content", "kind", "x"]
    return {rng.choice(keys): _rand_value(rng, depth + 1) for _ in range(rng.randrange(4))}


_FIELDS = ["id", "prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "logprobs", "grammar"]


def _valid_generate(rng: random.Random) -> dict:
    m: dict = {"type": "generate", "id": "".join(rng.choice("abc-_0") for _ in range(rng.randrange(1, 129)))}
    which = rng.randrange(3)
    if which == 0:
        m["prompt"] = "p" * rng.randrange(1, 50)
    elif which == 1:
        m["messages"] = [{"role": rng.choice(["system", "user", "assistant", "tool"]), "content": "c"}
                         for _ in range(rng.randrange(1, 4))]
    else:
        m["prompt_token_ids"] = [rng.randrange(50000) for _ in range(rng.randrange(1, 20))]
    opts = {
        "max_tokens": lambda: rng.randrange(1, 5000),
        "temperature": lambda: rng.choice([0, 1, rng.random() * 3]),
        "top_p": lambda: rng.choice([1, 1.0, rng.random() or 1.0]),
        "top_k": lambda: rng.randrange(0, 100),
        "seed": lambda: rng.randrange(-(2**63), 2**64),
        "stop": lambda: ["s" * rng.randrange(1, 4) for _ in range(rng.randrange(17))],
        "stop_token_ids": lambda: [rng.randrange(50000) for _ in range(rng.randrange(65))],
        "ignore_eos": lambda: rng.random() < 0.5,
        "stream": lambda: rng.random() < 0.5,
        "logprobs": lambda: rng.random() < 0.5,
        "grammar": lambda: rng.choice([{"kind": "point", "max_objects": 3}, {"kind": "box", "max_objects": 1},
                                       {"kind": "regex", "pattern": "a+"}, {"kind": "json_schema", "schema": {}}]),
    }
    for k, f in opts.items():
        if rng.random() < 0.5:
            m[k] = f()
    return m


_HUGE = {  # built once: constructing these per iteration would dominate the fuzz time
    "prompt": ["x" * 300_000, "x" * 1_100_000],
    "id": ["i" * 129, "i" * 100_000],
    "stop": [["s"] * 17, ["s"] * 20_000],
    "prompt_token_ids": [[2**64 - 1] * 10, [1] * 140_000],
    "max_tokens": [-(2**63), 0],
    "seed": [2.0**70],
    "messages": [[{"role": "user", "content": "c" * 300_000}]],
    "temperature": [1e308 * 10],
}


def _malformed(rng: random.Random) -> tuple[list[bytes], bool]:
    """(frames, must_fail): must_fail is False when a mutation may happen to stay valid."""
    base = _valid_generate(rng)
    good = msgpack.packb(base, use_bin_type=True)
    k = rng.randrange(11)
    if k == 0:  # wrong version frame
        v = rng.choice([b"", b"TANDEM", b"TANDEM2", b"tandem1", b"TANDEM1\x00", bytes(rng.randrange(256) for _ in range(8))])
        return [v, good], True
    if k == 1:  # not msgpack at all / random bytes (may by chance decode to a non-map)
        return [VERSION_FRAME, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))], True
    if k == 2:  # random msgpack value (maps without a valid type)
        v = _rand_value(rng)
        if isinstance(v, dict):
            v.pop("type", None)
        return [VERSION_FRAME, msgpack.packb(v, use_bin_type=True)], True
    if k == 3:  # a field replaced by a random value
        f = rng.choice(_FIELDS + ["type"])
        base[f] = _rand_value(rng)
        return [VERSION_FRAME, msgpack.packb(base, use_bin_type=True)], False
    if k == 4:  # a field removed
        f = rng.choice(["id", "type", "prompt", "messages", "prompt_token_ids"])
        base.pop(f, None)
        return [VERSION_FRAME, msgpack.packb(base, use_bin_type=True)], False
    if k == 5:  # an unknown field
        base[rng.choice(["promt", "n", "best_of", "Type", ""])] = _rand_value(rng)
        return [VERSION_FRAME, msgpack.packb(base, use_bin_type=True)], True
    if k == 6:  # huge values
        f = rng.choice(["prompt", "id", "stop", "prompt_token_ids", "max_tokens", "seed", "messages", "temperature"])
        huge = rng.choice(_HUGE[f])
        for p in ("prompt", "messages", "prompt_token_ids"):
            base.pop(p, None)
        base["prompt" if f not in ("messages", "prompt_token_ids") else f] = "p" if f not in ("messages", "prompt_token_ids") else huge
        base[f] = huge
        return [VERSION_FRAME, msgpack.packb(base, use_bin_type=True)], True
    if k == 7:  # unknown type
        base["type"] = rng.choice(["Generate", "gen", "chunk", "done", "error", "pong", "", "info "])
        return [VERSION_FRAME, msgpack.packb(base, use_bin_type=True)], True
    if k == 8:  # truncated payload
        return [VERSION_FRAME, good[: rng.randrange(len(good))]], True
    if k == 9:  # deep nesting in a field
        f = rng.choice(["prompt", "messages", "grammar", "stop", "nonce", "prompt_token_ids"])
        d = rng.choice([2, 50, 600, 1023, 1024, 1025, 3000])
        nest = b"\x91" * d + b"\xc0"  # [[[...nil...]]], written by hand (packb has a depth limit)
        if f == "nonce":
            return [VERSION_FRAME, b"\x82\xa4type\xa4ping\xa5nonce" + nest], False
        head = {k: v for k, v in base.items() if k not in ("prompt", "messages", "prompt_token_ids", f)}
        if f == "grammar":
            nest = b"\x82\xa4kind\x01\xa1x" + nest
        if f not in ("prompt", "messages", "prompt_token_ids"):
            head["prompt"] = "p"
        body = msgpack.packb(head, use_bin_type=True)
        n = len(head) + 1
        assert n <= 15  # fixmap
        return [VERSION_FRAME, bytes([0x80 | n]) + body[1:] + msgpack.packb(f) + nest], True
    # wrong frame count / extra frames
    return rng.choice([[], [VERSION_FRAME], [VERSION_FRAME, good, b""], [VERSION_FRAME, good, good, good]]), True


def test_fuzz_malformed_messages_always_protocol_error():
    rng = random.Random(1234)
    limits = Limits(vocab_size=50_000)  # so that huge token ids are out of range
    counts: dict[str, int] = {}
    n_err = 0
    N = 10_000
    for i in range(N):
        fr, must_fail = _malformed(rng)
        try:
            req = parse_client_message(fr, limits)
        except ProtocolError as e:
            n_err += 1
            assert e.code in ERROR_CODES
            assert isinstance(e.message, str) and 0 < len(e.message) < 300, e.message
            assert e.id is None or (isinstance(e.id, str) and 1 <= len(e.id) <= 128)
            assert decode(e.to_frames())["code"] == e.code  # the answer always encodes
            counts[e.code] = counts.get(e.code, 0) + 1
        else:
            assert not must_fail, (i, fr[:1], fr[1][:200] if len(fr) > 1 else None)
            assert isinstance(req, (GenerateRequest, CancelRequest, PingRequest, InfoRequest))
            if isinstance(req, PingRequest):
                encode_pong(req.nonce)
    assert n_err >= 0.9 * N
    assert {"bad_request", "unsupported_version", "too_long"} <= set(counts)


def test_fuzz_valid_messages_parse():
    """Non-vacuity: randomly built valid messages do parse, to the values sent."""
    rng = random.Random(99)
    for _ in range(2000):
        m = _valid_generate(rng)
        r = parse(m)
        assert isinstance(r, GenerateRequest) and r.id == m["id"]
        assert r.max_tokens == m.get("max_tokens")
        assert r.stop == tuple(m.get("stop", ()))
        assert r.stop_token_ids == tuple(m.get("stop_token_ids", ()))
        assert r.grammar == m.get("grammar")
        assert r.stream == m.get("stream", True)
        for f in ("prompt", "messages", "prompt_token_ids"):
            assert getattr(r, f) == m.get(f)
        assert isinstance(r.sampling, SamplingParams)


def test_images_envelope():
    """Images ride a generate as bin; such a message may be up to 64 MiB, others keep 1 MiB."""
    big = b"\x89PNG" + b"\0" * (2 << 20)
    r = parse({"type": "generate", "id": "i", "prompt": "<image>hi", "images": [big]})
    assert r.images == (big,) and r.prompt == "<image>hi"
    e = err(gen(prompt="x" * (2 << 20)))
    assert e.code == "too_long" and e.id == "r1"
    parts = [{"type": "text", "text": "a"}, {"type": "image"}]
    r = parse({"type": "generate", "id": "m", "messages": [{"role": "user", "content": parts}], "images": [b"x"]})
    assert r.messages[0]["content"] == parts
    for fields, message in [
        ({"prompt": "<image>", "images": [b"x"] * 9}, "images: too many images: 9 (at most 8 per request)"),
        ({"prompt": "x", "images": [b"x"]}, "images: the prompt has 0 <image> placeholders but 1 images were sent"),
        ({"prompt_token_ids": [1], "images": [b"x"]},
         "images cannot be combined with prompt_token_ids: send prompt or messages"),
        ({"prompt": "<image>", "images": [1]}, "images[0] must be bin (an encoded image file), got int"),
        ({"prompt": "<image>", "images": b"x"}, "images must be an array of bin (encoded image files), got bin"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages hold 1 image parts but no images were sent"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
         "messages[0].content[0].type must be one of text, image, got 'video'"),
    ]:
        e = err({"type": "generate", "id": "b", **fields})
        assert (e.code, e.message, e.id) == ("bad_request", message, "b"), fields


def test_chat_template_options_go_with_messages_as_vllm_takes_them():
    chat = {"type": "generate", "id": "c", "messages": [{"role": "user", "content": "hi"}]}
    assert parse(chat).template_options == {}  # none given: the renderer's defaults
    r = parse({**chat, "add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}})
    assert r.template_options == {"enable_thinking": False, "add_generation_prompt": False,
                                  "continue_final_message": True}
    for msg, says in [
        (gen(add_generation_prompt=False), "add_generation_prompt renders chat messages: send it with messages"),
        ({**chat, "continue_final_message": True}, "continue_final_message needs add_generation_prompt: false"),
        ({**chat, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools is not a template variable"),
        ({**chat, "chat_template_kwargs": [1]}, "chat_template_kwargs must be a map, got array"),
        ({**chat, "add_generation_prompt": 1}, "add_generation_prompt must be a bool, got int"),
    ]:
        e = err(msg)
        assert (e.code, e.message[:len(says)]) == ("bad_request", says), e.message


def test_chat_template_options_reach_the_template():
    from frontend.server.tokenization import chat_prompt_ids
    from shared.models.registry import load_tokenizer

    tok = load_tokenizer("tiny-random")
    tok.chat_template = ("{% if loud %}!{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}"
                         "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    r = parse({"type": "generate", "id": "c", "messages": messages, "add_generation_prompt": False,
               "continue_final_message": True, "chat_template_kwargs": {"loud": True}})
    text = tok.decode(chat_prompt_ids(tok, r.messages, **r.template_options))
    assert text == "![user] hi\n[assistant] Once"  # continued: nothing after the final message
    assert tok.decode(chat_prompt_ids(tok, messages)) == "[user] hi\n[assistant] Once\n[assistant] "  # the defaults


def test_truncate_prompt_tokens():
    assert parse(gen(truncate_prompt_tokens=3)).truncate_prompt_tokens == 3
    assert parse(gen()).truncate_prompt_tokens is None
    for value, says in [(0, "truncate_prompt_tokens must be an integer >= 1, got 0"),
                        (True, "truncate_prompt_tokens must be an integer >= 1, got True"),
                        (-1, "truncate_prompt_tokens must be an integer >= 1, got -1")]:
        assert err(gen(truncate_prompt_tokens=value)).message == says
    e = err(gen(prompt="<image>", images=[b"x"], truncate_prompt_tokens=2))
    assert e.message.startswith("truncate_prompt_tokens cannot be combined with images")


def test_a_skill_field_sent_as_nil_is_absent():
    """nil means absent for a skill's own fields too: the skill's default applies (a Moondream
    model's own max_objects), never a nil the skill would refuse."""
    point = {"type": "generate", "id": "s", "skill": "point", "object": "cat", "images": [b"x"]}
    assert parse({**point, "max_objects": None}).skill == {"skill": "point", "object": "cat"}
    assert parse({**point, "max_objects": 3}).skill == {"skill": "point", "object": "cat", "max_objects": 3}
    assert err(gen(max_objects=None, question=1)).message == "question is a skill field: send it with skill"


def test_the_helpers_for_http_word_their_errors_as_a_generate_does():
    """``parse_token_ids`` / ``parse_prompt`` / ``template_options`` (HTTP /tokenize, /detokenize) name
    the field as the caller calls it, in the same words as a generate's errors."""
    from frontend.protocol.parse import parse_prompt, parse_token_ids, template_options

    def says(fn, *args):
        with pytest.raises(ProtocolError) as ei:
            fn(*args)
        return ei.value.message

    assert parse_token_ids([0, 5], "tokens") == [0, 5] and parse_token_ids([], "tokens") == []
    assert says(parse_token_ids, "1 2", "tokens") == "tokens must be an array of integers, got str"
    assert says(parse_token_ids, [1, True], "tokens") == "tokens[1] must be an integer, got bool"
    assert says(parse_token_ids, [1, 100], "tokens", Limits(vocab_size=100)) == "tokens[1] must be < vocab size 100, got 100"
    assert says(parse_prompt, "messages", [{"role": "user", "content": [{"type": "text"}]}]) == \
        "messages[0].content[0].text must be a string, got nil"
    assert says(parse_prompt, "messages", [{"role": "user", "content": "x", 3: 1}]) == \
        "messages[0] keys must be strings, got a int key"
    assert says(template_options, {"continue_final_message": "yes"}) == "continue_final_message must be a bool, got str"

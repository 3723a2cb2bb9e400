"""Tests of shared/messages.py: round trips, and hostile input only ever
raising MessageError."""
from __future__ import annotations

import math
import random

import msgpack
import msgspec.structs
import pytest

from shared.messages import (
    Cancel,
    MessageError,
    Progress,
    Ready,
    Released,
    RequestFailed,
    Sampling,
    Shutdown,
    Stats,
    StatsRequest,
    Submit,
    decode,
    encode,
    to_sampling_params,
)
from shared.sampling import SAMPLING_FIELD_NAMES, SamplingParams

MESSAGE_TYPES = (Submit, Cancel, Shutdown, StatsRequest, Stats, Progress, Ready, Released, RequestFailed)

SAMPLES = [
    Submit(seq_id=0, prompt_ids=[]),
    Submit(seq_id=0xFFFFFFFF, prompt_ids=list(range(0, 300_000, 7)) + [0x7FFFFFFF],
           sampling=Sampling(max_tokens=9, temperature=0.8, top_p=0.9, top_k=50, seed=2**64 - 1,
                             stop_token_ids=[2, 3], ignore_eos=True),
           constrained=True, logprobs=True),
    Submit(seq_id=5, prompt_ids=[1], sampling=Sampling(seed=-(2**63))),
    Cancel(seq_id=12),
    Shutdown(),
    StatsRequest(),
    Stats(values={"tokens": 10, "tok_per_s": 1234.5, "ünïcode ✓": -1}),
    Progress(stage="capturing CUDA graphs", done=3, total=12),
    Progress(stage="loading smollm2-135m on cuda"),
    Ready(generation=3, info={"model": "SmolLM2", "vocab": 49152, "bf16": True, "x": None, "f": 0.5}),
    Released(seq_ids=[1, 2, 0xFFFFFFFF]),
    Released(seq_ids=[]),
    RequestFailed(seq_id=7, code="prompt_too_long", message="prompt has 9000 tokens; max 8192 🙁"),
]


def check_decode_is_safe(data) -> object:
    """decode() either returns a message or raises MessageError - nothing else."""
    try:
        msg = decode(data)
    except MessageError:
        return None
    assert isinstance(msg, MESSAGE_TYPES)
    assert decode(encode(msg)) == msg
    return msg


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg and decode(memoryview(data)) == msg


def test_defaults_and_sampling_conversion():
    m = decode(msgpack.packb({"type": "submit", "seq_id": 1, "prompt_ids": [4, 5]}))
    assert m.sampling == Sampling() and not m.constrained and not m.logprobs
    assert to_sampling_params(m) == SamplingParams()
    p = SamplingParams(max_tokens=3, temperature=1.5, top_p=0.5, top_k=4, seed=9,
                       stop_token_ids=(1, 2), ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5,
                       repetition_penalty=1.2, min_p=0.1, logit_bias={3: -100.0, 7: 2.5}, min_tokens=2,
                       include_stop_str_in_output=True, skip_special_tokens=False)
    default = SamplingParams()
    assert all(getattr(p, n) != getattr(default, n) for n in SAMPLING_FIELD_NAMES), "set every field"
    sub = decode(encode(Submit(seq_id=1, prompt_ids=[1], sampling=Sampling.from_params(p))))
    assert to_sampling_params(sub) == p
    # int on the wire for a float field is fine (JSON-ish clients send 1 for 1.0)
    m = decode(msgpack.packb({"type": "submit", "seq_id": 1, "prompt_ids": [],
                              "sampling": {"temperature": 1}}))
    assert m.sampling.temperature == 1.0


def test_wire_sampling_is_generated_from_sampling_params():
    """Same fields in the same order, same defaults (token ids travel as a list)."""
    wire = msgspec.structs.asdict(Sampling())
    assert list(wire) == list(SAMPLING_FIELD_NAMES)
    assert SamplingParams(**wire) == SamplingParams()
    assert Sampling.from_params(SamplingParams()) == Sampling()


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("stop_token_ids", [-3]),
    ("stop_token_ids", list(range(65))), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("min_p", 1.5), ("logit_bias", {-1: 1.0}),
])
def test_to_sampling_params_names_bad_field(field, value):
    sub = Submit(seq_id=1, prompt_ids=[1], sampling=Sampling(**{field: value}))
    sub = decode(encode(sub))  # the values are well-typed, so they cross the wire ...
    with pytest.raises(ValueError, match=field):
        to_sampling_params(sub)  # ... and are rejected by name here


WRONG_TYPES = {
    "submit": {
        "seq_id": ["1", 1.0, -1, 2**32, None, [1], True],
        "prompt_ids": [[1.5], ["a"], [-1], [2**31], 5, "abc", {"a": 1}, [None], [True]],
        "sampling": [1, "x", [], {"max_tokens": "5"}, {"temperature": "hot"},
                     {"seed": 1.5}, {"stop_token_ids": [1.0]}, {"ignore_eos": 1}, {"bogus": 1}],
        "constrained": [1, "yes", None],
        "logprobs": [0, [], 1.0],
    },
    "cancel": {"seq_id": ["x", -5, 2**40, 3.0, None]},
    "stats": {"values": [[1], {"a": "b"}, {"a": None}, {"a": True}, {1: 2}, 3]},
    "ready": {"generation": ["1", 1.5, None], "info": [{"a": [1]}, {"a": {"b": 1}}, [], {2: 1}]},
    "released": {"seq_ids": [[-1], ["1"], 1, [1.0], [2**33]]},
    "request_failed": {"seq_id": ["1", -1], "code": [1, None, []], "message": [1, b"x"]},
}
VALID = {
    "submit": {"type": "submit", "seq_id": 1, "prompt_ids": [1, 2]},
    "cancel": {"type": "cancel", "seq_id": 1},
    "stats": {"type": "stats", "values": {"a": 1}},
    "ready": {"type": "ready", "generation": 1, "info": {}},
    "released": {"type": "released", "seq_ids": [1]},
    "request_failed": {"type": "request_failed", "seq_id": 1, "code": "x"},
}


def test_wrong_typed_fields_raise_message_error():
    count = 0
    for tag, fields in WRONG_TYPES.items():
        assert isinstance(decode(msgpack.packb(VALID[tag])), MESSAGE_TYPES)  # base is valid
        for field, values in fields.items():
            for v in values:
                data = msgpack.packb({**VALID[tag], field: v}, use_bin_type=True)
                with pytest.raises(MessageError):
                    decode(data)
                count += 1
        if tag != "stats":  # every other message has a required first field
            missing = dict(VALID[tag])
            missing.pop(next(k for k in missing if k != "type"))
            with pytest.raises(MessageError, match="missing"):
                decode(msgpack.packb(missing))
    assert count > 50


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x80", b"\x90", b"\xc0", b"\x01", b"\xa5hello",
    msgpack.packb({"type": "nope"}), msgpack.packb({"type": 3}), msgpack.packb([1, 2]),
    msgpack.packb({"type": "shutdown", "extra": 1}),
    b"\xdf\xff\xff\xff\xff",            # map claiming 4 billion entries
    b"\xdd\xff\xff\xff\xff",            # array claiming 4 billion entries
    b"\x91" * 200_000,                  # deeply nested arrays
    b"\x81\xa4type" + b"\x81\xa1a" * 100_000 + b"\x01",  # deeply nested maps
])
def test_malformed_inputs(data):
    with pytest.raises(MessageError):
        decode(data)


def test_non_bytes_and_oversized_inputs():
    for bad in (None, "submit", 3, [b"x"], {"type": "cancel"}):
        with pytest.raises(MessageError, match="expected bytes"):
            decode(bad)
    with pytest.raises(MessageError, match="exceeds"):
        decode(b"\x00" * (64 * 1024 * 1024 + 1))


def test_encode_rejects_non_messages_and_unencodable_values():
    for bad in (object(), {"type": "cancel", "seq_id": 1}, Sampling(), b"x"):
        with pytest.raises(MessageError):
            encode(bad)
    with pytest.raises(MessageError):
        encode(Stats(values={"x": object()}))
    with pytest.raises(MessageError):
        encode(Submit(seq_id=2**70, prompt_ids=[]))


def test_fuzz_truncated_random_and_mutated_bytes():
    rng = random.Random(1234)
    errors = decoded = 0
    encodings = [encode(m) for m in SAMPLES[:1] + SAMPLES[2:]]  # skip the 300k-id one
    for data in encodings:  # every strict prefix is truncated -> error
        for cut in range(len(data)):
            with pytest.raises(MessageError):
                decode(data[:cut])
            errors += 1
    for _ in range(1500):  # random bytes, biased to msgpack-looking prefixes
        n = rng.randrange(0, 64)
        data = bytes(rng.randrange(256) for _ in range(n))
        if rng.random() < 0.5:
            data = bytes([rng.choice([0x80, 0x81, 0x82, 0x83, 0x8F, 0xDE, 0xDF, 0x91, 0xDC])]) + data
        if check_decode_is_safe(data) is None:
            errors += 1
        else:
            decoded += 1
    for _ in range(1500):  # mutations of valid messages: flip, insert, delete bytes
        data = bytearray(rng.choice(encodings))
        for _ in range(rng.randrange(1, 4)):
            op, i = rng.randrange(3), rng.randrange(len(data))
            if op == 0:
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                data.insert(i, rng.randrange(256))
            elif len(data) > 1:
                del data[i]
        if check_decode_is_safe(bytes(data)) is None:
            errors += 1
        else:
            decoded += 1
    assert errors >= 1000, (errors, decoded)
    print(f"fuzz: {errors} rejected, {decoded} decoded to valid messages")

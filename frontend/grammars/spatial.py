"""Point and box grammars: a character automaton with numeric state, matched
against the (tiny) part of the vocabulary made only of grammar characters.

Text form (see the package docstring for the rationale)::

    point:  none | P(;P){0,max-1}          P = C,C           (x,y)
    box:    none | B(;B){0,max-1}          B = C,C,C,C       (x_min,y_min,x_max,y_max)
    C:      0.ddd | 1.000                  exactly three decimals, value in [0, 1]

Because every coordinate has the same width, comparing two values is comparing
their strings character by character, so ``x_min <= x_max`` is enforced digit
by digit while x_max is emitted: as long as x_max's prefix equals x_min's, a
digit below x_min's digit at that place is masked out. The upper bound 1.000
is enforced the same way. No state is ever a dead end (any legal prefix can be
completed), so a mask is never empty.

Mask building: the candidate tokens (those whose decoded text is made only of
``0-9 . , ; n o e`` and that fit the template somewhere: 22 of SmolLM2's
49152, since it splits digits) are stored in a character trie; a step walks the trie from the current state,
pruning at the first rejected character. The result depends only on a small
*key* (position in the template, items left up to what one token can reach,
whether the value is still tight against its bounds and which bound digits are
still relevant), so it is memoised per compiled grammar and a typical fill is
one dict lookup plus a sparse write into the row (~1.5 us); a state seen
for the first time costs one trie walk (~16 us on SmolLM2).
"""
from __future__ import annotations

import re

import numpy as np

from .base import CompiledGrammar, Matcher
from .bitmask import ids_to_words, mask_words
from .spec import GrammarError, GrammarSpec

NONE_TEXT = "none"
HI = "1.000"
FIELD_LEN = 5
ALPHABET = frozenset("0123456789.,;") | frozenset(NONE_TEXT)
FIELDS = {"point": ("x", "y"), "box": ("x_min", "y_min", "x_max", "y_max")}
RESULT_KEY = {"point": "points", "box": "objects"}
# field index -> index of the field that is its lower bound
LOWER = {"point": {}, "box": {2: 0, 3: 1}}
_COORD = re.compile(r"(?:0\.[0-9]{3}|1\.000)")
_MEMO_LIMIT = 65536

# State tuples (hashable, immutable):
#   (0,)                       start, nothing emitted
#   (1, k)                     k characters of "none" matched (4 = complete)
#   (2, done, f, cur, vals)    inside item number `done`, field f, `cur` = its
#                              characters so far, `vals` = finished fields of the item
#   (3, done)                  `done` items finished (complete)
_START = (0,)


class _Node:
    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict = {}
        self.ids: list = []


class SpatialAutomaton:
    """The character automaton for one (kind, max_objects)."""

    def __init__(self, kind: str, max_objects: int) -> None:
        self.kind = kind
        self.max_objects = max_objects
        self.nf = len(FIELDS[kind])
        self.lower = LOWER[kind]
        self.item_len = 6 * self.nf  # fields, commas and the ';'

    def step(self, st: tuple, ch: str):
        """The state after ``ch``, or None if ``ch`` is not allowed."""
        tag = st[0]
        if tag == 2:
            _, done, f, cur, vals = st
            p = len(cur)
            if p == FIELD_LEN:  # field finished, not the last one: expect ','
                return (2, done, f + 1, "", vals + (cur,)) if ch == "," else None
            if p == 1:
                if ch != ".":
                    return None
            else:
                if not ("0" <= ch <= "9"):
                    return None
                lf = self.lower.get(f)
                if lf is not None:
                    lo = vals[lf]
                    if ch < lo[p] and cur == lo[:p]:
                        return None
                if ch > HI[p] and cur == HI[:p]:
                    return None
            cur += ch
            if p == FIELD_LEN - 1 and f == self.nf - 1:
                return (3, done + 1)
            return (2, done, f, cur, vals)
        if tag == 3:
            done = st[1]
            return (2, done, 0, "", ()) if ch == ";" and done < self.max_objects else None
        if tag == 0:
            if ch == "n":
                return (1, 1)
            return self.step((2, 0, 0, "", ()), ch)
        k = st[1]
        return (1, k + 1) if k < 4 and ch == NONE_TEXT[k] else None

    def run(self, st: tuple, s: str):
        for ch in s:
            st = self.step(st, ch)
            if st is None:
                return None
        return st

    def is_complete(self, st: tuple) -> bool:
        return st[0] == 3 or st == (1, 4)

    def is_final(self, st: tuple) -> bool:
        """Complete and nothing but EOS may follow."""
        return st == (1, 4) or (st[0] == 3 and st[1] >= self.max_objects)

    def representative_states(self) -> list:
        """The least restrictive state at every template position."""
        out = [_START, (1, 1), (1, 2), (1, 3), (3, 0)]
        for f in range(self.nf):
            for p in range(FIELD_LEN + (1 if f < self.nf - 1 else 0)):
                out.append((2, 0, f, "0.000"[:p], ("0.000",) * f))
        return out


class SpatialVocab:
    """Per tokenizer and kind: the candidate tokens and their trie."""

    def __init__(self, kind: str, tokens, special_ids, vocab_size: int) -> None:
        probe = SpatialAutomaton(kind, 10**6)
        reps = probe.representative_states()
        item_reps = [s for s in reps if s[0] in (2, 3)]
        self.text: dict[int, str] = {}
        self.root = _Node()
        longest_item = 0
        for i, b in enumerate(tokens):
            if b is None or i in special_ids or i >= vocab_size or not b:
                continue
            try:
                s = b.decode("ascii")
            except UnicodeDecodeError:
                continue
            if not set(s) <= ALPHABET:
                continue
            if not any(probe.run(r, s) is not None for r in reps):
                continue
            self.text[i] = s
            node = self.root
            for ch in s:
                node = node.children.setdefault(ch, _Node())
            node.ids.append(i)
            if any(probe.run(r, s) is not None for r in item_reps):
                longest_item = max(longest_item, len(s))
        # a token spans at most this many characters inside the item template
        self.max_item_len = longest_item


class SpatialGrammar(CompiledGrammar):
    """Compiled point/box grammar; holds the memo of masks shared by its matchers."""

    __slots__ = ("spec", "vocab_size", "eos_token_ids", "n_words", "auto", "vocab", "_L", "_K",
                 "_memo", "_eos_entry", "memo_enabled", "memo_misses")

    def __init__(self, spec: GrammarSpec, svocab: SpatialVocab, vocab_size: int, eos_ids: tuple) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_ids
        self.n_words = mask_words(vocab_size)
        self.auto = SpatialAutomaton(spec.kind, spec.max_objects)
        self.vocab = svocab
        L = svocab.max_item_len
        self._L = L
        self._K = L // self.auto.item_len + 2
        self._memo: dict = {}
        self._eos_entry = ids_to_words(eos_ids, vocab_size)
        self.memo_enabled = True
        self.memo_misses = 0

    def matcher(self) -> "SpatialMatcher":
        return SpatialMatcher(self)

    # -- mask construction -------------------------------------------------
    def key(self, st: tuple) -> tuple:
        """Everything about ``st`` that the next token's acceptance depends on."""
        tag = st[0]
        if tag == 2:
            _, done, f, cur, vals = st
            p = len(cur)
            rem = min(self.auto.max_objects - done, self._K)
            lo_rest = None
            lf = self.auto.lower.get(f)
            if lf is not None:
                lo = vals[lf]
                if cur == lo[:p]:
                    lo_rest = lo[p : p + self._L]  # the digits one token can reach
            fut = None
            if self.auto.lower:  # box: bounds of later fields that one token can reach
                if f < 2:
                    if (FIELD_LEN - p) + 6 * (1 - f) + 1 < self._L:
                        fut = (cur, vals)
                elif f == 2 and (FIELD_LEN - p) + 1 < self._L:
                    fut = vals[1]
            return (2, rem, f, p, cur == HI[:p], lo_rest, fut)
        if tag == 3:
            return (3, min(self.auto.max_objects - st[1], self._K))
        return st

    def allowed_ids(self, st: tuple) -> list:
        """Token ids allowed after state ``st`` (trie walk, no memo)."""
        step = self.auto.step
        ids: list = []
        stack = [(self.vocab.root, st)]
        while stack:
            node, s = stack.pop()
            for ch, child in node.children.items():
                s2 = step(s, ch)
                if s2 is None:
                    continue
                if child.ids:
                    ids.extend(child.ids)
                if child.children:
                    stack.append((child, s2))
        if self.auto.is_complete(st):
            ids.extend(self.eos_token_ids)
        return ids

    def entry(self, st: tuple) -> tuple:
        if not self.memo_enabled:
            return ids_to_words(self.allowed_ids(st), self.vocab_size)
        k = self.key(st)
        e = self._memo.get(k)
        if e is None:
            self.memo_misses += 1
            e = ids_to_words(self.allowed_ids(st), self.vocab_size)
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[k] = e
        return e


class SpatialMatcher(Matcher):
    """Per-request state of a point/box grammar (see ``Matcher`` in the package)."""

    __slots__ = ("_g", "_st", "_parts", "_ids", "_finished")

    def __init__(self, g: SpatialGrammar) -> None:
        self._g = g
        self.reset()

    def reset(self) -> None:
        self._st = _START
        self._parts: list = []
        self._ids: list = []
        self._finished = False

    def fill_mask(self, out: np.ndarray) -> None:
        g = self._g
        self._check_row(out)
        idx, vals = g._eos_entry if self._finished else g.entry(self._st)
        out.fill(0)
        out[idx] = vals

    def accept(self, token_id: int) -> bool:
        if self._finished:
            raise GrammarError("matcher is terminated (EOS was accepted); it must not be advanced")
        g = self._g
        if token_id in g.eos_token_ids:
            if not g.auto.is_complete(self._st):
                return False
            self._finished = True
            self._ids.append(token_id)
            return True
        s = g.vocab.text.get(token_id)
        if s is None:
            return False
        st = g.auto.run(self._st, s)
        if st is None:
            return False
        self._st = st
        self._parts.append(s)
        self._ids.append(token_id)
        return True

    @property
    def is_complete(self) -> bool:
        return self._finished or self._g.auto.is_complete(self._st)

    @property
    def is_terminated(self) -> bool:
        return self._finished or self._g.auto.is_final(self._st)

    @property
    def eos_accepted(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def output(self, text: str | None = None):
        if text is None:
            self._require_complete()
            text = self.text
        return parse_spatial(self._g.spec, text)


def parse_spatial(spec: GrammarSpec, text: str) -> dict:
    """Parse point/box text into Moondream's result shapes; GrammarError if the
    text is not a complete, valid output of ``spec``."""
    kind, max_objects = spec.kind, spec.max_objects
    names = FIELDS[kind]
    key = RESULT_KEY[kind]
    if not isinstance(text, str):
        raise GrammarError(f"{kind} output must be a string, got {type(text).__name__}")
    if text == NONE_TEXT:
        return {key: []}
    if not text:
        raise GrammarError(f"{kind} output is empty (an empty list is written {NONE_TEXT!r})")
    items = text.split(";")
    if len(items) > max_objects:
        raise GrammarError(f"{kind} output has {len(items)} items, more than max_objects={max_objects}")
    result = []
    for n, item in enumerate(items):
        parts = item.split(",")
        if len(parts) != len(names):
            raise GrammarError(f"{kind} item {n} must have {len(names)} comma-separated coordinates, got {item!r}")
        for name, v in zip(names, parts):
            if not _COORD.fullmatch(v):
                raise GrammarError(
                    f"{kind} item {n}: {name} must be a number in [0, 1] with exactly 3 decimals, got {v!r}"
                )
        obj = {name: float(v) for name, v in zip(names, parts)}
        if kind == "box":
            for a, b in (("x_min", "x_max"), ("y_min", "y_max")):
                if obj[a] > obj[b]:
                    raise GrammarError(f"box item {n}: {a}={obj[a]} > {b}={obj[b]}")
        result.append(obj)
    return {key: result}

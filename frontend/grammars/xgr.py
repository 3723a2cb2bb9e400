"""regex, json_schema and EBNF grammars, backed by xgrammar (CPU).

xgrammar is imported lazily (it imports torch), so a server that only uses
point/box grammars never loads it.

JSON is compiled with ``any_whitespace=False``: the output is laid out like
``json.dumps`` (``", "`` and ``": "`` separators, no newlines), which is what
models emit anyway and keeps a sampled output from padding itself with
whitespace until max_tokens.
"""
from __future__ import annotations

import json
import re
import threading
from functools import lru_cache

import numpy as np

from .base import CompiledGrammar, Matcher
from .bitmask import BITMASK_DTYPE, ids_to_words, mask_words
from .spec import TEXT_KINDS, GrammarError, GrammarSpec

# "[19:34:51] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> "Regex parsing error ..."
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def library_message(e: BaseException) -> str:
    msg = str(e).strip()
    return _LOG_PREFIX.sub("", msg).strip() or type(e).__name__


def _xgr():
    import xgrammar  # noqa: PLC0415 - lazy on purpose (pulls in torch)

    return xgrammar


# xgrammar 0.2.9 writes strings with minLength/maxLength as
# ``"\"" chars{m,n} "\""`` with ``chars ::= [^\"\\\r\n]``, which admits raw
# control characters (invalid JSON: json.loads and JSON.parse reject them).
# The plain-string rule excludes them; the bounded one is patched to match.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_grammar(xgr, schema_json: str):
    g = xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)
    ebnf = str(g)
    fixed = ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)
    if fixed != ebnf:
        try:
            g = xgr.Grammar.from_ebnf(fixed)
        except Exception:  # pragma: no cover - printer/parser mismatch in another version
            pass  # keep the library's grammar; parse_output still rejects control chars
    return g


def compile_xgr(compiler, spec: GrammarSpec):
    """Compile ``spec`` with an ``xgrammar.GrammarCompiler``; GrammarError on a
    pattern or schema the library rejects."""
    try:
        if spec.kind == "regex":
            return compiler.compile_regex(spec.pattern)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.grammar)
        return compiler.compile_grammar(_json_grammar(_xgr(), spec.schema_json))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
        what = {"regex": "regex", "ebnf": "EBNF grammar"}.get(spec.kind, "JSON schema")
        raise GrammarError(f"invalid {what}: {library_message(e)}") from e


_checker_lock = threading.Lock()


@lru_cache(maxsize=1)
def _string_compiler():
    xgr = _xgr()
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1)


@lru_cache(maxsize=128)
def _checker_grammar(spec: GrammarSpec):
    with _checker_lock:
        return compile_xgr(_string_compiler(), spec)


def check_string(spec: GrammarSpec, text: str) -> None:
    """GrammarError unless ``text`` is a complete match of the regex / schema."""
    if not isinstance(text, str):
        raise GrammarError(f"{spec.kind} output must be a string, got {type(text).__name__}")
    m = _xgr().GrammarMatcher(_checker_grammar(spec))
    if not m.accept_string(text.encode("utf-8")):
        raise GrammarError(f"output does not match the {spec.kind} grammar: {text!r}")
    if not m.is_completed():
        raise GrammarError(f"output is incomplete for the {spec.kind} grammar: {text!r}")


def parse_xgr(spec: GrammarSpec, text: str):
    check_string(spec, text)
    if spec.kind in TEXT_KINDS:
        return text
    try:
        return json.loads(text)
    except ValueError as e:  # pragma: no cover - the grammar only admits JSON
        raise GrammarError(f"output is not valid JSON: {e}") from None


class XGrammar(CompiledGrammar):
    """A compiled regex / json_schema grammar."""

    __slots__ = ("spec", "compiled", "tokens", "vocab_size", "eos_token_ids", "n_words", "_eos_entry",
                 "_special", "_special_entry")

    def __init__(self, spec: GrammarSpec, compiled, tokens, special_ids, vocab_size: int, eos_ids: tuple) -> None:
        self.spec = spec
        self.compiled = compiled
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_ids
        self.n_words = mask_words(vocab_size)
        self._eos_entry = ids_to_words(eos_ids, vocab_size)
        # xgrammar only knows the ids past the tokenizer as special: with some
        # tokenizers (SmolLM2) it lets "<|im_start|>" or even "<|im_end|>" be
        # *text* inside a string or a regex. Control tokens are never text here,
        # and EOS is allowed exactly when the grammar is complete.
        self._special = frozenset(special_ids) | frozenset(eos_ids)
        self._special_entry = ids_to_words(self._special, vocab_size)

    def matcher(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self)


class XGrammarMatcher(Matcher):
    """Per-request state of a regex / json_schema grammar."""

    __slots__ = ("_g", "_m", "_bytes", "_ids", "_finished", "_final", "_scratch")

    def __init__(self, g: XGrammar) -> None:
        self._g = g
        self._m = _xgr().GrammarMatcher(
            g.compiled, override_stop_tokens=list(g.eos_token_ids), terminate_without_stop_token=False
        )
        self._scratch = np.zeros(g.n_words, dtype=BITMASK_DTYPE)
        self._bytes = bytearray()
        self._ids: list = []
        self._finished = False
        self._final = None  # cached "only EOS may follow" for the current state

    def reset(self) -> None:
        self._m.reset()
        self._bytes = bytearray()
        self._ids = []
        self._finished = False
        self._final = None

    def fill_mask(self, out: np.ndarray) -> None:
        g = self._g
        self._check_row(out)
        if self._finished:
            idx, vals = g._eos_entry
            out.fill(0)
            out[idx] = vals
            return
        self._m.fill_next_token_bitmask(out)
        idx, vals = g._special_entry
        out[idx] &= ~vals
        if self._m.is_completed():
            idx, vals = g._eos_entry
            out[idx] |= vals

    def accept(self, token_id: int) -> bool:
        if self._finished:
            raise GrammarError("matcher is terminated (EOS was accepted); it must not be advanced")
        tid = int(token_id)
        g = self._g
        if not 0 <= tid < g.vocab_size:
            return False
        if tid in g._special:
            if tid not in g.eos_token_ids or not self._m.is_completed():
                return False
        if not self._m.accept_token(tid):
            return False
        self._ids.append(tid)
        self._final = None
        if tid in g.eos_token_ids:
            self._finished = True
        else:
            b = self._g.tokens[tid]
            if b:
                self._bytes += b
        return True

    @property
    def is_complete(self) -> bool:
        return self._finished or self._m.is_completed()

    @property
    def is_terminated(self) -> bool:
        if self._finished or self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        if self._final is None:
            self._m.fill_next_token_bitmask(self._scratch)
            idx, vals = self._g._special_entry  # EOS included
            self._scratch[idx] &= ~vals
            self._final = not self._scratch.any()
        return self._final

    @property
    def eos_accepted(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        return self._bytes.decode("utf-8", errors="replace")

    def output(self, text: str | None = None):
        if text is None:
            self._require_complete()
            try:
                text = bytes(self._bytes).decode("utf-8")
            except UnicodeDecodeError as e:
                raise GrammarError(f"output is not valid UTF-8: {e}") from None
            if self.spec.kind in TEXT_KINDS:
                return text
            try:
                return json.loads(text)
            except ValueError as e:
                raise GrammarError(f"output is not valid JSON: {e}") from None
        return parse_xgr(self.spec, text)

"""Incremental detokenization with stop strings, constant work per token.

Invariants:

* ``"".join(add(t) for t in ids) + finish()`` equals the tokenizer's decode of
  ``ids`` (no cleanup of tokenization spaces: that post-processing is not
  incremental) up to the first stop string, which is cut off.
* ``add`` decodes only a sliding window of token ids (the vLLM/TGI
  ``prefix_offset``/``read_offset`` technique: the window starts a few tokens
  before the unreleased ones so tokenizers that treat the first token of a
  decode specially still produce the right text). The window and every buffer
  are bounded, so per-token work does not grow with the length of the text.
* Text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens) is
  held back until the sequence completes; a long run of undecodable bytes is
  released at the last token boundary that splits cleanly, so it cannot grow
  the window without bound.
* Any suffix of the produced text that is a prefix of some stop string is held
  back, so no character of a stop string match is ever returned. The first
  stop string to *complete* in the character stream wins (ties: the one that
  started first), which makes the result independent of how the text was
  split into tokens. After a stop, ``stopped`` is True, ``text`` ends right
  before the stop string (right after it with ``include_stop``), and
  ``add``/``finish`` return "".
* With ``min_tokens`` (vLLM's), a stop string matches only once more than
  ``min_tokens`` tokens were added, and only where it ends in the text of those
  later tokens (as vLLM checks the new text of each token).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5      # prompt tokens kept before the first generated one
MAX_PENDING = 4         # tokens an incomplete UTF-8 tail may span (<= 4 bytes)
HARD_PENDING = 32       # past this, release even undecodable text as it is


def _make_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """Fastest exact decode available: the Rust ``tokenizers`` backend when the
    tokenizer has one, else the tokenizer's own ``decode``."""
    try:
        import tokenizers
        backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else \
            getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, tokenizers.Tokenizer):
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    except ImportError:
        pass
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Per-sequence streaming detokenizer (see the module docstring).

    ``prompt_ids_tail``: the last few prompt token ids (only the last
    ``CONTEXT_TOKENS`` are used), giving the first generated token its decode
    context; their text is never returned. ``stop``: stop strings (empty
    strings are ignored).
    """

    def __init__(self, tokenizer, prompt_ids_tail: Optional[Sequence[int]] = None,
                 stop: Iterable[str] = (), skip_special_tokens: bool = True, include_stop: bool = False,
                 min_tokens: int = 0):
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        # Window of token ids; offsets are relative to it (it is trimmed as
        # text is released, so memory stays bounded too).
        tail = [] if prompt_ids_tail is None else [int(t) for t in prompt_ids_tail[-CONTEXT_TOKENS:]]
        self._ids: list[int] = tail
        self._prefix = 0                 # start of the decode window
        self._read = len(self._ids)      # ids before this are released
        self._prefix_text: Optional[str] = None  # cache of decode(ids[prefix:read])
        self._stops = [s for s in dict.fromkeys(stop) if s]
        # Every proper prefix of every stop string, to find what to hold back.
        self._stop_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._held = ""                  # decoded, held back as a possible stop start
        self._chunks: list[str] = []
        self._text_cache = ""
        self.stopped = False
        self.stop_str: Optional[str] = None  # the stop string that matched
        self.finished = False
        self.num_tokens = 0

    # ------------------------------------------------------------------ API
    @property
    def text(self) -> str:
        """All text released so far (the completion, without any stop string)."""
        if self._chunks:
            self._text_cache += "".join(self._chunks)
            self._chunks.clear()
        return self._text_cache

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the newly safe text (maybe "")."""
        if self.stopped or self.finished:
            return ""
        self.num_tokens += 1
        self._ids.append(int(token_id))
        return self._release(self._advance(), final=False)

    def finish(self) -> str:
        """End of generation (EOS / length): flush everything held back."""
        if self.stopped or self.finished:
            return ""
        self.finished = True
        rest = ""
        if len(self._ids) > self._read:
            rest = self._decode(self._ids[self._prefix:])[len(self._get_prefix_text()):]
        return self._release(rest, final=True)

    # ------------------------------------------------------- token -> text
    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._prefix_text

    def _mark_read(self, upto: int) -> None:
        """ids[:upto] are released; the next window starts at the old read
        offset (context for the next decode) and older ids are dropped."""
        self._prefix, self._read = self._read, upto
        self._prefix_text = None
        if self._prefix:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _advance(self) -> str:
        """Decode the window; return the text of newly complete tokens."""
        new_text = self._decode(self._ids[self._prefix:])
        prefix_text = self._get_prefix_text()
        pending = len(self._ids) - self._read
        if not new_text.endswith(REPLACEMENT):
            if len(new_text) > len(prefix_text):
                self._mark_read(len(self._ids))
                return new_text[len(prefix_text):]
            if pending > MAX_PENDING:  # tokens with no visible text (skipped specials)
                self._mark_read(len(self._ids))
            return ""
        if pending <= MAX_PENDING:
            return ""  # an incomplete UTF-8 sequence may still complete
        # A run of undecodable bytes: release up to the last boundary whose
        # head and tail decode independently (their text can no longer change).
        for k in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._ids[self._prefix:k])
            if len(head) > len(prefix_text) and head + self._decode(self._ids[k:]) == new_text:
                self._mark_read(k)
                return head[len(prefix_text):]
        if pending > HARD_PENDING:
            self._mark_read(len(self._ids))
            return new_text[len(prefix_text):]
        return ""

    # ---------------------------------------------------------- stop strings
    def _release(self, delta: str, final: bool) -> str:
        if not self._stops:
            return self._emit(delta)
        buf = self._held + delta
        match = None  # (end, start, stop): earliest end, then earliest start
        # Held text completes no stop (it would have matched), except text held while min_tokens was
        # not reached: a match must end in the new text.
        checked = self.num_tokens > self._min_tokens
        for s in self._stops if checked else ():
            i = buf.find(s, max(0, len(self._held) - len(s) + 1))
            if i >= 0 and (match is None or (i + len(s), i) < match[:2]):
                match = (i + len(s), i, s)
        if match is not None:
            self.stopped, self.stop_str, self._held = True, match[2], ""
            return self._emit(buf[:match[0] if self._include_stop else match[1]])
        keep = 0
        if not final:
            for k in range(min(self._max_prefix, len(buf)), 0, -1):
                if buf[-k:] in self._stop_prefixes:
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._emit(buf[:len(buf) - keep])

    def _emit(self, s: str) -> str:
        if s:
            self._chunks.append(s)
        return s

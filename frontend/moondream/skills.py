"""Moondream skill requests in the frontend: validate, render the prompt, read the answer (torch-free).

A skill request (PROTOCOL.md) is ``{"skill": "caption", "length": ...}``, ``{"skill": "query",
"question", "reasoning", "spatial_refs"}`` or ``{"skill": "point" | "detect", "object",
"max_objects"}``. :func:`plan` turns it into what the worker runs: the prompt ids after the
image block, the device task (first phase and limits, ``gpu_worker/moondream_skills.py``), the
spatial refs' values, and the token budget. :func:`answer` turns the committed tokens and their
region values back into the reference's result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from shared.moondream_config import (ANSWER_FIRST, COORD_ID, DECIDE, EOS_ID, GROUND_END_ID, GROUND_START_ID,
                                     MOONDREAM2_RULES, REASON, SkillRules)

from frontend.moondream import prompts
from frontend.protocol.wire import SKILLS, SkillError, skill_max_objects, skill_text
PREFIX_LEN = 730  # the image block: BOS + 729 image positions, filled by the worker
MAX_REFS = 64


@dataclass(frozen=True)
class Plan:
    skill: str
    prompt_ids: list[int]  # after the image block (or from position 0 without an image)
    phase: int
    max_tokens: int  # the whole output: reasoning + 3 + answer, or 2-3 tokens per object + eos
    limit: int = 0
    answer_limit: int = 0
    detect: bool = False
    coords: list[float] = field(default_factory=list)  # the values of the prompt's coord tokens, in order
    sizes: list[list[float]] = field(default_factory=list)  # ... of its size tokens

    def task(self) -> dict[str, Any]:
        """The Submit message's ``skill`` field."""
        return {"phase": self.phase, "detect": self.detect, "limit": self.limit,
                "answer_limit": self.answer_limit, "coords": self.coords, "sizes": self.sizes}


def _refs(v: Any, has_image: bool) -> list[list[float]]:
    if v is None:
        return []
    if not has_image:
        raise SkillError("spatial_refs: spatial refs need an image")
    if not isinstance(v, list) or len(v) > MAX_REFS:
        raise SkillError(f"spatial_refs must be a list of at most {MAX_REFS} points or boxes")
    out = []
    for i, ref in enumerate(v):
        if (not isinstance(ref, list) or len(ref) not in (2, 4)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ref)):
            raise SkillError(f"spatial_refs[{i}] must be [x, y] or [x1, y1, x2, y2]")
        if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in ref):
            raise SkillError(f"spatial_refs[{i}]: values must lie in [0, 1]")
        out.append([float(x) for x in ref])
    return out


def plan(request: dict[str, Any], encode: Callable[[str], list[int]], has_image: bool, max_tokens: int | None,
         max_question_tokens: int = 1024, rules: SkillRules = MOONDREAM2_RULES) -> Plan:
    """The worker's side of a skill request, under the model's rules (its family's); SkillError names
    the bad field."""
    skill = request.get("skill")
    if skill not in SKILLS:
        raise SkillError(f"skill must be one of {', '.join(SKILLS)}, got {skill!r}")
    if skill != "query" and not has_image:
        raise SkillError(f"images: {skill} needs one image")
    if skill == "caption":
        length = request.get("length", "normal")
        if length not in prompts.CAPTION:
            raise SkillError(f"length must be one of {', '.join(prompts.CAPTION)}, got {length!r}")
        n = max_tokens or 768
        return Plan(skill, prompts.caption_ids(length), ANSWER_FIRST, n, limit=n)
    if skill == "query":
        question = skill_text("question", request.get("question"))
        refs = _refs(request.get("spatial_refs"), has_image)
        reasoning = request.get("reasoning", False)
        if not isinstance(reasoning, bool):
            raise SkillError("reasoning must be a boolean")
        if len(encode(question)) > max_question_tokens:
            raise SkillError(f"question: more than {max_question_tokens} tokens")
        ids = prompts.query_ids(encode, question, refs, reasoning, image=has_image, doubled_answer=rules.doubled_answer)
        coords, sizes = prompts.spatial_ref_values(refs)
        n = max_tokens or 768
        if reasoning:  # max_tokens bounds the reasoning and the answer separately (+ the answer token)
            return Plan(skill, ids, REASON, 2 * n + 1, limit=n, answer_limit=n, coords=coords,
                        sizes=[list(s) for s in sizes])
        return Plan(skill, ids, ANSWER_FIRST, n, limit=n, coords=coords, sizes=[list(s) for s in sizes])
    obj = skill_text("object", request.get("object"))
    if len(encode(" " + obj)) > max_question_tokens:
        raise SkillError(f"object: more than {max_question_tokens} tokens")
    n = skill_max_objects(request.get("max_objects", rules.default_max_objects), rules.max_objects)
    detect = skill == "detect"
    ids = (prompts.detect_ids if detect else prompts.point_ids)(encode, obj)
    return Plan(skill, ids, DECIDE, (3 if detect else 2) * n + 1, limit=n, detect=detect)


def chat_query(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """An image chat (OpenAI's messages with an image part) as Moondream's query skill: one user
    message, its text the question. Moondream's prompt has no place for a system message or earlier
    turns: they are refused, never dropped silently."""
    if len(messages) != 1 or messages[0].get("role") != "user":
        raise SkillError("messages: a Moondream model answers one user message about its image (the query skill)")
    content = messages[0].get("content")
    parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content if p.get("type") == "text"]
    return {"skill": "query", "question": " ".join(t.strip() for t in parts if t and t.strip())}


def _clamp(box: dict[str, float]) -> dict[str, float]:
    return {k: min(max(v, 0.0), 1.0) for k, v in box.items()}


def answer(p: Plan, token_ids: list[int], values: list, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """The ``done`` fields of a skill: ``text`` and ``token_ids`` of the answer; ``output`` for
    point/detect (boxes clamped to [0, 1], as Photon returns them); ``reasoning`` for a reasoning query."""
    if p.skill in ("point", "detect"):
        found = prompts.parse_objects(token_ids, values, p.detect)
        if p.detect:
            return {"text": "", "token_ids": list(token_ids), "output": {"objects": [_clamp(b) for b in found]}}
        return {"text": "", "token_ids": list(token_ids), "output": {"points": found}}
    if p.phase != REASON:
        tokens = [t for t in token_ids if t != EOS_ID]
        return {"text": decode(tokens), "token_ids": tokens}
    # The reasoning may begin with eos (its first token is not suppressed): only the answer's ends it.
    reasoning, answer_ids = prompts.split_reasoning(token_ids)
    answer_ids = [t for t in answer_ids if t != EOS_ID]
    return {"text": decode(answer_ids), "token_ids": answer_ids,
            "reasoning": {"text": decode(reasoning), "token_ids": reasoning,
                          "grounding": grounding(reasoning, values[:len(reasoning)], decode)}}


def grounding(tokens: list[int], values: list, decode) -> list[dict]:
    """The reference's grounding spans: tokens 7/9 open and close chunks; a chunk with coord tokens
    gives {start_idx, end_idx (char offsets), points}."""
    chunks, coords = [[]], [[]]
    for tok, v in zip(tokens, values):
        if tok in (GROUND_START_ID, GROUND_END_ID):
            chunks.append([])
            coords.append([])
        chunks[-1].append(tok)
        if tok == COORD_ID:
            coords[-1].append(v[0])
    out, start = [], 0
    for chunk, cs in zip(chunks, coords):
        text = decode(chunk)
        if len(cs) > 1:
            out.append({"start_idx": start, "end_idx": start + len(text),
                        "points": [[cs[i], cs[i + 1]] for i in range(0, len(cs) - len(cs) % 2, 2)]})
        start += len(text)
    return out


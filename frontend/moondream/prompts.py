"""Moondream's prompts: the token templates of each skill (MOONDREAM.md §3), torch-free; Moondream 3's
are the same but for a plain query's answer token, which is not doubled (MOONDREAM3.md §3).

An image prompt is the 730-position image block (BOS + 729 image embeddings, filled by the
worker) followed by these ids; a query without an image starts with BOS itself and is causal
from position 0. ``encode`` is the tokenizer's ``text -> ids`` without special tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

from shared.moondream_config import ANSWER_ID, BOS_ID, COORD_ID, SIZE_ID, THINKING_ID

CAPTION = {
    "short": [1, 32708, 2, 12492, 3],
    "normal": [1, 32708, 2, 6382, 3],
    "long": [1, 32708, 2, 4059, 3],
}
QUERY_PREFIX = [1, 15381, 2]
DETECT_PREFIX = [1, 7235, 476, 2]
POINT_PREFIX = [1, 2581, 2]

Encode = Callable[[str], list[int]]


def caption_ids(length: str) -> list[int]:
    if length not in CAPTION:
        raise ValueError(f"length must be one of {', '.join(CAPTION)}, got {length!r}")
    return list(CAPTION[length])


def spatial_ref_ids(refs: Sequence[Sequence[float]]) -> list[int]:
    """A point (x, y) takes two coord positions, a box (x1, y1, x2, y2) two coord and one size."""
    out: list[int] = []
    for ref in refs:
        out += [COORD_ID, COORD_ID] if len(ref) == 2 else [COORD_ID, COORD_ID, SIZE_ID]
    return out


def spatial_ref_values(refs: Sequence[Sequence[float]]) -> tuple[list[float], list[tuple[float, float]]]:
    """The values of the coord positions (in order: a point's x, y; a box's centre) and of the size
    positions (a box's width, height), as the reference computes them (in double precision)."""
    coords: list[float] = []
    sizes: list[tuple[float, float]] = []
    for ref in refs:
        if len(ref) == 2:
            coords += [ref[0], ref[1]]
        else:
            x1, y1, x2, y2 = ref
            coords += [(x1 + x2) / 2, (y1 + y2) / 2]
            sizes.append((x2 - x1, y2 - y1))
    return coords, sizes


def query_ids(encode: Encode, question: str, spatial_refs: Sequence[Sequence[float]] = (),
              reasoning: bool = False, image: bool = True, doubled_answer: bool = True) -> list[int]:
    """The answer token 3 really is doubled in moondream2 (not in moondream3); a reasoning query ends
    in the thinking token instead (after 3 in moondream2), and its answer is prompted with one more
    3 after the reasoning."""
    ids = ([] if image else [BOS_ID]) + QUERY_PREFIX + spatial_ref_ids(spatial_refs) + encode(question)
    if not doubled_answer:
        return ids + [THINKING_ID if reasoning else ANSWER_ID]
    return ids + [ANSWER_ID, THINKING_ID if reasoning else ANSWER_ID]


def point_ids(encode: Encode, obj: str) -> list[int]:
    return POINT_PREFIX + encode(" " + obj) + [ANSWER_ID]


def detect_ids(encode: Encode, obj: str) -> list[int]:
    return DETECT_PREFIX + encode(" " + obj) + [ANSWER_ID]


def parse_objects(tokens: Sequence[int], values: Sequence[Sequence[float]], detect: bool) -> list[dict]:
    """A point/detect output (``coord`` x, ``coord`` y[, ``size`` (w, h)] per object, then eos) with
    each token's region values (coord, w, h) -> the reference's points or (unclamped) boxes."""
    out, coords = [], []
    for tok, (c, w, h) in zip(tokens, values):
        if tok == COORD_ID:
            coords.append(c)
            if not detect and len(coords) == 2:
                out.append({"x": coords[0], "y": coords[1]})
                coords = []
        elif tok == SIZE_ID and detect and len(coords) == 2:
            x, y = coords
            out.append({"x_min": x - w / 2, "y_min": y - h / 2, "x_max": x + w / 2, "y_max": y + h / 2})
            coords = []
    return out


def split_reasoning(tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """A reasoning query's output: the reasoning, the answer token that ends it, the answer."""
    tokens = list(tokens)
    if ANSWER_ID not in tokens:
        return tokens, []
    i = tokens.index(ANSWER_ID)
    return tokens[:i], tokens[i + 1:]

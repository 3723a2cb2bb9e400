"""Moondream-style skills on a vision-language model: caption, query, point, detect.

One table per model family says how each skill is asked (prompt text) and
with which defaults (sampling, grammar); everything that turns a skill into a
``generate`` and its result into Moondream's shapes is here, so the Python
client, the CLI and any HTTP route ask the same way. Pure Python, no I/O:

    fields = skill_request("point", object="the cat")       # generate fields (messages, grammar, sampling)
    shape = skill_output("point", result_text, result_output)  # {"points": [{"x", "y"}, ...]}

The image itself travels beside these fields (``images``: one encoded file,
placed by the ``{"type": "image"}`` part of the user message).

SmolVLM (Idefics3) is not trained for grounding: with the point and box
grammars its answers are always well-formed coordinates in [0, 1], but they
are not accurate locations.
"""
from __future__ import annotations

from typing import Any

SKILLS = ("caption", "query", "point", "detect")
CAPTION_LENGTHS = ("short", "normal", "long")
DEFAULT_FAMILY = "smolvlm"

# Sampling defaults: query and caption sample gently, point and detect are greedy under a grammar.
_GENTLE = {"temperature": 0.2, "top_p": 0.9}
_GREEDY = {"temperature": 0.0}

FAMILIES: dict[str, dict[str, Any]] = {
    "smolvlm": {
        "caption": {
            "short": ("Describe this image in one short sentence.", 64),
            "normal": ("Describe this image.", 256),
            "long": ("Describe this image in detail.", 512),
        },
        "query": ("{question}", 256),
        "point": ("Point to every {object} in the image.", 256),
        "detect": ("Give the bounding box of every {object} in the image.", 256),
    },
}


def skill_request(skill: str, family: str = DEFAULT_FAMILY, *, length: str = "normal", question: str | None = None,
                  object: str | None = None, max_objects: int = 16) -> dict[str, Any]:
    """The ``generate`` fields (minus ``id``, ``images`` and ``stream``) that ask ``skill`` of one image.

    caption: ``length`` in short / normal / long; query: ``question``; point and detect: ``object``.
    ``ValueError`` for an unknown skill, family or length, or a missing argument.
    """
    table = FAMILIES.get(family)
    if table is None:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    if skill == "caption":
        if length not in CAPTION_LENGTHS:
            raise ValueError(f"length must be one of {', '.join(CAPTION_LENGTHS)}, got {length!r}")
        text, max_tokens = table["caption"][length]
        fields: dict[str, Any] = dict(_GENTLE)
    elif skill == "query":
        if not question:
            raise ValueError("query needs a question")
        template, max_tokens = table["query"]
        text, fields = template.format(question=question), dict(_GENTLE)
    elif skill in ("point", "detect"):
        if not object:
            raise ValueError(f"{skill} needs an object to look for")
        template, max_tokens = table[skill]
        kind = "point" if skill == "point" else "box"
        text = template.format(object=object)
        fields = dict(_GREEDY, grammar={"kind": kind, "max_objects": int(max_objects)})
    else:
        raise ValueError(f"unknown skill {skill!r}; known: {', '.join(SKILLS)}")
    content = [{"type": "image"}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **fields}


def skill_output(skill: str, text: str, output: Any = None) -> dict[str, Any]:
    """A finished generate as Moondream returns the skill: ``{"caption"}``, ``{"answer"}``,
    ``{"points": [{"x", "y"}]}`` or ``{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}``."""
    if skill == "caption":
        return {"caption": text.strip()}
    if skill == "query":
        return {"answer": text.strip()}
    if skill in ("point", "detect"):
        key = "points" if skill == "point" else "objects"
        if not isinstance(output, dict) or key not in output:
            raise ValueError(f"{skill}: the answer is not a complete {key} list (did generation stop early?)")
        return {key: output[key]}
    raise ValueError(f"unknown skill {skill!r}; known: {', '.join(SKILLS)}")

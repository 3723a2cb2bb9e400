"""Moondream's skills (caption, query, point, detect) as generate requests: one definition.

The HTTP routes (``frontend/http/moondream.py``) and the Python client build
their requests here, so a skill's prompt, sampling defaults and grammar are
the same whichever way it is asked for:

- ``query`` / ``caption``: ``SKILL_SAMPLING`` (Moondream's defaults), free text;
- ``point`` / ``detect``: greedy, constrained by the ``point`` / ``box``
  grammar (``frontend/grammars``), so the answer always parses to
  ``{"points": [...]}`` / ``{"objects": [...]}``.

``settings`` is Moondream's ``{temperature, top_p, max_tokens, max_objects}``;
what it leaves out takes the skill's default. The result is a dict of the
ZeroMQ protocol's ``generate`` fields (``messages``, sampling, ``grammar``);
the server validates it like any other request. The image, when the model
takes one, travels beside these fields as the protocol's ``images``, added by
the caller (``_image`` in ``frontend/http/moondream.py``, ``skill_message`` in
``frontend/client/core.py``).
"""
from __future__ import annotations

from typing import Any, Mapping

from frontend.protocol.wire import (DEFAULT_MAX_OBJECTS, MAX_GRAMMAR_OBJECTS, SKILL_SAMPLING, SKILLS, SkillError,
                                    skill_max_objects, skill_text)

CAPTION_LENGTHS = {
    "short": ("Describe this image in one short sentence.", 64),
    "normal": ("Describe this image.", 256),
    "long": ("Describe this image in detail.", 512),
}
GREEDY = {"temperature": 0.0, "top_p": 1.0}
SETTINGS = ("temperature", "top_p", "max_tokens", "max_objects")


def caption(length: str = "normal", settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if length not in CAPTION_LENGTHS:
        raise SkillError(f"length must be one of {', '.join(CAPTION_LENGTHS)}, got {length!r}")
    prompt, max_tokens = CAPTION_LENGTHS[length]
    return _request(prompt, SKILL_SAMPLING, max_tokens, settings)


def query(question: str, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    skill_text("question", question)
    return _request(question, SKILL_SAMPLING, 512, settings)


def point(obj: str, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    skill_text("object", obj)
    return _located(f"Point at every {obj} in the image.", "point", settings)


def detect(obj: str, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    skill_text("object", obj)
    return _located(f"Give the bounding box of every {obj} in the image.", "box", settings)


def _located(prompt: str, kind: str, settings: Mapping[str, Any] | None) -> dict[str, Any]:
    s = _settings(settings)
    max_objects = skill_max_objects(s.pop("max_objects", DEFAULT_MAX_OBJECTS), MAX_GRAMMAR_OBJECTS,
                                    "settings.max_objects")
    per_item = 12 if kind == "point" else 24  # tokens per item (frontend/grammars), plus EOS
    req = _request(prompt, GREEDY, per_item * max_objects + 2, s)
    req["grammar"] = {"kind": kind, "max_objects": max_objects}
    return req


def _request(prompt: str, sampling: Mapping[str, Any], max_tokens: int,
             settings: Mapping[str, Any] | None) -> dict[str, Any]:
    s = _settings(settings)
    s.pop("max_objects", None)
    return {"messages": [{"role": "user", "content": prompt}], **sampling, "max_tokens": max_tokens, **s}


def _settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Moondream's settings map, unknown keys dropped and nulls meaning 'default'
    (types are checked by the server's validation, with the field named)."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise SkillError(f"settings must be an object, got {type(settings).__name__}")
    return {k: settings[k] for k in SETTINGS if settings.get(k) is not None}


def native(skill: str, fields: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The generate fields of a skill for a model with its own skills (Moondream 2): ``skill``
    and its fields, rendered and validated by the server (``frontend/moondream/skills.py``);
    Moondream's ``settings`` give the sampling fields and ``max_objects``."""
    s = _settings(settings)
    if skill in ("point", "detect") and "max_objects" in s:
        fields = {**fields, "max_objects": s["max_objects"]}
    s.pop("max_objects", None)
    if skill in ("point", "detect"):
        s.pop("max_tokens", None)  # the objects bound the answer
    return {"skill": skill, **{k: v for k, v in fields.items() if v is not None}, **s}


def skill_request(skill: str, *, length: str = "normal", question: str | None = None, obj: str | None = None,
                  max_objects: int | None = None, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The generate fields that ask ``skill`` of one image (the Python client's entry point):
    the user message is the image part, then the skill's text. ``max_objects`` None: the default."""
    s = dict(settings or {})
    if skill == "caption":
        req = caption(length, s)
    elif skill == "query":
        req = query(question, s)
    elif skill in ("point", "detect"):
        if max_objects is not None:
            s.setdefault("max_objects", max_objects)
        req = (point if skill == "point" else detect)(obj, s)
    else:
        raise SkillError(f"unknown skill {skill!r}; known: {', '.join(SKILLS)}")
    text = req["messages"][0]["content"]
    req["messages"] = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return req


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

"""The Moondream fixtures' cases as skill requests and as the ``done`` fields they expect (test
helper, one for Moondream 2 and 3: ``tests/data/moondream*_dev_expected.json``)."""
from __future__ import annotations

import io

from shared.moondream_random import make_image

_SKILL_FIELDS = {"caption": ("length",), "query": ("question", "reasoning", "spatial_refs"),
                 "point": ("object", "max_objects"), "detect": ("object", "max_objects")}


def fixture_png(images: dict, name: str) -> bytes:
    """The fixture's image ``name`` (``images``: the fixture's ``{name: [h, w, salt]}``) as a PNG file."""
    from PIL import Image

    h, w, salt = images[name]
    buf = io.BytesIO()
    Image.fromarray(make_image(h, w, salt)).save(buf, format="PNG")
    return buf.getvalue()


def skill_of(case: dict) -> dict:
    """The case as the protocol's skill fields."""
    return {"skill": case["skill"], **{k: case[k] for k in _SKILL_FIELDS[case["skill"]] if k in case}}


def expected_done(case: dict) -> dict:
    """The case as a skill's ``done`` fields (boxes clamped to [0, 1], as Photon returns them)."""
    if case["skill"] == "point":
        return {"output": {"points": case["points"]}}
    if case["skill"] == "detect":
        return {"output": {"objects": [{k: min(max(v, 0.0), 1.0) for k, v in o.items()} for o in case["objects"]]}}
    if case.get("reasoning"):
        return {"token_ids": case["token_ids"], "reasoning": {"token_ids": case["reasoning_token_ids"],
                                                              "grounding": case["grounding"]}}
    return {"token_ids": case["token_ids"]}


def done_fields(done: dict, case: dict) -> dict:
    """The fields of a ``done`` that :func:`expected_done` names, to compare with it."""
    want = expected_done(case)
    got = {k: done.get(k) for k in want}
    if "reasoning" in want:
        got["reasoning"] = {k: done["reasoning"][k] for k in want["reasoning"]}
    return got

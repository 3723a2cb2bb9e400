"""The Moondream references' own answers for the dev checkpoints, as engine requests.

``tests/data/moondream_dev_expected.json`` holds what the Moondream 2 reference implementation
answered (caption ×3, query, point, detect on three images, a reasoning query, spatial refs, a
text-only query; and the eos-biased checkpoint's early stops) for the checkpoint that
``shared.moondream_random`` rebuilds; ``moondream3_dev_expected.json`` the same for Moondream 3's
four checkpoints (plain, eos-biased ±4, without ``region.ln``). ``tests/models/test_moondream.py``
and ``test_moondream3.py`` check the CPU against them and ``bench.gpu_features`` (the ``moondream``
check) a GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from frontend.moondream import prompts
from frontend.moondream.images import overlap_crops
from shared.moondream_config import MOONDREAM2_RULES, SkillRules
from shared.moondream_random import MD3_DEV_CONFIG, make_image, write_checkpoint

_DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
EXPECTED = json.loads((_DATA / "moondream_dev_expected.json").read_text())
EXPECTED3 = json.loads((_DATA / "moondream3_dev_expected.json").read_text())
# name -> (uint8 crops [n, 3, 378, 378], tiling) of both fixtures' images.
IMAGES = {name: overlap_crops(make_image(h, w, salt))
          for name, (h, w, salt) in (EXPECTED["images"] | EXPECTED3["images"]).items()}


def write_checkpoints(root: Path) -> dict[str, Path]:
    """The fixture's two checkpoints ("plain" and "eos", which differs in lm_head.bias) under ``root``."""
    return {"plain": write_checkpoint(root / "dev"),
            "eos": write_checkpoint(root / "dev-eos", eos_bias=EXPECTED["eos_bias"])}


def md3_checkpoints(root: Path) -> dict[str, tuple[Path, list[dict]]]:
    """Moondream 3's four checkpoints under ``root``, each with its cases: name -> (directory, cases)."""
    out = {}
    for name, spec in EXPECTED3["checkpoints"].items():
        args = spec["args"]
        bias = float(args[args.index("--eos-bias") + 1]) if "--eos-bias" in args else 0.0
        path = write_checkpoint(root / f"md3-{name}", MD3_DEV_CONFIG, "md3dev", eos_bias=bias,
                                region_ln="--no-region-ln" not in args)
        out[name] = (path, EXPECTED3[spec["cases"]])
    return out


def encoder(checkpoint: Path):
    """text -> token ids with the checkpoint's tokenizer (no specials)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def engine_request(case, encode, prefix_len=730, rules: SkillRules = MOONDREAM2_RULES):
    """(prompt ids, sampling params, images, task) of a fixture case, as the frontend sends them
    for a model with these skill rules."""
    from gpu_worker.image_prefill import ImageInput
    from gpu_worker.moondream_skills import ANSWER_FIRST, DECIDE, REASON, SkillTask
    from shared.sampling import SamplingParams

    skill = case["skill"]
    image = "image" in case
    refs = case.get("spatial_refs", ())
    if skill == "caption":
        ids = prompts.caption_ids(case["length"])
    elif skill == "query":
        ids = prompts.query_ids(encode, case["question"], refs, case.get("reasoning", False), image=image,
                                doubled_answer=rules.doubled_answer)
    else:
        ids = (prompts.point_ids if skill == "point" else prompts.detect_ids)(encode, case["object"])
    prompt = [0] * prefix_len * image + ids
    coord = size = None
    if refs:
        coords, sizes = prompts.spatial_ref_values(refs)
        coord, size = np.zeros(len(prompt), np.float32), np.zeros((len(prompt), 2), np.float32)
        at = np.asarray(prompt)
        coord[at == prompts.COORD_ID], size[at == prompts.SIZE_ID] = coords, sizes
    if skill in ("point", "detect"):
        n = case["max_objects"]
        task = SkillTask(DECIDE, detect=skill == "detect", limit=n)
        max_tokens = (3 if skill == "detect" else 2) * n + 1
    elif case.get("reasoning"):
        task = SkillTask(REASON, limit=case["max_tokens"], answer_limit=case["max_tokens"])
        max_tokens = 2 * case["max_tokens"] + 1
    else:
        task = SkillTask(ANSWER_FIRST, limit=case["max_tokens"])
        max_tokens = case["max_tokens"]
    task = SkillTask(task.phase, task.detect, task.limit, task.answer_limit, coord, size)
    images = None
    if image:
        crops, tiling = IMAGES[case["image"]]
        images = [ImageInput(hash=case["image"], tiles=[crops[:1], crops[1:]], tiling=tiling)]  # as tile blocks hold them
    return prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), images, task


def engine_answer(case, seq):
    """A finished sequence's answer, in the fixture case's terms."""
    skill = case["skill"]
    if skill in ("point", "detect"):
        key = "points" if skill == "point" else "objects"
        return {key: prompts.parse_objects(seq.output_ids, seq.output_values, skill == "detect")}
    if case.get("reasoning"):  # the reasoning may begin with eos: only the answer's ends it
        reasoning, answer = prompts.split_reasoning(seq.output_ids)
        return {"reasoning_token_ids": reasoning, "token_ids": [t for t in answer if t != 0]}
    return {"token_ids": [t for t in seq.output_ids if t != 0]}  # the eos that stops is no answer token


def case_id(case):
    return "-".join(str(case[k]) for k in ("skill", "length", "image", "object") if k in case) + (
        "-reasoning" if case.get("reasoning") else "") + ("-refs" if case.get("spatial_refs") else "")

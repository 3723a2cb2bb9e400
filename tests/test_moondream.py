"""Moondream 2 against the reference's own outputs (tests/data/moondream_dev_expected.json).

The checkpoint is rebuilt by ``tests/moondream_checkpoint.py`` from the recipe and must hash to
the fixture's sha256; every case (caption ×3, query, point, detect on three images, a reasoning
query, spatial refs, a text-only query, and the eos-biased checkpoint's early stops) must give
the reference's token ids and float32 values exactly, in float32.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from frontend import moondream_prompts as prompts
from frontend.moondream_images import image_tiling, overlap_crops, select_tiling
from gpu_worker.moondream import Moondream
from shared.moondream_config import MoondreamConfig, is_moondream
import moondream_greedy as greedy
from moondream_checkpoint import make_image, sha256_file, write_checkpoint

EXPECTED = json.loads((Path(__file__).parent / "data" / "moondream_dev_expected.json").read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moondream")
    return {"plain": write_checkpoint(root / "dev"), "eos": write_checkpoint(root / "dev-eos", eos_bias=EXPECTED["eos_bias"])}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {k: Moondream.from_pretrained(p) for k, p in checkpoints.items()}


@pytest.fixture(scope="module")
def encode(checkpoints):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(checkpoints["plain"] / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def images():
    return {name: overlap_crops(make_image(h, w, salt)) for name, (h, w, salt) in EXPECTED["images"].items()}


IMAGES = images()


def test_generator_matches_the_recipe(checkpoints):
    assert sha256_file(checkpoints["plain"] / "model.safetensors") == EXPECTED["checkpoint_sha256"]
    assert sha256_file(checkpoints["eos"] / "model.safetensors") == EXPECTED["eos_checkpoint_sha256"]
    assert is_moondream(checkpoints["plain"])


def test_tiling_examples():
    # MOONDREAM.md §2: (H, W) -> tiling.
    for (h, w), want in {(378, 378): (1, 1), (644, 644): (3, 3), (910, 910): (3, 3), (800, 1200): (2, 4),
                         (1080, 1920): (2, 4)}.items():
        assert image_tiling(h, w) == want, (h, w)
    assert select_tiling(266 * 20, 266 * 20) == (3, 3)  # more than 12 minimum tiles: scaled down
    for name, (crops, tiling) in IMAGES.items():
        case = next(c for c in EXPECTED["cases"] if c.get("image") == name)
        assert list(tiling) == case["tiling"]
        assert crops.shape == (1 + tiling[0] * tiling[1], 378, 378, 3) and crops.dtype == np.uint8


def test_hub_config_is_the_moondream2_defaults():
    cfg = MoondreamConfig.from_dict({"model_type": "moondream1", "auto_map": {}, "torch_dtype": "bfloat16"})
    assert (cfg.text.dim, cfg.text.n_layers, cfg.vision.enc_dim, cfg.region.inner_dim) == (2048, 24, 1152, 8192)
    with pytest.raises(ValueError, match="unknown"):
        MoondreamConfig.from_dict({"text": {"dims": 3}, "vision": {}, "region": {}})


def run_case(model, encode, case):
    """What the plain greedy loop answers for a fixture case, in the fixture's terms."""
    crops, tiling = IMAGES[case["image"]] if "image" in case else (None, None)
    s = greedy.start(model, crops, tiling)
    skill = case["skill"]
    if skill == "caption":
        return {"token_ids": greedy.generate_text(s, prompts.caption_ids(case["length"]), case["max_tokens"])}
    if skill == "query":
        refs = case.get("spatial_refs", ())
        ids = prompts.query_ids(encode, case["question"], refs, case.get("reasoning", False), image=crops is not None)
        if case.get("reasoning"):
            reasoning = greedy.generate_reasoning(s, ids, case["max_tokens"], refs)
            return {"reasoning_token_ids": reasoning,
                    "token_ids": greedy.generate_text(s, [prompts.ANSWER_ID], case["max_tokens"])}
        return {"token_ids": greedy.generate_text(s, ids, case["max_tokens"], refs)}
    ids = (prompts.point_ids if skill == "point" else prompts.detect_ids)(encode, case["object"])
    key = "points" if skill == "point" else "objects"
    return {key: greedy.generate_objects(s, ids, case["max_objects"], size=skill == "detect")}


def case_id(case):
    return "-".join(str(case[k]) for k in ("skill", "length", "image", "object") if k in case) + (
        "-reasoning" if case.get("reasoning") else "") + ("-refs" if case.get("spatial_refs") else "")


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=case_id)
def test_greedy_loop_matches_the_reference(models, encode, case):
    got = run_case(models["plain"], encode, case)
    assert got == {k: case[k] for k in got}


@pytest.mark.parametrize("case", EXPECTED["eos_cases"], ids=case_id)
def test_greedy_loop_matches_the_reference_eos(models, encode, case):
    got = run_case(models["eos"], encode, case)
    assert got == {k: case[k] for k in got}

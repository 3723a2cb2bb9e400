"""Moondream 3 against the reference's own outputs (tests/data/moondream3_dev_expected.json).

The four checkpoints (plain; eos-biased +4 for the early stops and -4 for many objects; the first
preview layout without ``region.ln``) are rebuilt by ``shared/moondream_random.py`` and must hash
to the fixture's sha256. Every case (caption ×3, query, point, detect on three images, a reasoning
query, spatial refs, a text-only query) must give the reference's token ids exactly and its
points and boxes (bins: exact float32 values), in float32, through the engine with all of a
checkpoint's cases batched together, pipelined and blocking. The prefill probes check float32
closeness of the logits and hidden states themselves, and tell the tau GELU's erf from tanh.
"""
from __future__ import annotations

import moondream_greedy as greedy
import pytest
import torch

from bench.moondream_fixture import EXPECTED3, IMAGES, case_id, encoder, engine_answer, engine_request, md3_checkpoints
from frontend.moondream import prompts
from gpu_worker.moondream import Moondream
from shared.families import family_of, read_config
from shared.moondream_config import MOONDREAM3_RULES, MoondreamConfig
from shared.moondream_random import MD3_DEV_CONFIG, sha256_file, tensor_shapes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return md3_checkpoints(tmp_path_factory.mktemp("moondream3"))


@pytest.fixture(scope="module")
def encode(checkpoints):
    return encoder(checkpoints["plain"][0])


def test_generator_matches_the_recipe(checkpoints):
    for name, (path, _) in checkpoints.items():
        assert sha256_file(path / "model.safetensors") == EXPECTED3["checkpoints"][name]["sha256"], name
        assert family_of(read_config(path)).name == "moondream3"
    assert sha256_file(checkpoints["plain"][0] / "tokenizer.json") == EXPECTED3["tokenizer_sha256"]
    assert len(tensor_shapes(MD3_DEV_CONFIG)) == EXPECTED3["tensors"]["with region.ln"]
    assert len(tensor_shapes(MD3_DEV_CONFIG, region_ln=False)) == EXPECTED3["tensors"]["without"]


def test_hub_config_is_the_moondream3_defaults():
    """The hub's config.json says nothing but the model type: the dims are the reference's defaults,
    9,268,626,928 parameters in 662 tensors with region.ln (MOONDREAM3.md §1)."""
    hub = {"architectures": ["HfMoondream"], "config": {"skills": ["query", "caption", "detect", "point"]},
           "model_type": "moondream3", "torch_dtype": "bfloat16"}
    assert family_of(hub).name == "moondream3" and family_of(hub).skill_rules == MOONDREAM3_RULES
    cfg = MoondreamConfig.from_dict(hub)
    assert cfg.moondream3 and cfg.rope_theta == 1.5e6 and cfg.text.max_context == 4096
    assert (cfg.text.moe.num_experts, cfg.text.moe.start_layer, cfg.text.moe.experts_per_token) == (64, 4, 8)
    full = Moondream(cfg, device="meta", region_ln=True)
    assert (len(list(full.parameters())), full.num_params()) == (662, 9_268_626_928)
    assert not MoondreamConfig.from_dict({"model_type": "moondream1"}).moondream3
    with pytest.raises(ValueError, match="unknown"):
        MoondreamConfig.from_dict({"text": {"moe": {"experts": 3}}, "vision": {}, "region": {}})


def probe(model, pr) -> dict:
    """The fixture's probe figures, measured on ``model``."""
    crops, tiling = IMAGES[pr["image"]]
    with torch.no_grad():
        s = greedy.start(model, model.image_prefix(torch.from_numpy(crops), tiling))
        logits, hidden = s.feed(pr["prompt"])
        coord_bins = model.region.coord_decoder(model.region.ln(hidden[None]))
    top = logits.topk(5)
    return {"top5_ids": top.indices.tolist(), "top5_logits": top.values.tolist(),
            "logits_at": {k: logits[int(k)].item() for k in pr["logits_at"]},
            "prefill_last_hidden_pre_post_ln_first8": hidden[:8].tolist(),
            "coord_head_argmax": int(coord_bins.argmax())}


def close(got: dict, want: dict, rtol: float) -> bool:
    flat = lambda d: [v for k in sorted(d) for v in (flat(d[k]) if isinstance(d[k], dict) else  # noqa: E731
                                                     d[k] if isinstance(d[k], list) else [d[k]])]
    return all(abs(a - b) <= rtol * abs(b) for a, b in zip(flat(got), flat(want), strict=True))


@pytest.mark.parametrize("tau_gelu", ["erf", "tanh"])
def test_prefill_probes_match_the_reference(checkpoints, tau_gelu):
    """Logits and hidden states within 1e-5 relative of the reference's (float32 matmuls sum in
    another order than the reference's: ~1e-6 apart), and the tau GELU switch is what tells the
    fixture's two probe sets apart (they differ by ~1e-4)."""
    config = MoondreamConfig.from_dir(checkpoints["plain"][0])
    model = Moondream.from_pretrained(checkpoints["plain"][0])
    if tau_gelu == "tanh":
        for block in model.text.blocks:
            block.attn.tau.approximate = "tanh"
    assert config.text.tau_gelu == "erf"
    want, other = (("probes", "probes_tau_tanh") if tau_gelu == "erf" else ("probes_tau_tanh", "probes"))
    for pr, pr_other in zip(EXPECTED3[want], EXPECTED3[other]):
        got = probe(model, pr)
        assert got["top5_ids"] == pr["top5_ids"] and got["coord_head_argmax"] == pr["coord_head_argmax"]
        fields = [k for k in got if k not in ("top5_ids", "coord_head_argmax")]
        assert close({k: got[k] for k in fields}, {k: pr[k] for k in fields}, 1e-5)
        assert not close({k: got[k] for k in fields}, {k: pr_other[k] for k in fields}, 1e-5)  # non-vacuity


def run_case(model, encode, case):
    """What the plain greedy loop answers for a fixture case, in the fixture's terms."""
    s = greedy.start(model, model.image_prefix(torch.from_numpy(IMAGES[case["image"]][0]), IMAGES[case["image"]][1])
                     if "image" in case else None)
    skill = case["skill"]
    if skill == "caption":
        return {"token_ids": greedy.generate_text(s, prompts.caption_ids(case["length"]), case["max_tokens"])}
    if skill == "query":
        refs = case.get("spatial_refs", ())
        ids = prompts.query_ids(encode, case["question"], refs, case.get("reasoning", False), image="image" in case,
                                doubled_answer=False)
        if case.get("reasoning"):
            reasoning = greedy.generate_reasoning(s, ids, case["max_tokens"], refs)
            return {"reasoning_token_ids": reasoning,
                    "token_ids": greedy.generate_text(s, [prompts.ANSWER_ID], case["max_tokens"])}
        return {"token_ids": greedy.generate_text(s, ids, case["max_tokens"], refs)}
    ids = (prompts.point_ids if skill == "point" else prompts.detect_ids)(encode, case["object"])
    key = "points" if skill == "point" else "objects"
    return {key: greedy.generate_objects(s, ids, case["max_objects"], size=skill == "detect")}


@pytest.mark.parametrize("name", ["many_objects", "no_region_ln"])
def test_greedy_loop_matches_the_reference(checkpoints, encode, name):
    """The model alone, one token per forward: the multi-object runs and the region heads without ln."""
    path, cases = checkpoints[name]
    model = Moondream.from_pretrained(path)
    with torch.no_grad():
        for case in cases:
            if case["skill"] in ("point", "detect") or name == "no_region_ln" and case.get("reasoning"):
                got = run_case(model, encode, case)
                assert got == {k: case[k] for k in got}, case_id(case)


# ---- through the engine -------------------------------------------------------------------------

def make_engine(path, pipeline=True, dtype="float32", **kw):
    from gpu_worker.engine import Engine
    from shared.config import EngineConfig
    return Engine(EngineConfig(model=str(path), device="cpu", dtype=dtype, pipeline=pipeline, max_batch=8,
                               max_model_len=1024, **kw))


def text_row(engine):
    """A plain prompt beside the skill rows (Moondream's default rules: an answer)."""
    from shared.sampling import SamplingParams
    return engine.submit([0, 1, 15381, 2, 40, 41, 3], SamplingParams(temperature=0.0, max_tokens=6))


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "blocking"])
@pytest.mark.parametrize("name", ["plain", "eos", "many_objects", "no_region_ln"])
def test_engine_matches_the_reference_batched(checkpoints, encode, pipeline, name):
    """Every case of a checkpoint at once, beside a plain text row: ids exact, values exact (bins)."""
    path, cases = checkpoints[name]
    engine = make_engine(path, pipeline)
    seqs = []
    for i, case in enumerate(cases):
        if i == len(cases) // 2:
            other = text_row(engine)
        prompt, params, images, task = engine_request(case, encode, rules=MOONDREAM3_RULES)
        seqs.append(engine.submit(prompt, params, images=images, task=task))
    engine.run_until_idle()
    assert other.error is None and len(other.output_ids) > 0
    for case, seq in zip(cases, seqs):
        assert seq.error is None, seq.error
        got = engine_answer(case, seq)
        want = {k: case[k] for k in got}
        assert got == want, case_id(case)
    assert engine.idle
    engine.close()


def test_bf16_pipelined_equals_blocking(checkpoints, encode):
    """bfloat16: each spatial and text case alone, pipelined and blocking: the same launches, so the
    same bits (ids and region values)."""
    path, cases = checkpoints["many_objects"]
    picked = [c for c in cases if c.get("image") == "md3dev-c.png" or c.get("reasoning") or c.get("spatial_refs")]
    engines = {p: make_engine(path, p, "bfloat16") for p in (True, False)}
    try:
        for case in picked:
            runs = []
            for engine in engines.values():
                prompt, params, images, task = engine_request(case, encode, rules=MOONDREAM3_RULES)
                seq = engine.submit(prompt, params, images=images, task=task)
                engine.run_until_idle()
                assert seq.error is None, seq.error
                runs.append((seq.output_ids, seq.output_values))
            assert runs[0] == runs[1], case_id(case)
            assert len(runs[0][0]) > 1  # non-vacuity: something was generated
    finally:
        for engine in engines.values():
            engine.close()

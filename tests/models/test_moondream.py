"""Moondream 2 against the reference's own outputs (tests/data/moondream_dev_expected.json).

The checkpoint is rebuilt by ``shared/moondream_random.py`` from the recipe and must hash to
the fixture's sha256; every case (caption ×3, query, point, detect on three images, a reasoning
query, spatial refs, a text-only query, and the eos-biased checkpoint's early stops) must give
the reference's token ids and float32 values exactly, in float32.
"""
from __future__ import annotations

import json

import moondream_greedy as greedy
import numpy as np
import pytest
import torch

from bench.moondream_fixture import EXPECTED, IMAGES, case_id, encoder, engine_answer, engine_request, write_checkpoints
from frontend.moondream import prompts
from frontend.moondream.images import image_tiling, overlap_crops, select_tiling
from gpu_worker.moondream import Moondream
from shared.families import family_of, read_config
from shared.moondream_config import MoondreamConfig
from shared.moondream_random import make_image, sha256_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("moondream"))


@pytest.fixture(scope="module")
def models(checkpoints):
    return {k: Moondream.from_pretrained(p) for k, p in checkpoints.items()}


@pytest.fixture(scope="module")
def encode(checkpoints):
    return encoder(checkpoints["plain"])


_PREFIXES: dict[str, torch.Tensor] = {}


def image_prefix(model, name: str) -> torch.Tensor:
    """The image block of a fixture image, computed once: both checkpoints share every weight it
    depends on (they differ in lm_head.bias only)."""
    if name not in _PREFIXES:
        crops, tiling = IMAGES[name]
        with torch.no_grad():
            _PREFIXES[name] = model.image_prefix(torch.from_numpy(crops), tiling)
    return _PREFIXES[name]


def test_generator_matches_the_recipe(checkpoints):
    assert sha256_file(checkpoints["plain"] / "model.safetensors") == EXPECTED["checkpoint_sha256"]
    assert sha256_file(checkpoints["eos"] / "model.safetensors") == EXPECTED["eos_checkpoint_sha256"]
    assert family_of(read_config(checkpoints["plain"])).name == "moondream"


def test_tiling_examples():
    # MOONDREAM.md §2: (H, W) -> tiling.
    for (h, w), want in {(378, 378): (1, 1), (644, 644): (3, 3), (910, 910): (3, 3), (800, 1200): (2, 4),
                         (1080, 1920): (2, 4)}.items():
        assert image_tiling(h, w) == want, (h, w)
    assert select_tiling(266 * 20, 266 * 20) == (3, 3)  # more than 12 minimum tiles: scaled down
    for name in EXPECTED["images"]:
        crops, tiling = IMAGES[name]
        case = next(c for c in EXPECTED["cases"] if c.get("image") == name)
        assert list(tiling) == case["tiling"]
        assert crops.shape == (1 + tiling[0] * tiling[1], 3, 378, 378) and crops.dtype == np.uint8


def test_hub_config_is_the_moondream2_defaults():
    cfg = MoondreamConfig.from_dict({"model_type": "moondream1", "auto_map": {}, "torch_dtype": "bfloat16"})
    assert (cfg.text.dim, cfg.text.n_layers, cfg.vision.enc_dim, cfg.region.inner_dim) == (2048, 24, 1152, 8192)
    with pytest.raises(ValueError, match="unknown"):
        MoondreamConfig.from_dict({"text": {"dims": 3}, "vision": {}, "region": {}})


def test_random_weights_follow_the_recipe_scales():
    """``Moondream.random`` (random-moondream2, drawn on the device) gives every tensor of the
    layout its kind's scale, is deterministic for a seed, and random-moondream2 has moondream2's
    592 tensors and 1.93 B parameters (MOONDREAM.md §5)."""
    from shared.models import builtin
    from shared.moondream_random import NORMS, TINY_CONFIG, tensor_shapes

    cfg = MoondreamConfig.from_dict(TINY_CONFIG)
    model = Moondream.random(cfg, seed=3)
    params = dict(model.named_parameters())
    assert {k: tuple(p.shape) for k, p in params.items()} == tensor_shapes(TINY_CONFIG)
    for key, p in params.items():
        if p.numel() < 2000:
            continue
        parts = key.split(".")
        if parts[-1] == "weight" and parts[-2] in NORMS:
            mean, std = 1.0, 0.1
        elif key == "text.wte":
            mean, std = 0.0, 1.0
        elif parts[-1] == "bias":
            mean, std = 0.0, 0.02
        else:
            mean, std = 0.0, (2.0 if key.endswith("attn.qkv.weight") else 1.0) / p.shape[-1] ** 0.5
        assert abs(p.mean().item() - mean) < 0.1 * std and abs(p.std().item() / std - 1) < 0.1, key
    again, other = Moondream.random(cfg, seed=3), Moondream.random(cfg, seed=4)
    assert all(torch.equal(p, again.get_parameter(k)) for k, p in params.items())
    assert not torch.equal(params["text.lm_head.weight"], other.text.lm_head.weight)
    full = Moondream(MoondreamConfig.from_dict(builtin("random-moondream2").random_config), device="meta")
    assert (len(list(full.parameters())), full.num_params()) == (592, 1_927_237_104)


def run_case(model, encode, case):
    """What the plain greedy loop answers for a fixture case, in the fixture's terms."""
    s = greedy.start(model, image_prefix(model, case["image"]) if "image" in case else None)
    skill = case["skill"]
    if skill == "caption":
        return {"token_ids": greedy.generate_text(s, prompts.caption_ids(case["length"]), case["max_tokens"])}
    if skill == "query":
        refs = case.get("spatial_refs", ())
        ids = prompts.query_ids(encode, case["question"], refs, case.get("reasoning", False), image="image" in case)
        if case.get("reasoning"):
            reasoning = greedy.generate_reasoning(s, ids, case["max_tokens"], refs)
            return {"reasoning_token_ids": reasoning,
                    "token_ids": greedy.generate_text(s, [prompts.ANSWER_ID], case["max_tokens"])}
        return {"token_ids": greedy.generate_text(s, ids, case["max_tokens"], refs)}
    ids = (prompts.point_ids if skill == "point" else prompts.detect_ids)(encode, case["object"])
    key = "points" if skill == "point" else "objects"
    return {key: greedy.generate_objects(s, ids, case["max_objects"], size=skill == "detect")}


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=case_id)
def test_greedy_loop_matches_the_reference(models, encode, case):
    got = run_case(models["plain"], encode, case)
    assert got == {k: case[k] for k in got}


@pytest.mark.parametrize("case", EXPECTED["eos_cases"], ids=case_id)
def test_greedy_loop_matches_the_reference_eos(models, encode, case):
    got = run_case(models["eos"], encode, case)
    assert got == {k: case[k] for k in got}


# ---- through the engine -------------------------------------------------------------------------

def make_engine(path, pipeline=True, **kw):
    from gpu_worker.engine import Engine
    from shared.config import EngineConfig
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", pipeline=pipeline, max_batch=8,
                               max_model_len=1024, **kw))


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "blocking"])
def test_engine_matches_the_reference_batched(checkpoints, encode, pipeline):
    """Every case at once, pipelined and blocking: batched with each other (text rows, other images)."""
    for name, cases in (("plain", EXPECTED["cases"]), ("eos", EXPECTED["eos_cases"])):
        engine = make_engine(checkpoints[name], pipeline)
        seqs = []
        for case in cases:
            prompt, params, images, task = engine_request(case, encode)
            seqs.append(engine.submit(prompt, params, images=images, task=task))
        engine.run_until_idle()
        for case, seq in zip(cases, seqs):
            assert seq.error is None, seq.error
            got = engine_answer(case, seq)
            assert got == {k: case[k] for k in got}, case_id(case)
        assert engine.idle
        engine.close()


def test_engine_one_at_a_time_never_reads_values_back(checkpoints, encode):
    """Each spatial case alone, blocking and pipelined, while the host copy of the region values is
    poisoned after every read: the next launch embeds the device's own values, not the host's."""
    cases = [c for c in EXPECTED["cases"] if c["skill"] in ("point", "detect") or c.get("reasoning")
             or c.get("spatial_refs")][:4]
    for pipeline in (True, False):
        engine = make_engine(checkpoints["plain"], pipeline)
        runner = engine.runner
        read_step = runner.read_step

        def poisoned(slot, num, top=False, *, runner=runner, read_step=read_step):  # bound now: the loop rebinds
            out = read_step(slot, num, top)
            runner.slots[slot].values.fill_(float("nan"))
            return out

        runner.read_step = poisoned
        for case in cases:
            prompt, params, images, task = engine_request(case, encode)
            seq = engine.submit(prompt, params, images=images, task=task)
            engine.run_until_idle()
            assert engine_answer(case, seq) == {k: case[k] for k in engine_answer(case, seq)}, case_id(case)
        assert engine.idle
        engine.close()


def test_engine_refuses_bad_moondream_input(checkpoints, encode):
    from gpu_worker.moondream_skills import DECIDE, SkillTask
    from shared.sampling import SamplingParams
    engine = make_engine(checkpoints["plain"])
    case = next(c for c in EXPECTED["cases"] if c["skill"] == "detect")
    prompt, params, images, task = engine_request(case, encode)
    with pytest.raises(ValueError, match="temperature"):
        engine.submit(prompt, SamplingParams(temperature=0.5), images=images, task=task)
    with pytest.raises(ValueError, match="images"):
        engine.submit(prompt, params, images=images * 2, task=task)
    with pytest.raises(ValueError, match="spatial_refs"):
        engine.submit(prompt, params, images=images, task=SkillTask(DECIDE, prompt_coord=np.zeros(3, np.float32),
                                                                     prompt_size=np.zeros((3, 2), np.float32)))
    with pytest.raises(ValueError, match="prompt"):
        engine.submit(prompt[:100], params, images=images, task=task)
    seq = engine.submit(prompt, params, images=images, task=task)  # and it serves on
    engine.run_until_idle()
    assert engine_answer(case, seq)["objects"] == case["objects"]
    engine.close()


def test_service_serves_a_moondream_directory(checkpoints, encode):
    """The whole path (service, worker process, token ring) on the fixture checkpoint: the text-only
    query, a raw prompt under Moondream's default rules, answers as the reference."""
    from frontend.server.service import Service, ServiceConfig
    case = next(c for c in EXPECTED["cases"] if c["skill"] == "query" and "image" not in c)
    svc = Service(ServiceConfig(model=str(checkpoints["plain"]), device="cpu", dtype="float32", max_batch=4,
                                max_model_len=512))
    try:
        assert svc.model.family.native_skills and svc.model.vision and svc.info["vision"]
        from shared.sampling import SamplingParams
        req = svc.submit(prompts.query_ids(encode, case["question"], image=False),
                         SamplingParams(temperature=0.0, max_tokens=case["max_tokens"]))
        svc.run_until(lambda: req.ended, 120)
        assert req.error is None and req.token_ids == case["token_ids"]
        assert req.text == ""  # the stand-in tokenizer has no text for these ids: nothing, never an error
        svc.run_until(svc.idle, 60)
    finally:
        svc.close()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_moondream2_is_the_float_model_on_its_dequantized_weights(checkpoints, encode, method):
    greedy.check_quantized_against_dequantized(checkpoints["plain"], method, IMAGES["dev-b.png"],
                                               prompts.point_ids(encode, "red car"))


@pytest.mark.parametrize("quantization", ["auto", "int4"])
def test_tiny_random_moondream_is_built_in(quantization):
    """The registry's random Moondream loads and answers a detect on an image of any size, in its own
    float32 weights and quantized at load."""
    from shared.models import ModelInfo
    info = ModelInfo.load("tiny-random-moondream")
    assert info.family.name == "moondream" and info.vision and info.vocab_size == 51200
    engine = make_engine("tiny-random-moondream", quantization=quantization)
    from gpu_worker.quant import QuantLinear
    held = {name.split(".")[0] for name, m in engine.runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert held == (set() if quantization == "auto" else {"text", "vision"})
    crops, tiling = overlap_crops(make_image(500, 700, 9))
    case = {"skill": "detect", "object": "dog", "image": "x", "max_objects": 2}
    IMAGES["x"] = (crops, tiling)
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(info.path / "tokenizer.json"))
        prompt, params, images, task = engine_request(case, lambda t: tok.encode(t, add_special_tokens=False).ids)
        seq = engine.submit(prompt, params, images=images, task=task)
        engine.run_until_idle()
        objects = engine_answer(case, seq)["objects"]
        assert seq.error is None and len(objects) <= 2 and seq.output_ids[-1] == 0
        assert all(set(o) == {"x_min", "y_min", "x_max", "y_max"} for o in objects)
    finally:
        del IMAGES["x"]
        engine.close()


def png(name: str) -> bytes:
    import io

    from PIL import Image
    h, w, salt = EXPECTED["images"][name]
    buf = io.BytesIO()
    Image.fromarray(make_image(h, w, salt)).save(buf, format="PNG")
    return buf.getvalue()


def skill_of(case):
    keys = {"caption": ("length",), "query": ("question", "reasoning", "spatial_refs"),
            "point": ("object", "max_objects"), "detect": ("object", "max_objects")}[case["skill"]]
    return {"skill": case["skill"], **{k: case[k] for k in keys if k in case}}


def expected_done(case):
    """The fixture case as a skill's ``done`` fields (boxes clamped to [0, 1], as Photon returns them)."""
    if case["skill"] == "point":
        return {"output": {"points": case["points"]}}
    if case["skill"] == "detect":
        return {"output": {"objects": [{k: min(max(v, 0.0), 1.0) for k, v in o.items()} for o in case["objects"]]}}
    if case.get("reasoning"):
        return {"token_ids": case["token_ids"], "reasoning_token_ids": case["reasoning_token_ids"]}
    return {"token_ids": case["token_ids"]}


def test_service_skills_match_the_reference(checkpoints):
    """Every fixture case as a skill request through the service, the worker process and the ring
    (values included), all at once; then bad requests are refused naming the field, and it serves on."""
    from frontend.server.service import Service, ServiceConfig
    svc = Service(ServiceConfig(model=str(checkpoints["plain"]), device="cpu", dtype="float32", max_batch=32,
                                max_model_len=1024))
    done = {}
    try:
        reqs = []
        for i, case in enumerate(EXPECTED["cases"]):
            images = [png(case["image"])] if "image" in case else []
            reqs.append(svc.submit_skill(skill_of(case), images, max_tokens=case.get("max_tokens"), temperature=0.0,
                                         on_event=lambda r, kind, p, i=i: done.__setitem__(i, (kind, p))
                                         if kind != "chunk" else None))
        svc.run_until(lambda: len(done) == len(reqs), 300)
        for i, case in enumerate(EXPECTED["cases"]):
            kind, payload = done[i]
            assert kind == "done", payload
            if "reasoning_token_ids" in expected_done(case):
                payload = {**payload, "reasoning_token_ids": payload["reasoning"]["token_ids"]}
            assert {k: payload[k] for k in expected_done(case)} == expected_done(case), case_id(case)
        a = png("dev-a.png")
        for skill, images, field in (
                ({"skill": "query", "question": "Why?", "spatial_refs": [[0.1, 1.5]]}, [a], "spatial_refs"),
                ({"skill": "query", "question": "Why?", "spatial_refs": [[0.1, 0.5]]}, [], "spatial_refs"),
                ({"skill": "segment", "object": "cat"}, [a], "skill"),
                ({"skill": "caption", "length": "epic"}, [a], "length"),
                ({"skill": "query", "question": "why " * 2000}, [a], "question"),
                ({"skill": "point", "object": "cat", "max_objects": 0}, [a], "max_objects")):
            with pytest.raises(ValueError, match=field):
                svc.submit_skill(skill, images)
        got = {}
        case = next(c for c in EXPECTED["cases"] if c["skill"] == "point")
        svc.submit_skill(skill_of(case), [png(case["image"])], on_event=lambda r, k, p: got.update({k: p}))
        svc.run_until(lambda: "done" in got or "error" in got, 120)
        assert got["done"]["output"] == expected_done(case)["output"]
        svc.run_until(svc.idle, 60)
    finally:
        svc.close()


def test_zeromq_generate_takes_skills(checkpoints):
    """ZeroMQ ``generate`` with ``skill`` (a raw DEALER socket: the contract as any client sees it):
    detect and a reasoning query answer as the reference; a bad skill field is a bad_request naming
    it, and the server serves on."""
    import threading

    import msgpack
    import zmq

    from frontend.server.service import Service, ServiceConfig
    from frontend.server.zmq_server import Server
    svc = Service(ServiceConfig(model=str(checkpoints["plain"]), device="cpu", dtype="float32", max_batch=8,
                                max_model_len=1024))
    server = Server(svc, "tcp://127.0.0.1:*")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.endpoint)
    try:
        def ask(id_, **fields):
            sock.send_multipart([b"TANDEM1", msgpack.packb({"type": "generate", "id": id_, "stream": False,
                                                            **fields}, use_bin_type=True)])
            while True:
                assert sock.poll(180_000), "no answer"
                msg = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                if msg["type"] in ("done", "error"):
                    return msg

        detect = next(c for c in EXPECTED["cases"] if c["skill"] == "detect")
        done = ask("d", images=[png(detect["image"])], **skill_of(detect))
        assert done["type"] == "done" and done["output"] == expected_done(detect)["output"]
        why = next(c for c in EXPECTED["cases"] if c.get("reasoning"))
        done = ask("r", images=[png(why["image"])], max_tokens=why["max_tokens"], temperature=0.0, **skill_of(why))
        assert done["token_ids"] == why["token_ids"] and done["reasoning"]["token_ids"] == why["reasoning_token_ids"]
        assert done["reasoning"]["grounding"] == why["grounding"]
        err = ask("e", images=[png("dev-a.png")], skill="query", question="Why?", spatial_refs=[[2.0, 0.5]])
        assert err["type"] == "error" and err["code"] == "bad_request" and "spatial_refs" in err["message"]
        err = ask("f", prompt="hi", length="short")
        assert err["code"] == "bad_request" and "length" in err["message"]
        err = ask("g", prompt="<image> hi", images=[png("dev-a.png")])
        assert err["code"] == "bad_request" and "skill" in err["message"]
        err = ask("h", skill="detect", object="cat")
        assert err["code"] == "bad_request" and "images" in err["message"]
        text = next(c for c in EXPECTED["cases"] if c["skill"] == "query" and "image" not in c)
        done = ask("t", max_tokens=text["max_tokens"], temperature=0.0, **skill_of(text))
        assert done["token_ids"] == text["token_ids"]
        # The Python client's skill methods take the same path.
        from frontend.client import Client
        point = next(c for c in EXPECTED["cases"] if c["skill"] == "point")
        with Client(server.endpoint, timeout=180) as client:
            assert client.point(png(point["image"]), "cat", max_objects=3) == {"points": point["points"]}
            assert client.detect(png(detect["image"]), "cat", max_objects=3) == expected_done(detect)["output"]
            got = client.query(png(why["image"]), "Why?", reasoning=True, max_tokens=8, temperature=0.0)
            assert got["reasoning"]["token_ids"] == why["reasoning_token_ids"]
    finally:
        sock.close(0)
        server.stop()
        thread.join(60)
        svc.close()


def test_http_moondream_client_gets_the_reference_answers(checkpoints):
    """The unmodified ``moondream`` client over HTTP: point and detect are the reference's (boxes
    clamped), a caption streams and completes, a spatial ref outside [0, 1] is a 400 naming it."""
    import base64
    import threading

    import httpx
    import moondream
    from PIL import Image

    from frontend.http import HttpListener
    from frontend.server.service import Service, ServiceConfig
    from frontend.server.zmq_server import Server
    svc = Service(ServiceConfig(model=str(checkpoints["plain"]), device="cpu", dtype="float32", max_batch=8,
                                max_model_len=1024))
    server = Server(svc, "tcp://127.0.0.1:*")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    http = HttpListener(server, "127.0.0.1", 0).start()
    try:
        point = next(c for c in EXPECTED["cases"] if c["skill"] == "point")
        detect = next(c for c in EXPECTED["cases"] if c["skill"] == "detect" and c["image"] == point["image"])
        url = "data:image/png;base64," + base64.b64encode(png(point["image"])).decode()
        # The exact pixels (PNG): the reference's values.
        r = httpx.post(http.url + "/v1/detect", json={"image_url": url, "object": "cat", "settings": {"max_objects": 3}},
                       timeout=300)
        assert r.json()["objects"] == expected_done(detect)["output"]["objects"]
        # The moondream client (it sends JPEG, so the pixels and the answers differ a little).
        md = moondream.vl(endpoint=http.url + "/v1")
        h, w, salt = EXPECTED["images"][point["image"]]
        img = Image.fromarray(make_image(h, w, salt))
        points = md.point(img, "cat", settings={"max_objects": 3})["points"]
        assert 1 <= len(points) <= 3 and all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
        objects = md.detect(img, "cat", settings={"max_objects": 2})["objects"]
        assert 1 <= len(objects) <= 2 and all(0 <= o["x_min"] <= o["x_max"] <= 1 for o in objects)
        caption = md.caption(img, length="short", stream=True, settings={"max_tokens": 4, "temperature": 0})
        assert "".join(caption["caption"]) == ""  # the stand-in tokenizer has no text for these ids
        r = httpx.post(http.url + "/v1/query", json={"question": "Why?", "spatial_refs": [[0.5, 1.5]], "image_url": url})
        assert r.status_code == 400 and "spatial_refs" in r.text
    finally:
        http.stop()
        server.stop()
        thread.join(60)
        svc.close()


def test_cli_generate_skill(checkpoints, tmp_path):
    """``tandem generate OBJECT --skill detect --image FILE --json`` on a Moondream directory."""
    from click.testing import CliRunner

    from frontend.cli.main import main as cli
    detect = next(c for c in EXPECTED["cases"] if c["skill"] == "detect")
    image = tmp_path / "image.png"
    image.write_bytes(png(detect["image"]))
    result = CliRunner().invoke(cli, ["generate", "cat", "--skill", "detect", "--max-objects", "3", "--image",
                                      str(image), "--model", str(checkpoints["plain"]), "--device", "cpu",
                                      "--dtype", "float32", "--max-batch", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["output"] == expected_done(detect)["output"]

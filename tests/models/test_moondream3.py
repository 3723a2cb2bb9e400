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

import functools

import moondream_greedy as greedy
import pytest
import torch
from moondream_cases import done_fields, expected_done, fixture_png, skill_of

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
    """Each field within ``rtol`` of its largest magnitude: a float32 sum's rounding scales with the
    sum's terms, not with its result, so an element near zero carries its field's absolute error."""
    flat = lambda v: ([x for k in sorted(v) for x in flat(v[k])] if isinstance(v, dict) else  # noqa: E731
                      list(v) if isinstance(v, list) else [v])
    for k in want:
        g, w = flat(got[k]), flat(want[k])
        scale = max(abs(x) for x in w)
        if any(abs(a - b) > rtol * scale for a, b in zip(g, w, strict=True)):
            return False
    return True


@pytest.mark.parametrize("tau_gelu", ["erf", "tanh"])
def test_prefill_probes_match_the_reference(checkpoints, tau_gelu, tmp_path):
    """Logits and hidden states within 1e-5 of the reference's, relative to each field's largest
    magnitude (float32 matmuls sum in another order than the reference's, and in another on each
    CPU's BLAS: 1e-7 to 3e-6 apart on an AVX-512 EPYC), and the tau GELU switch (config.json's
    ``text.tau_gelu``, erf by default) is what tells the fixture's two probe sets apart (they
    differ by 4e-5 to 3e-4)."""
    import json
    plain = checkpoints["plain"][0]
    assert MoondreamConfig.from_dir(plain).text.tau_gelu == "erf"
    if tau_gelu == "tanh":  # the same weights under a config that asks for Kestrel's tanh
        config = json.loads((plain / "config.json").read_text())
        config["text"]["tau_gelu"] = "tanh"
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "model.safetensors").symlink_to(plain / "model.safetensors")
        plain = tmp_path
    model = Moondream.from_pretrained(plain)
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


# ---- every door -----------------------------------------------------------------------------------

png = functools.partial(fixture_png, EXPECTED3["images"])


@pytest.mark.parametrize("name", ["plain", "eos"])
def test_serve_answers_every_case_over_zeromq_http_and_the_clients(checkpoints, name):
    """``tandem serve`` on a dev checkpoint: every fixture case as a ZeroMQ ``generate`` with
    ``skill`` (a raw DEALER socket), all in flight at once, answers as the reference; ``info`` says
    moondream3; max_objects above 500 is a bad_request naming it and the server serves on; the
    Python client and the unmodified ``moondream`` client over HTTP take the same path."""
    import threading

    import httpx
    import moondream
    import msgpack
    import zmq
    from PIL import Image

    from frontend.client import Client
    from frontend.http import HttpListener
    from frontend.server.service import Service, ServiceConfig
    from frontend.server.zmq_server import Server
    from shared.moondream_random import make_image
    path, cases = checkpoints[name]
    svc = Service(ServiceConfig(model=str(path), device="cpu", dtype="float32", max_batch=32, max_model_len=1024))
    server = Server(svc, "tcp://127.0.0.1:*")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    http = HttpListener(server, "127.0.0.1", 0).start() if name == "plain" else None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.endpoint)
    try:
        def send(id_, **fields):
            sock.send_multipart([b"TANDEM1", msgpack.packb({"type": "generate", "id": id_, "stream": False,
                                                            **fields}, use_bin_type=True)])

        def answers(n) -> dict:
            out = {}
            while len(out) < n:
                assert sock.poll(300_000), "no answer"
                msg = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                if msg["type"] in ("done", "error"):
                    out[msg["id"]] = msg
            return out

        for i, case in enumerate(cases):
            sampling = {"max_tokens": case["max_tokens"], "temperature": 0.0} if "max_tokens" in case else {}
            send(str(i), **({"images": [png(case["image"])]} if "image" in case else {}), **sampling,
                 **skill_of(case))
        got = answers(len(cases))
        for i, case in enumerate(cases):
            assert got[str(i)]["type"] == "done", got[str(i)]
            assert done_fields(got[str(i)], case) == expected_done(case), case_id(case)
        send("big", images=[png("md3dev-a.png")], skill="point", object="car", max_objects=501)
        err = answers(1)["big"]
        assert err["type"] == "error" and err["code"] == "bad_request" and "max_objects" in err["message"]
        point = next(c for c in cases if c["skill"] == "point")
        detect = next(c for c in cases if c["skill"] == "detect" and c["image"] == point["image"])
        with Client(server.endpoint, timeout=300) as client:
            assert client.info()["family"] == "moondream3"
            assert client.point(png(point["image"]), point["object"], max_objects=8) == expected_done(point)["output"]
        if http is None:
            return
        url = "data:image/png;base64," + __import__("base64").b64encode(png(detect["image"])).decode()
        r = httpx.post(http.url + "/v1/detect", json={"image_url": url, "object": detect["object"],
                                                      "settings": {"max_objects": 8}}, timeout=300)
        assert r.json()["objects"] == expected_done(detect)["output"]["objects"]
        # The moondream client (it sends JPEG, so the pixels and the answers differ a little).
        md = moondream.vl(endpoint=http.url + "/v1")
        img = Image.fromarray(make_image(*EXPECTED3["images"][point["image"]]))
        points = md.point(img, "red car", settings={"max_objects": 3})["points"]
        assert 1 <= len(points) <= 3 and all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
        objects = md.detect(img, "red car", settings={"max_objects": 2})["objects"]
        assert 1 <= len(objects) <= 2 and all(0 <= o["x_min"] <= o["x_max"] <= 1 for o in objects)
        assert isinstance(md.query(img, "What is this?", settings={"max_tokens": 4})["answer"], str)
        caption = md.caption(img, length="short", stream=True, settings={"max_tokens": 4, "temperature": 0})
        assert "".join(caption["caption"]) == ""  # the stand-in tokenizer has no text for these ids
        # OpenAI chat with an image: the query skill. The stand-in tokenizer decodes the reference's ids to
        # nothing, so the usage tells: its 24 tokens, ended by the limit (the reference never stops early).
        query = next(c for c in cases if c["skill"] == "query" and c.get("image") == detect["image"]
                     and not c.get("reasoning") and not c.get("spatial_refs"))
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": query["question"]}]
        body = {"model": svc.info["model"], "max_tokens": query["max_tokens"], "temperature": 0,
                "messages": [{"role": "user", "content": content}]}
        r = httpx.post(http.url + "/v1/chat/completions", json=body, timeout=300).json()
        assert r["usage"]["completion_tokens"] == len(query["token_ids"]) == 24
        assert r["choices"][0]["finish_reason"] == "length"
        two = {**body, "messages": [{"role": "system", "content": "Be brief."}, *body["messages"]]}
        r = httpx.post(http.url + "/v1/chat/completions", json=two, timeout=300)
        assert r.status_code == 400 and "messages" in r.text
    finally:
        sock.close(0)
        if http is not None:
            http.stop()
        server.stop()
        thread.join(60)
        svc.close()


def test_cli_generate_skill(checkpoints, tmp_path):
    """``tandem generate OBJECT --skill detect --image FILE --json`` on a Moondream 3 directory."""
    import json

    from click.testing import CliRunner

    from frontend.cli.main import main as cli
    path, cases = checkpoints["plain"]
    detect = next(c for c in cases if c["skill"] == "detect")
    image = tmp_path / "image.png"
    image.write_bytes(png(detect["image"]))
    result = CliRunner().invoke(cli, ["generate", detect["object"], "--skill", "detect", "--max-objects", "8",
                                      "--image", str(image), "--model", str(path), "--device", "cpu",
                                      "--dtype", "float32", "--max-batch", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["output"] == expected_done(detect)["output"]


# ---- quantized ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_is_the_float_model_on_its_dequantized_weights(checkpoints, method):
    assert any(b.moe for b in Moondream.from_pretrained(checkpoints["plain"][0]).text.blocks)  # experts quantized too
    greedy.check_quantized_against_dequantized(checkpoints["plain"][0], method, IMAGES["md3dev-c.png"],
                                               prompts.point_ids(encoder(checkpoints["plain"][0]), "red car"))


def test_random_moondream3_quantizes_its_experts_as_it_draws_them():
    """random-moondream3's recipe on a small config: the experts are drawn stack by stack and held
    quantized (no float stack left), at the recipe's scale; the built-in tiny-random-moondream3
    answers a detect through the engine at --quantization int4."""
    from shared.models.info import ModelInfo
    from shared.moondream_random import MD3_TINY_CONFIG
    kernels = greedy.quant_kernels()
    model = Moondream.random(MoondreamConfig.from_dict(MD3_TINY_CONFIG), quantize=("int4", 32, kernels))
    moe = [b for b in model.text.blocks if b.moe]
    assert moe and all(not list(fc.parameters()) for b in moe for fc in (b.mlp.fc1, b.mlp.fc2))
    w = moe[0].mlp.fc1.quantized[0].dequantize()
    assert abs(w.std().item() * MD3_TINY_CONFIG["text"]["dim"] ** 0.5 - 1) < 0.1  # n / sqrt(in)
    info = ModelInfo.load("tiny-random-moondream3")
    assert info.family.name == "moondream3" and info.vision
    engine = make_engine("tiny-random-moondream3", quantization="int4")
    try:
        case = {"skill": "detect", "object": "dog", "image": "md3dev-b.png", "max_objects": 2}
        prompt, params, images, task = engine_request(case, encoder(info.path), rules=MOONDREAM3_RULES)
        seq = engine.submit(prompt, params, images=images, task=task)
        engine.run_until_idle()
        objects = engine_answer(case, seq)["objects"]
        assert seq.error is None and len(objects) <= 2 and seq.output_ids[-1] == 0
    finally:
        engine.close()


def test_bench_moondream3_cpu_runs_end_to_end(capsys):
    """``python -m bench.moondream3_cpu`` (here on tiny-random-moondream3 at int4): caption, point
    and detect answer, and the parameter count includes the quantized linears (the float model's)."""
    import json

    from bench import moondream3_cpu
    from shared.models.registry import resolve_model
    greedy.quant_kernels()
    out = moondream3_cpu.main(["--model", "tiny-random-moondream3", "--tokens", "3", "--objects", "1", "--json"])
    assert json.loads(capsys.readouterr().out)["params"] == out["params"]
    assert out["caption"]["tokens"] == 3 and out["caption"]["ttft_s"] > 0
    assert all(len(out[skill]["objects"]) <= 1 for skill in ("point", "detect"))
    assert out["params"] == Moondream.from_pretrained(resolve_model("tiny-random-moondream3")).num_params()

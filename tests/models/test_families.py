"""Model families (shared/families): the registry's refusals, Qwen3 against transformers through the
engine, and generation_config.json (extra EOS ids, the model's sampling defaults)."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
from prerequisites import require

torch = require("torch")
transformers = require("transformers")

from frontend.protocol.wire import SkillError  # noqa: E402
from frontend.protocol.encode import encode_message  # noqa: E402
from frontend.server.service import Service, ServiceConfig  # noqa: E402
from frontend.server.zmq_server import Gate  # noqa: E402
from gpu_worker import families as worker_families  # noqa: E402
from gpu_worker.batch import Batch  # noqa: E402
from gpu_worker.engine import Engine, EngineConfig  # noqa: E402
from gpu_worker.kv_cache import PagedKVCache  # noqa: E402
from gpu_worker.model import Llama  # noqa: E402
from shared.families import FAMILIES, UnsupportedModel, family_of  # noqa: E402
from shared.finish import FinishReason  # noqa: E402
from shared.models.info import ModelInfo  # noqa: E402
from shared.models.registry import resolve_model  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

QWEN3 = "tiny-random-qwen3"
NEW_TOKENS = 12


def model_copy(tmp_path, name: str = "tiny-random-smollm2", **config_changes):
    """A copy of a built-in's directory (weights linked) with config.json changed."""
    src = resolve_model(name, quiet=True)
    out = tmp_path / "model"
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.endswith(".safetensors"):
            (out / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(json.dumps(config))
    return out


# ------------------------------------------------------------------ the registry and its refusals


def test_unknown_architecture_is_refused_at_start_up_naming_it(tmp_path):
    path = model_copy(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    for load in (ModelInfo.load, lambda p: worker_families.load(p, torch.float32, torch.device("cpu"), 64)):
        with pytest.raises(UnsupportedModel) as e:
            load(path)
        assert "GPT2LMHeadModel" in str(e.value)
        for family in FAMILIES.values():  # the supported ones are listed
            assert all(a in str(e.value) for a in family.architectures)
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):  # before any worker starts
        Service(ServiceConfig(model=str(path), device="cpu"))


def test_architectures_decide_and_model_type_is_the_fallback():
    assert family_of({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}).name == "qwen3"
    assert family_of({"model_type": "qwen3"}).name == "qwen3"
    assert family_of({"architectures": ["MistralForCausalLM"]}).name == "llama"
    assert family_of({"text": {}, "vision": {}, "region": {}}).name == "moondream"  # the override format
    # A known model_type never rescues an architecture no family serves (a classifier head, an MoE).
    with pytest.raises(UnsupportedModel, match="LlamaForSequenceClassification"):
        family_of({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"})
    with pytest.raises(UnsupportedModel, match="'qwen3_moe'"):
        family_of({"model_type": "qwen3_moe"})


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_a_quantization_config_is_refused_naming_its_method(tmp_path, method):
    path = model_copy(tmp_path, quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(UnsupportedModel, match=f"quant_method '{method}'"):
        ModelInfo.load(path)
    with pytest.raises(UnsupportedModel, match=f"quant_method '{method}'"):
        Engine(EngineConfig(model=str(path), device="cpu", max_batch=2, kv_pages=16))
    # Non-vacuity: the same directory without it loads.
    assert ModelInfo.load(model_copy(tmp_path / "plain")).family.name == "llama"


def test_vision_config_eos_ids_are_read_once_from_both_levels(tmp_path):
    """A vision-language config may carry EOS ids at its top level or in text_config: all are EOS."""
    path = model_copy(tmp_path, "tiny-random-smolvlm", eos_token_id=7)
    (path / "generation_config.json").unlink()
    info = ModelInfo.load(path)
    text_eos = json.loads((path / "config.json").read_text())["text_config"]["eos_token_id"]
    assert info.eos_token_ids == (*text_eos, 7)


# ------------------------------------------------------------------ Qwen3


@pytest.fixture(scope="module")
def qwen3_path():
    return resolve_model(QWEN3, quiet=True)


@pytest.fixture(scope="module")
def qwen3_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 4, 17)]


@pytest.fixture(scope="module")
def transformers_qwen3(qwen3_path, qwen3_prompts):
    """(the model, each prompt's greedy continuation) from transformers' Qwen3ForCausalLM."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(qwen3_path), dtype=torch.float32).eval()
    eos = json.loads((qwen3_path / "config.json").read_text())["eos_token_id"]
    answers = []
    with torch.inference_mode():
        for p in qwen3_prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(p):].tolist()
            answers.append(out[:out.index(eos) + 1] if eos in out else out)
    return hf, answers


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "blocking"])
def test_qwen3_greedy_tokens_equal_transformers(qwen3_prompts, transformers_qwen3, pipeline):
    _, theirs = transformers_qwen3
    engine = Engine(EngineConfig(model=QWEN3, device="cpu", dtype="float32", pipeline=pipeline, max_batch=4,
                                 kv_pages=64, page_size=8, prefill_budget=16))
    try:
        assert engine.runner.model.config.qk_norm and engine.runner.model.config.head_dim == 32
        seqs = [engine.submit(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in qwen3_prompts]
        engine.run_until_idle()
    finally:
        engine.close()
    ours = [s.output_ids for s in seqs]
    assert ours == theirs
    assert len({tuple(t) for t in ours}) == len(ours)  # non-vacuity: each prompt its own answer


def test_qwen3_without_its_qk_norm_is_caught(qwen3_path, qwen3_prompts, transformers_qwen3):
    """Non-vacuity of the test above: the next-token predictions of transformers' sequences (one
    forward, teacher-forced) match with the q/k norm and not without it (the checkpoint read as a Llama)."""
    _, theirs = transformers_qwen3
    model = Llama.from_pretrained(qwen3_path, dtype=torch.float32, max_model_len=64)

    def predictions() -> list[list[int]]:
        out = []
        for prompt, answer in zip(qwen3_prompts, theirs):
            ids = prompt + answer
            kv = PagedKVCache.from_config(model.config, 8, 8, torch.float32, "cpu")
            batch = Batch.build([(0, len(ids), list(range(1, 1 + -(-len(ids) // 8))))], 8)
            logits = model(torch.tensor(ids), batch, kv, torch.arange(len(prompt) - 1, len(ids) - 1))
            out.append(logits.argmax(-1).tolist())
        return out

    assert predictions() == theirs
    for layer in model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert predictions() != theirs


def test_qwen3_never_takes_the_fused_cpu_layers(qwen3_path, caplog):
    """The fused kernels have no q/k norm: attaching them to a Qwen3 leaves its layers eager, and says why."""
    model = Llama.from_pretrained(qwen3_path, dtype=torch.float32, max_model_len=64)
    stand_in = object()  # any kernels object: the refusal is the config's, not the build's
    with caplog.at_level(logging.INFO, logger="gpu_worker.model"):
        model.cpu_kernels = stand_in
    assert model.cpu_kernels is None
    assert "q/k norm" in caplog.text
    llama = Llama.from_pretrained(resolve_model("tiny-random-smollm2", quiet=True), max_model_len=64)
    llama.cpu_kernels = stand_in  # non-vacuity: a Llama takes them
    assert llama.cpu_kernels is stand_in


def test_qwen3_in_bf16_runs_eager_layers_and_pipelined_equals_blocking(qwen3_prompts, caplog):
    """bf16 on a CPU attaches the fused kernels to a Llama; a Qwen3's layers stay eager (logged), and
    both schedules give the same tokens."""
    outs = {}
    for pipeline in (True, False):
        with caplog.at_level(logging.INFO, logger="gpu_worker.model"):
            engine = Engine(EngineConfig(model=QWEN3, device="cpu", dtype="bfloat16", pipeline=pipeline, max_batch=4,
                                         kv_pages=64, page_size=8, prefill_budget=16))
        try:
            assert engine.runner.model.cpu_kernels is None
            seqs = [engine.submit(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in qwen3_prompts]
            engine.run_until_idle()
        finally:
            engine.close()
        outs[pipeline] = [s.output_ids for s in seqs]
    from gpu_worker import cpu_kernels
    if cpu_kernels.load() is not None:  # the kernels build here (a compiler): their refusal was logged
        assert "q/k norm" in caplog.text
    assert outs[True] == outs[False] and all(len(t) == NEW_TOKENS for t in outs[True])


# ------------------------------------------------------------------ generation_config.json


def test_an_extra_eos_id_in_generation_config_stops_generation(tmp_path):
    path = model_copy(tmp_path)
    prompt = list(range(100, 112))

    def run(source: str = "auto"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_batch=2, kv_pages=32,
                                     page_size=8, generation_config=source))
        try:
            seq = engine.submit(prompt, SamplingParams(max_tokens=NEW_TOKENS))
            engine.run_until_idle()
        finally:
            engine.close()
        return seq.output_ids, seq.finish_reason

    free, reason = run()
    assert reason == FinishReason.LENGTH and len(free) == NEW_TOKENS
    stop_at = next(i for i in range(3, NEW_TOKENS) if free[i] not in free[:i])  # its first occurrence
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, free[stop_at]]}))
    assert ModelInfo.load(path).eos_token_ids == (2, free[stop_at])
    assert run() == (free[:stop_at + 1], FinishReason.STOP)
    assert run("vllm") == (free[:stop_at + 1], FinishReason.STOP)  # vllm: defaults ignored, EOS ids kept
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert run(str(folder)) == (free, FinishReason.LENGTH)  # a folder's file replaces the model's


@pytest.mark.slow  # a service: a worker process
def test_generation_config_sampling_defaults_apply_where_the_request_is_silent(tmp_path):
    path = model_copy(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 1.3, "top_k": 40, "repetition_penalty": 1.2,
                                                                "do_sample": True}))
    service = Service(ServiceConfig(model=str(path), device="cpu", max_batch=4, kv_pages=64, page_size=8))
    try:
        assert service.model.sampling_defaults == {"temperature": 1.3, "top_k": 40, "repetition_penalty": 1.2}
        gate = Gate(service)

        def generate(**fields) -> tuple[SamplingParams, list[int]]:
            msg = gate.parse(encode_message({"type": "generate", "id": "r", "prompt": "Hello there",
                                               "max_tokens": 10, "seed": 7, **fields}))
            req = gate.submit(msg)
            service.run_until(lambda: req.ended, timeout=120)
            assert req.error is None, req.error
            return req.params, req.token_ids

        silent, silent_ids = generate()
        assert (silent.temperature, silent.top_k, silent.repetition_penalty) == (1.3, 40, 1.2)  # the model's
        same, same_ids = generate(temperature=1.3, top_k=40, repetition_penalty=1.2)
        assert same_ids == silent_ids  # the defaults were really sampled with
        greedy, greedy_ids = generate(temperature=0.0)
        assert (greedy.temperature, greedy.top_k) == (0.0, 40)  # the request's own value wins, per field
        assert greedy_ids != silent_ids  # non-vacuity: the default temperature changed the tokens
    finally:
        service.close()
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        (path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
        ModelInfo.load(path)
    assert ModelInfo.load(path, "vllm").sampling_defaults == {}


def test_every_family_has_its_worker_loader_and_each_vision_family_its_intake():
    from frontend.images.intake import INTAKES
    assert set(worker_families.WORKER_FAMILIES) == set(FAMILIES)
    assert set(INTAKES) == {name for name, f in FAMILIES.items() if f.vision}


def test_an_openai_request_without_temperature_leaves_it_to_the_model_default():
    """OpenAI's default (1.0) is sent only where the model has none; the server then applies the model's."""
    from frontend.http.common import Context
    from frontend.http.fields import CHAT
    from frontend.http.openai import OPENAI_TEMPERATURE, _sampling
    from frontend.http.openapi import decode_body
    body = {"messages": [{"role": "user", "content": "hi"}]}
    chat = decode_body(CHAT, body)  # the route's Struct, as the route reads it
    assert _sampling(Context(bridge=None, model="m"), chat, chat=True)["temperature"] == OPENAI_TEMPERATURE
    assert "temperature" not in _sampling(Context(bridge=None, model="m", sampling_defaults={"temperature": 0.6}),
                                          chat, chat=True)
    assert _sampling(Context(bridge=None, model="m", sampling_defaults={"temperature": 0.6}),
                     decode_body(CHAT, {**body, "temperature": 0.2}), chat=True)["temperature"] == 0.2


def test_an_architecture_belongs_to_one_family_at_most():
    """Unless the families sharing it tell their configs apart by model_type (HfMoondream: 2 and 3)."""
    pairs = [(a, t) for f in FAMILIES.values() for a in f.architectures for t in f.model_types]
    assert len(pairs) == len(set(pairs))
    for f in FAMILIES.values():
        for a in f.architectures:
            for t in f.model_types:
                assert family_of({"architectures": [a], "model_type": t}) is f, (a, t)
    assert family_of({"architectures": ["HfMoondream"], "model_type": "moondream3"}).name == "moondream3"
    assert family_of({"architectures": ["HfMoondream"], "model_type": "moondream1"}).name == "moondream"
    with pytest.raises(UnsupportedModel):
        family_of({"architectures": ["HfMoondream"], "model_type": "moondream9"})


def test_moondream_versions_render_and_read_skills_by_their_rules():
    """One skill planner, two families' rules (MOONDREAM3.md §3-4): Moondream 3's plain query is not
    doubled, its max_objects defaults to 150 and stops at 500; a reasoning that begins with eos keeps
    it (only the answer's eos ends the output)."""
    from frontend.moondream import skills
    from shared.families import FAMILIES
    from shared.moondream_config import ANSWER_ID, EOS_ID, THINKING_ID
    md2, md3 = FAMILIES["moondream"].skill_rules, FAMILIES["moondream3"].skill_rules
    encode = lambda text: [16 + b for b in text.encode()]  # noqa: E731
    query = {"skill": "query", "question": "Why?"}
    assert skills.plan(query, encode, True, 8, rules=md2).prompt_ids[-2:] == [ANSWER_ID, ANSWER_ID]
    assert skills.plan(query, encode, True, 8, rules=md3).prompt_ids[-2:] == [encode("?")[0], ANSWER_ID]
    assert skills.plan({**query, "reasoning": True}, encode, True, 8, rules=md3).prompt_ids[-1] == THINKING_ID
    point = {"skill": "point", "object": "cat"}
    assert (skills.plan(point, encode, True, None, rules=md2).limit, skills.plan(point, encode, True, None, rules=md3)
            .limit) == (50, 150)
    assert skills.plan({**point, "max_objects": 1000}, encode, True, None, rules=md2).limit == 1000
    with pytest.raises(SkillError, match=r"max_objects must be an integer in \[1, 500\]"):
        skills.plan({**point, "max_objects": 501}, encode, True, None, rules=md3)
    plan = skills.plan({**query, "reasoning": True}, encode, True, 8, rules=md3)
    done = skills.answer(plan, [EOS_ID, 40, ANSWER_ID, 41, EOS_ID], [[0.0] * 3] * 5, lambda ids: "")
    assert done["reasoning"]["token_ids"] == [EOS_ID, 40] and done["token_ids"] == [41]

"""LoRA adapters: equivalence with transformers + peft, mixed batches, slot refcounts, bad input.

Adapters are random PEFT adapters (``init_lora_weights=False``: B is not zero)
made with ``peft`` on the ``tiny-random`` model and saved as PEFT saves them;
the reference is ``PeftModel.from_pretrained`` on transformers' Llama, float32.
"""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from prerequisites import require

transformers = require("transformers")
peft = require("peft")

from gpu_worker.batch import Batch  # noqa: E402
from gpu_worker.engine import Engine, EngineConfig  # noqa: E402
from gpu_worker.kv_cache import PagedKVCache  # noqa: E402
from gpu_worker.lora import KERNELS, LoraPool  # noqa: E402
from gpu_worker.lora_slots import LoraSlots  # noqa: E402
from gpu_worker.model import Llama  # noqa: E402
from shared.finish import FinishReason  # noqa: E402
from shared.lora_config import AdapterError, parse_lora_option, read_adapter  # noqa: E402
from shared.models.registry import resolve_model  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

torch.set_num_threads(min(2, torch.get_num_threads()))

ATOL = 1e-4
# name -> (target modules, rank, alpha, rslora): every linear layer is covered by some set.
ADAPTERS = {
    "qv": (["q_proj", "v_proj"], 8, 16, False),
    "ko": (["k_proj", "o_proj"], 4, 4, False),
    "mlp": (["gate_proj", "up_proj", "down_proj"], 16, 8, False),
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 64, 32, True),
}
PROMPTS = [[1, 42, 7, 300, 5, 9, 1000, 77, 12], [1, 5000, 6000, 31], [9] * 20, [100, 200, 300, 400, 500, 600]]


def hf_base(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny-random")


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory):
    """{name: directory} of random PEFT adapters saved by peft."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, (targets, r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                              init_lora_weights=False, lora_dropout=0.0)
        model = peft.get_peft_model(hf_base(model_path), cfg)
        with torch.no_grad():  # B large enough that every adapter changes the greedy tokens
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.5)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def reference(model_path, adapters):
    """Per adapter (and None = base): transformers + PeftModel logits of every prompt position, greedy tokens."""
    ref = {}
    for name in [None, *adapters]:
        model = hf_base(model_path)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name]).eval()
        with torch.no_grad():
            logits = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
            greedy = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        ref[name] = (logits, greedy)
    return ref


def make_engine(model_path, adapters, pipeline=True, max_loras=2, **kw):
    kw.setdefault("max_batch", 16)
    kw.setdefault("kv_pages", 400)
    kw.setdefault("page_size", 8)
    kw.setdefault("prefill_budget", 64)
    return Engine(EngineConfig(model=str(model_path), device="cpu", dtype="float32", pipeline=pipeline, debug=True,
                               loras=adapters, max_loras=max_loras, **kw))


def check_idle(eng):
    assert eng.idle
    s = eng.stats()
    assert s["lora_refs"] == 0 and eng.lora_slots.idle
    assert s["kv_pages_free"] == s["kv_pages_total"]


# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("kernel", KERNELS)
def test_logits_match_peft_in_one_packed_forward(model_path, adapters, reference, kernel):
    """Every prompt under every adapter (and none) in ONE forward: each row applies its own slot."""
    model = Llama.from_pretrained(model_path, dtype=torch.float32)
    pool = LoraPool(model, adapters, num_slots=len(adapters) + 1, kernel=kernel)  # one slot stays empty
    for slot, name in enumerate(adapters, start=1):
        pool.write(slot, name)
    names = [None, *adapters]
    page_size, pages_per_seq = 8, 4
    kv = PagedKVCache.from_config(model.config, 1 + len(names) * len(PROMPTS) * pages_per_seq, page_size,
                                  torch.float32, "cpu")
    chunks, ids, slots, where = [], [], [], []
    for k, name in enumerate(names):
        for j, p in enumerate(PROMPTS):
            n = len(chunks)
            chunks.append((0, len(p), list(range(1 + n * pages_per_seq, 1 + (n + 1) * pages_per_seq))))
            where.append((name, j, len(ids)))
            ids += p
            slots += [k] * len(p)
    pool.token_slots = torch.tensor(slots)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), Batch.build(chunks, page_size), kv, torch.arange(len(ids)))
    worst = 0.0
    for name, j, start in where:
        ours = logits[start:start + len(PROMPTS[j])]
        theirs = reference[name][0][j]
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < ATOL, worst
    # Non-vacuity: every adapter moves the logits far beyond the tolerance.
    for name in adapters:
        assert float((reference[name][0][0] - reference[None][0][0]).abs().max()) > 100 * ATOL, name


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_tokens_match_peft(model_path, adapters, reference, name):
    eng = make_engine(model_path, {name: adapters[name]}, max_loras=1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seqs = [eng.submit(p, params, adapter=name) for p in PROMPTS]
    eng.run_until_idle()
    assert [s.output_ids for s in seqs] == reference[name][1]
    assert reference[name][1] != reference[None][1]  # the adapter changes the tokens
    check_idle(eng)
    eng.close()


# ------------------------------------------------------------------ mixed batches


def _requests(adapter_names):
    rng = random.Random(7)
    reqs = []
    for i in range(16):
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randrange(2, 30))]
        reqs.append((prompt, adapter_names[i % len(adapter_names)], rng.randrange(4, 14)))
    return reqs


def test_mixed_batch_equals_solo_runs_pipelined_and_blocking(model_path, adapters):
    """Base + three adapters with two slots: each request gets exactly its solo run's tokens."""
    three = {k: adapters[k] for k in ("qv", "mlp", "all")}
    reqs = _requests([None, "qv", "mlp", "all"])
    solo = []
    eng = make_engine(model_path, three, pipeline=False)
    for prompt, name, n in reqs:
        solo.append(eng.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True), adapter=name)[0].output_ids)
    eng.close()
    for pipelined in (True, False):
        eng = make_engine(model_path, three, pipeline=pipelined, max_loras=2)
        seqs = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), adapter=name) for p, name, n in reqs]
        peak = 0
        while eng.has_work:
            eng.tick()
            peak = max(peak, len({s.adapter for s in eng.scheduler.running}))
        assert [s.output_ids for s in seqs] == solo
        s = eng.stats()
        assert peak >= 3  # base rows and two adapters really shared launches
        assert s["lora_evictions"] > 0 and s["lora_loads"] > 2  # three adapters through two slots
        check_idle(eng)
        eng.close()
    # Non-vacuity: the same prompt under another adapter gives other tokens.
    by_adapter = {name: out for (p, name, n), out in zip(reqs, solo) if p == reqs[0][0]}
    eng = make_engine(model_path, three)
    other = eng.generate([reqs[0][0]], SamplingParams(max_tokens=reqs[0][2], ignore_eos=True), adapter="qv")[0]
    eng.close()
    assert other.output_ids != by_adapter[None]


def test_prefix_cache_keys_pages_by_adapter(model_path, adapters):
    """The same prompt under another adapter never maps the KV another adapter computed; under
    the same adapter it does, and the tokens stay those of a run without the cache."""
    two = {k: adapters[k] for k in ("qv", "all")}
    prompt = list(range(100, 140))  # 40 tokens: all but the last to share (five pages, the last filled by the answer)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eng = make_engine(model_path, two, prefix_cache=False)
    want = {a: eng.generate([prompt], params, adapter=a)[0].output_ids for a in (None, "qv", "all")}
    eng.close()
    assert len({tuple(v) for v in want.values()}) == 3
    eng = make_engine(model_path, two)
    for a in (None, "qv", "all", "qv"):
        seq = eng.generate([prompt], params, adapter=a)[0]
        assert seq.output_ids == want[a], a
        assert seq.cached_tokens == (39 if a == "qv" and seq.seq_id == 3 else 0), (a, seq.cached_tokens)
    check_idle(eng)
    eng.close()


# ------------------------------------------------------------------ slot refcounts


def test_lora_slots_lru_and_refcounts():
    loaded = []
    slots = LoraSlots(2, lambda slot, name: loaded.append((slot, name)))
    a = slots.acquire("a")
    b = slots.acquire("b")
    assert (a, b) == (1, 2) and slots.acquire("c") is None  # both referenced: c waits
    assert slots.acquire("a") == a and slots.refs[a] == 2 and slots.hits == 1
    slots.release(b)
    assert slots.acquire("c") == b and slots.evictions == 1  # b was the only unreferenced slot
    slots.release(a), slots.release(a)
    slots.release(b)
    assert slots.acquire("b") == a  # a is least recently used (released before c)
    assert loaded == [(1, "a"), (2, "b"), (2, "c"), (1, "b")]
    slots.launched([a])
    slots.release(a)
    with pytest.raises(RuntimeError):  # a launched step still reads slot a: evicting it is a bug
        slots._evict(a)
    with pytest.raises(RuntimeError):
        slots.release(a)  # no reference left: a double release is a bug
    slots.committed([a])
    assert slots.idle


def _assert_slots_consistent(eng, seqs):
    """Each slot's references are exactly its admitted, unreleased sequences; no step reads an unreferenced slot."""
    held = [0] * (eng.lora_slots.num_slots + 1)
    for s in seqs:
        if s.admitted and not s.released and s.lora_slot:
            held[s.lora_slot] += 1
            assert eng.lora_slots.name_of[s.lora_slot] == s.adapter
    assert held[1:] == eng.lora_slots.refs[1:]
    for launch in eng.pipeline.in_flight_items:
        for s in launch.seqs:
            if s.lora_slot:
                assert eng.lora_slots.refs[s.lora_slot] > 0 and eng.lora_slots.inflight[s.lora_slot] > 0


@pytest.mark.parametrize("pipelined", [True, False])
def test_slot_refcounts_under_cancels_and_zombies(model_path, adapters, pipelined):
    """Cancels at every phase and EOS zombies, with more adapters than slots: a slot is never
    reloaded under a launched step (LoraSlots raises if it were), and at idle no reference is left."""
    eng = make_engine(model_path, adapters, pipeline=pipelined, max_loras=2, prefill_budget=16)
    names = list(adapters)
    base = eng.generate([[9] * 6], SamplingParams(max_tokens=10, ignore_eos=True), adapter="qv")[0].output_ids
    stop = next(t for i, t in enumerate(base) if i >= 2 and base.index(t) == i)
    rng = random.Random(3)
    seqs = []
    for i in range(24):
        kind = i % 4
        p = SamplingParams(max_tokens=12, ignore_eos=kind != 3, stop_token_ids=[stop] if kind == 3 else [])
        prompt = [9] * 6 if kind == 3 else [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 40))]
        seqs.append(eng.submit(prompt, p, adapter="qv" if kind == 3 else names[i % len(names)]))
    cancel_at = {i: rng.randrange(0, 12) for i in range(len(seqs)) if i % 4 in (1, 2)}
    zombies_seen = False
    for tick in range(1000):
        if not eng.has_work:
            break
        for i, t in cancel_at.items():
            if t == tick:
                eng.cancel(seqs[i])
        eng.tick()
        _assert_slots_consistent(eng, seqs)
        zombies_seen |= any(s.finalized and s.inflight_refs for s in seqs if s.lora_slot)
    check_idle(eng)
    assert all(s.released for s in seqs)
    assert any(s.finish_reason == FinishReason.CANCELLED and s.admitted for s in seqs)
    assert any(s.finish_reason == FinishReason.STOP for s in seqs)
    if pipelined:
        assert zombies_seen and eng.stats()["zombie_rows"] > 0
    assert eng.stats()["lora_evictions"] > 0
    eng.close()


def test_a_request_waits_for_a_slot_instead_of_failing(model_path, adapters):
    eng = make_engine(model_path, adapters, max_loras=1)
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    first = eng.submit([5, 6, 7], p, adapter="qv")
    second = eng.submit([5, 6, 7], p, adapter="ko")
    eng.tick()
    assert first.admitted and not second.admitted  # the only slot is referenced by "qv"
    eng.run_until_idle()
    assert second.finish_reason == FinishReason.LENGTH and len(second.output_ids) == 6
    assert eng.stats()["lora_evictions"] == 1
    check_idle(eng)
    eng.close()


# ------------------------------------------------------------------ bad input


def test_unknown_adapter_fails_that_request_only(model_path, adapters):
    eng = make_engine(model_path, {"qv": adapters["qv"]})
    with pytest.raises(ValueError, match="adapter: unknown adapter 'nope'"):
        eng.submit([1, 2, 3], adapter="nope")
    ok = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3), adapter="qv")[0]
    assert len(ok.output_ids) >= 1
    eng.close()


def _copy_adapter(src, dst, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    t = load_file(src / "adapter_model.safetensors")
    if tensors is not None:
        t = tensors(t)
    save_file(t, dst / "adapter_model.safetensors")
    return dst


def test_bad_adapter_directories_are_clear_errors_at_start_up(model_path, adapters, tmp_path):
    from pathlib import Path

    base = json.loads((Path(model_path) / "config.json").read_text())
    src = Path(adapters["qv"])
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "rank": (dict(r=128), None, "rank 128 is over the limit of 64"),
        "shape": (None, lambda t: {**t, key: torch.zeros(8, 32)}, "lora_A is shape [8, 32]; the base model needs [8, 64]"),
        "module": (None, lambda t: {**t, key.replace("q_proj", "rotary"): torch.zeros(8, 64)},
                   "unknown target module self_attn.rotary"),
        "embed": (None, lambda t: {**t, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 64)},
                  "is not a LoRA weight of a Llama linear layer"),
        "layer": (None, lambda t: {**t, key.replace("layers.0", "layers.7"): torch.zeros(8, 64)},
                  "the base model has 2 layers"),
        "missing_b": (None, lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.v_proj.lora_B" not in k},
                      "lora_B is missing"),
        "dora": (dict(use_dora=True), None, "use_dora=True is not supported"),
    }
    for name, (config, tensors, message) in cases.items():
        bad = _copy_adapter(src, tmp_path / name, config, tensors)
        with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
            read_adapter(name, bad, base)
    with pytest.raises(AdapterError, match="adapter 'gone'"):
        read_adapter("gone", tmp_path / "nowhere", base)
    # The engine refuses to start with one.
    with pytest.raises(AdapterError, match="rank 128"):
        make_engine(model_path, {"bad": str(tmp_path / "rank")})
    # The unchanged copy is fine (the cases above fail for their own reason).
    read_adapter("ok", _copy_adapter(src, tmp_path / "ok"), base)
    assert parse_lora_option(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad_option in (["a"], ["=x"], ["a=/x", "a=/y"]):
        with pytest.raises(AdapterError):
            parse_lora_option(bad_option)


# ------------------------------------------------------------------ through the server and the CLI


def test_server_serves_adapters_and_rejects_unknown_ones(model_path, adapters):
    """Over ZeroMQ: each adapter's tokens equal the engine's; info lists adapters and those in slots;
    an unknown or mistyped adapter is a bad_request for that request only. Over HTTP (OpenAI):
    ``model`` names the base model or an adapter."""
    import threading

    import openai

    from frontend.client import BadRequest, Client
    from frontend.http import HttpListener
    from frontend.server.service import Service, ServiceConfig
    from frontend.server.zmq_server import Server

    two = {k: adapters[k] for k in ("qv", "mlp")}
    prompt = [1, 42, 7, 300, 5, 9]
    eng = make_engine(model_path, two)
    want = {name: eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), adapter=name)[0].output_ids
            for name in (None, "qv", "mlp")}
    eng.close()
    assert len({tuple(v) for v in want.values()}) == 3  # non-vacuity: three different answers
    svc = Service(ServiceConfig(model="tiny-random", device="cpu", dtype="float32", max_batch=8, kv_pages=200,
                                page_size=8, loras=two, max_loras=1))
    server = Server(svc, "tcp://127.0.0.1:*")
    http = HttpListener(server, "127.0.0.1", 0).start()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # OpenAI routes: an adapter is a model; its answer is the ZeroMQ answer with that adapter.
        oai = openai.OpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in oai.models.list().data] == ["tiny-random", "qv", "mlp"]
        texts = {}
        for model in ("tiny-random", "qv"):
            texts[model] = oai.completions.create(model=model, prompt="Once upon", max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].text
        with Client(server.endpoint, timeout=60) as c:
            for model, adapter in (("tiny-random", None), ("qv", "qv")):
                assert c.generate("Once upon", max_tokens=6, ignore_eos=True, adapter=adapter).text == texts[model]
        assert texts["qv"] != texts["tiny-random"]
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model="nope", prompt="Once upon", max_tokens=2)
        with Client(server.endpoint, timeout=60) as c:
            for name, tokens in want.items():
                r = c.generate(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True, adapter=name)
                assert r.token_ids == tokens, name
            info = c.info()
            assert info["adapters"] == ["qv", "mlp"] and info["adapters_loaded"] == ["mlp"]  # one slot, LRU
            with pytest.raises(BadRequest, match="unknown adapter 'nope'"):
                c.generate(prompt_token_ids=prompt, max_tokens=2, adapter="nope")
            with pytest.raises(BadRequest, match="adapter must be a string"):
                c.generate(prompt_token_ids=prompt, max_tokens=2, adapter=3)
            assert c.generate(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True,
                              adapter="qv").token_ids == want["qv"]  # still serving
    finally:
        http.stop()
        server.stop()
        thread.join(60)


def test_cli_reports_a_bad_adapter_in_one_line_before_starting_a_worker(model_path, adapters, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    bad = _copy_adapter(Path(adapters["qv"]), tmp_path / "big", dict(r=65))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-m", "frontend.cli.main", "generate", "hi", "--model", "tiny-random",
                        "--device", "cpu", "--lora", f"big={bad}", "--adapter", "big"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"Error: adapter 'big' ({bad}): rank 65 is over the limit of 64"]


def test_decode_graphs_are_keyed_by_the_lora_kernel(model_path, adapters, monkeypatch):
    """A CUDA graph freezes the LoRA kernel it was captured with (Python control
    flow): after a kernel switch the runner must capture another graph, not replay
    the old one. Graph capture itself needs a GPU; its keying does not."""
    from gpu_worker import model_runner

    eng = make_engine(model_path, adapters)
    try:
        monkeypatch.setattr(model_runner, "_DecodeGraph",
                            lambda runner, batch, pages, pool: SimpleNamespace(in_place=False))
        monkeypatch.setattr(eng.runner, "use_graphs", True)
        first = eng.runner._graph_for(0, 3, 10)
        assert eng.runner._graph_for(0, 3, 10) is first
        eng.runner.lora.kernel = "masked" if eng.runner.lora.kernel == "gather" else "gather"
        assert eng.runner._graph_for(0, 3, 10) is not first
    finally:
        eng.close()

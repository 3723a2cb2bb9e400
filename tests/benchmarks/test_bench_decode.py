"""Smoke tests of the decode benchmark on the tiny model: it runs in seconds and
emits every field of its JSON. No timing thresholds (timings belong to BENCHMARKS.md)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from processes import ROOT

from bench import decode

pytestmark = pytest.mark.slow

ROW_FIELDS = {"streams", "mode", "ms_per_step", "ms_per_step_spread", "device_idle_fraction", "host_ms_per_step",
              "zombie_tax", "tokens_per_s", "device_overruns"}
QUICK = ["--model", "tiny-random", "--tokens", "4", "--prompt-len", "8", "--repeats", "1", "--quiet"]


def run_json(capsys, *argv) -> dict:
    decode.main([*QUICK, *argv, "--json"])
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object on stdout


@pytest.mark.parametrize("device", ["cpu", "sim:1"])
def test_decode_emits_every_field(capsys, device):
    result = run_json(capsys, "--device", device, "--streams", "1,2")
    assert result["device"] == device and result["model"] == "tiny-random"
    rows = result["rows"]
    assert {(r["streams"], r["mode"]) for r in rows} == {(s, m) for s in (1, 2) for m in ("blocking", "pipelined")}
    for r in rows:
        assert ROW_FIELDS <= r.keys(), ROW_FIELDS - r.keys()
        lo, hi = r["ms_per_step_spread"]
        assert 0 < lo <= r["ms_per_step"] <= hi
        assert 0.0 <= r["device_idle_fraction"] <= 1.0
        assert r["host_ms_per_step"] > 0 and r["tokens_per_s"] > 0
        assert r["zombie_tax"] == 0  # ignore_eos + length caps never make zombies
        assert r["decode_steps"] == 4
        assert 0 <= r["device_overruns"] <= r["timed_steps"] == 4
        if device == "cpu":
            assert r["device_overruns"] == 0  # only a simulated device has a clock to overrun
    for r in rows:
        if r["mode"] == "pipelined":
            assert r["tokens_match_blocking"] is True
    assert set(result["speedup"]) == {"1", "2"}
    assert all(v > 0 for v in result["speedup"].values())


def test_sim_overruns_are_reported(capsys):
    """sim:0 leaves no device time for the real work: its steps overrun,
    and the table says the rows measure the CPU."""
    result = run_json(capsys, "--device", "sim:0", "--streams", "1", "--mode", "blocking")
    assert result["rows"][0]["device_overruns"] > 0
    decode.main([*QUICK, "--device", "sim:0", "--streams", "1", "--mode", "blocking"])
    assert "WARNING:" in capsys.readouterr().out


@pytest.mark.parametrize("dtype, expected", [("auto", None), ("float32", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_option(capsys, dtype, expected):
    from gpu_worker.model_runner import default_dtype

    result = run_json(capsys, "--device", "cpu", "--streams", "1", "--mode", "blocking", "--dtype", dtype)
    assert result["dtype"] == (expected or str(default_dtype(False)).replace("torch.", ""))


def test_decode_single_mode_and_table(capsys):
    decode.main([*QUICK, "--device", "cpu", "--streams", "1", "--mode", "pipelined"])
    out = capsys.readouterr().out
    assert "| 1 | pipelined |" in out and "| blocking |" not in out


def test_on_a_cpu_every_mode_shares_one_compute_thread(capsys, monkeypatch):
    """The engines of every mode, and the baseline, run on one Device: libgomp keeps a thread pool per
    thread that runs parallel regions and stops spinning once the pools outnumber the CPUs (a
    one-stream step took 2x the served one). The host thread's OpenMP count is back afterwards."""
    import torch

    engines, generated_on = [], []
    real_engine, real_generate = decode.make_engine, decode.HFBaseline._generate
    monkeypatch.setattr(decode, "make_engine", lambda *a: engines.append(real_engine(*a)) or engines[-1])

    def generate(self, *a):
        out = real_generate(self, *a)
        generated_on.append(self.shared)
        return out

    monkeypatch.setattr(decode.HFBaseline, "_generate", generate)
    before = torch.get_num_threads()
    result = run_json(capsys, "--device", "cpu", "--streams", "1", "--baseline", "transformers")
    assert len(engines) == 2 and engines[0].device is engines[1].device
    assert generated_on and all(d is engines[0].device for d in generated_on)
    assert torch.get_num_threads() == before
    fresh = []  # what a new thread, as the compute thread, runs its OpenMP regions on
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert result["machine"]["torch_threads"] == fresh[0]
    assert engines[0].device.compute._thread.is_alive() is False  # closed once, by the benchmark


def test_baseline_transformers(capsys):
    result = run_json(capsys, "--device", "cpu", "--streams", "2", "--baseline", "transformers")
    modes = {r["mode"]: r for r in result["rows"]}
    assert set(modes) == {"blocking", "pipelined", "transformers"}
    hf = modes["transformers"]
    assert ROW_FIELDS <= hf.keys()
    assert hf["ms_per_step"] > 0 and hf["tokens_per_s"] > 0
    # Same weights, same prompts, greedy: the tokens agree (fp32 on the CPU).
    assert hf["token_agreement_with_tandem"] == 1.0
    assert result["baseline_ratio"]["2"] > 0
    assert modes["pipelined"]["ratio_vs_transformers"] == result["baseline_ratio"]["2"]


def test_zombie_case(capsys):
    result = run_json(capsys, "--device", "cpu", "--zombie-case", "--no-throughput")
    assert result["rows"] == []
    z = {r["mode"]: r for r in result["zombie"]}
    assert z["pipelined"]["zombie_tax"] > 0 and z["pipelined"]["zombie_rows_per_request"] == 1
    assert z["blocking"]["zombie_tax"] == 0 and z["blocking"]["zombie_rows"] == 0
    for r in z.values():
        assert ROW_FIELDS <= r.keys()
        assert abs(r["answer_tokens"] - decode.ZOMBIE_TARGET) <= 20


def test_click_command():
    from click.testing import CliRunner

    res = CliRunner().invoke(decode.decode_command, [*QUICK, "--device", "sim:1", "--streams", "1", "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert len(result["rows"]) == 2
    bad = CliRunner().invoke(decode.decode_command, ["--mode", "nonsense"])
    assert bad.exit_code != 0 and "nonsense" in bad.output


BLOCK_SERVER_LIBRARIES = ("import sys\n"
                          "for m in ('zmq', 'msgspec', 'xgrammar', 'msgpack', 'click'):\n"
                          "    sys.modules[m] = None  # importing them fails\n")


def test_runs_without_server_libraries():
    """The benchmark and the GPU pre-check need only torch, transformers and numpy
    (GPU images lack pyzmq, msgspec and grammar libraries; click is optional)."""
    code = BLOCK_SERVER_LIBRARIES + (
        "from bench import decode\n"
        "decode.main(['--model', 'tiny-random', '--device', 'cpu', '--streams', '1', '--tokens', '2',"
        " '--prompt-len', '4', '--repeats', '1', '--quiet', '--json'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["rows"]
    code = BLOCK_SERVER_LIBRARIES + "from bench import gpu_check\nsys.exit(gpu_check.precheck('random-tiny', 'cpu'))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "precheck OK" in out.stdout, out.stdout[-1000:] + out.stderr[-2000:]


def test_random_model_configs():
    """The benchmarks' random Llamas have the published shapes (built on the meta device: no memory)."""
    from gpu_worker.model import Llama, LlamaConfig
    from shared.models.registry import REGISTRY, builtin

    sizes = {name: Llama(LlamaConfig.from_hf_config(m.random_config), device="meta").num_params()
             for name, m in REGISTRY.items() if m.random_config is not None and m.bench == "tandem bench decode"}
    assert 130e6 < sizes["random-smollm2-135m"] < 140e6
    assert 1.1e9 < sizes["random-llama-3.2-1b"] < 1.3e9
    assert sizes["tiny-random-llama-vocab4k"] < 1e6
    assert builtin("random-1b").name == "random-llama-3.2-1b" and builtin("random-tiny").random_config is not None
    with pytest.raises(SystemExit, match="python -m bench.moondream --model random-moondream2"):
        decode.load_model("random-moondream2", "cpu", None, seed=0, max_model_len=64)


def test_gpu_precheck_runs_on_cpu_and_can_fail(monkeypatch, capsys):
    """bench/gpu.sh's pre-check (pipelined == blocking, ids copied into a shared-memory
    arena by the copy stream) passes on the CPU backend, and fails when the arena
    never receives the ids (non-vacuity of the sink check)."""
    from bench import gpu_check

    assert gpu_check.precheck("random-tiny", "cpu") == 0
    assert "precheck OK" in capsys.readouterr().out
    def copy_elsewhere(self, views):  # the arena views are checked, the copies go to other arrays
        return [np.empty_like(v) for v in views]

    monkeypatch.setattr(gpu_check._RingSink, "_copy_targets", copy_elsewhere)
    assert gpu_check.precheck("random-tiny", "cpu") == 1
    assert "differ from the committed ids" in capsys.readouterr().out


def test_gpu_feature_checks_run_on_cpu_and_can_fail(monkeypatch, capsys):
    """bench/gpu.sh's feature checks (LoRA, prefix cache, images, the two processes)
    pass on the CPU backend, and each one fails when the engine under test (the
    pipelined one; the references are blocking) gets the requests wrong."""
    from bench import gpu_features

    dry_run = ["--device", "cpu", "--llm", "tiny-random", "--vlm", "tiny-random-vlm"]
    assert gpu_features.main(dry_run) == 0
    out = capsys.readouterr().out
    assert all(f"feature {name}: OK" in out for name in gpu_features.CHECKS), out

    real_engine = gpu_features._engine

    def engine_that_garbles(model, device, dtype, pipeline, **kw):
        engine = real_engine(model, device, dtype, pipeline, **kw)
        if pipeline:
            submit = engine.submit

            def garbled(prompt_ids, params, adapter=None, images=None, task=None):
                if images:  # the features of another picture
                    images = [dataclasses.replace(im, tiles=[np.zeros_like(t) for t in im.tiles]) for im in images]
                else:
                    prompt_ids = prompt_ids[::-1]
                return submit(prompt_ids, params, images=images, task=task)  # and the adapter is lost

            engine.submit = garbled
        return engine

    monkeypatch.setattr(gpu_features, "_engine", engine_that_garbles)
    assert gpu_features.main(dry_run) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("feature ")]
    assert [line.split(":")[0] for line in failed] == [f"feature {name}" for name in gpu_features.CHECKS], out
    assert all(": FAILED" in line and "AssertionError" in line and "against" in line for line in failed), out


def test_moondream_bench_in_memory_and_its_summary(monkeypatch, capsys, tmp_path):
    """bench/gpu.sh's Moondream stage: ``bench.moondream`` on random-moondream2's path (drawn in
    memory, the stand-in tokenizer; here at tiny-random-moondream's shapes) emits text and detect
    rows at 1 and N streams in both modes, and gpu_check's summary prints them as a table."""
    from bench import gpu_check
    from bench import moondream as bench_moondream
    from gpu_worker.moondream import Moondream
    from shared.models import registry
    from shared.moondream_config import MoondreamConfig
    from shared.moondream_random import TINY_CONFIG

    tiny = dataclasses.replace(registry.REGISTRY["random-moondream2"], random_config=TINY_CONFIG)
    monkeypatch.setitem(registry.REGISTRY, "random-moondream2", tiny)
    out = bench_moondream.main(["--model", "random-moondream2", "--repeats", "1", "--streams", "3",
                                "--detect-streams", "2", "--tokens", "3", "--objects", "1", "--json"])
    assert json.loads(capsys.readouterr().out) == out
    assert out["params"] == Moondream(MoondreamConfig.from_dict(TINY_CONFIG), device="meta").num_params()
    fields = {"tokens_per_s", "ms_per_step", "device_idle", "overruns"}
    for kind, counts in (("text_streams", ["1", "3"]), ("detect_streams", ["1", "2"])):
        assert list(out[kind]) == counts
        assert all(set(row[mode]) == fields and row[mode]["ms_per_step"] > 0
                   for row in out[kind].values() for mode in ("pipelined", "blocking"))
    (tmp_path / "moondream.json").write_text(json.dumps(out))
    assert gpu_check.summary([str(tmp_path / "moondream.json")]) == 0
    table = capsys.readouterr().out
    assert "=== Moondream random-moondream2" in table
    assert [line.split(" | ")[:2] for line in table.splitlines() if line.startswith("| text") or
            line.startswith("| detect")] == [["| text", "1"], ["| text", "3"], ["| detect", "1"], ["| detect", "2"]]


def test_a_real_model_is_measured_as_it_is_served():
    """A model's files are benchmarked as `tandem serve` holds them: the default model as its GGUF
    file's blocks with float32 activations, every layer in the kernels' one call over a bf16 cache
    (not its dequantized weights in the CPU's default dtype)."""
    import torch
    from prerequisites import unavailable

    from gpu_worker.cpu_backend import layer_table
    from shared.models.registry import resolve_model

    try:
        resolve_model("smollm2-135m", quiet=True)
    except (ImportError, FileNotFoundError) as e:
        unavailable(f"smollm2-135m weights not available here: {e!r}")
    loaded = decode.load_model("smollm2-135m", "cpu", None, seed=0, max_model_len=256)
    assert (loaded.weights, loaded.dtype) == ("gguf", torch.float32)
    engine = decode.make_engine(loaded, "cpu", True, max_batch=2, max_model_len=256, kv_pages=40, prefill_budget=256,
                                cuda_graphs=False)
    try:
        runner = engine.runner
        assert runner.model is loaded.llama and runner.kv.k.dtype == torch.bfloat16
        assert layer_table(runner.model, runner.model.cpu_kernels) is not None
    finally:
        engine.close()

"""Tandem against its peers (vLLM-CPU, llama.cpp's server) on one machine, one after another, one client.

    python -m bench.peers                                          # Tandem only
    python -m bench.peers --vllm-python /work/peers/vllm-venv/bin/python \\
        --llama-server /work/peers/llama.cpp/build/bin/llama-server --gguf /work/peers/smollm2-135m-bf16.gguf
    python -m bench.peers --tandem q4_1= --tandem bf16="--quantization none --dtype bfloat16" \\
        --llama-server LLAMA_SERVER --gguf Q4_1.gguf --gguf Q8_0.gguf     # formats side by side

The workload (issue 24): SmolLM2-135M-Instruct, a 47-token chat prompt
(the chat template included), 128 output tokens with EOS ignored, greedy,
OpenAI chat completions streamed over HTTP, with ``bench/serve.py``'s HTTP client;
first 1 stream (``--one-requests`` requests one after another), then 32 streams
(closed-loop clients) over 64 requests. Every engine is started by this command
(``nice`` 0, on a free port) and warmed up with two requests; each ``--tandem NAME=ARGS`` is a
Tandem server with those options (default: one, ``tandem``, with its defaults), each ``--gguf``
one llama.cpp server on that file. The machine's memory read bandwidth is measured first (a sum
over a buffer larger than the last-level cache, every core) and each GGUF file's weight bytes
over it give the 1-stream limit printed beside the engines (a decode step reads every weight); then ``--rounds`` rounds
measure each engine in turn while the others sit idle (so they never share the cores),
each round starting one engine later. The rounds are there because this kind of VM's
speed drifts by up to 2x within minutes: a ratio is taken between the engines of one
round, minutes apart, not between runs. Per engine, round and level:
output tokens/s, ITL p50, TTFT p50, and the server's CPU (utime + stime of its
process tree, in cores, over the level's wall time); the machine's load average
is printed with each row (numbers taken on a loaded machine are not comparable).

Prompt: a fixed word sequence whose rendered chat prompt is ``--prompt-tokens``
tokens with SmolLM2's tokenizer and template (counted once here); each server's
own count (``usage.prompt_tokens``) is in the table, so a mismatch shows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.serve import WORDS, Work, run_level

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_s(pid: int) -> float:
    """utime + stime (seconds) of ``pid`` and all its descendants still alive."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        ppid = int(fields[1])
        children.setdefault(ppid, []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


class Server:
    """One engine's server process (its own process group), up until ``stop``."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None, log_dir: Path = Path("/tmp")):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"peers-{name}.log"
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float) -> str:
        """Wait for ``GET /v1/models`` to answer; returns the served model's id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    return json.loads(r.read())["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def engines(args) -> list[tuple[str, list[str], dict]]:
    """(name, argv with {port}, extra environment) of each engine to run."""
    variants = [v.partition("=") for v in args.tandem] or [("tandem", "=", "")]
    out = [(name if name.startswith("tandem") else f"tandem {name}",
            [sys.executable, "-m", "frontend.cli.main", "serve", "--model", args.model, "--device", "cpu",
             "--bind", "tcp://127.0.0.1:{zmq}", "--http", "127.0.0.1:{port}", *extra.split(), *args.tandem_arg], {})
           for name, _, extra in variants]
    if args.vllm_python:
        out.append(("vllm-cpu", [args.vllm_python, str(ROOT / "bench" / "vllm_cpu.py"), "serve", args.hf_dir,
                                 "--dtype", "bfloat16", "--port", "{port}", "--max-model-len", "2048",
                                 "--max-num-seqs", "64", "--served-model-name", "smollm2",
                                 # on the CPU this is the share of host memory vLLM reserves (KV cache and all)
                                 "--gpu-memory-utilization", "0.2"],
                    {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}))
    if args.llama_server:
        # The HF directory's chat template, so that llama.cpp renders the same prompt as the others
        # (the GGUF's own template has no default system prompt: 37 tokens instead of 47).
        template = Path(args.hf_dir) / "chat_template.jinja"
        same_prompt = ["--jinja", "--chat-template-file", str(template)] if template.exists() else []
        for gguf in args.gguf:
            out.append((f"llama.cpp {gguf_kind(gguf)}", [args.llama_server, "-m", gguf, "-t", str(os.cpu_count()),
                                                         "--port", "{port}", "-np", "32", "-c", str(32 * 512),
                                                         "--no-webui", *same_prompt], {}))
    return out


def gguf_kind(path: str) -> str:
    """A GGUF file's main weight type (its most common one by bytes), e.g. ``Q4_1``."""
    from collections import Counter

    import gguf

    sizes = Counter()
    for t in gguf.GGUFReader(path).tensors:
        sizes[t.tensor_type.name] += int(t.n_bytes)
    return sizes.most_common(1)[0][0]


def gguf_weight_bytes(path: str) -> int:
    """The bytes of a GGUF file's tensors: what one decode step reads (the tied head reads the
    embedding table once; a lookup reads a few rows)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def read_bandwidth(gib: float = 1.0) -> float:
    """The machine's memory read bandwidth, bytes/s: the best of 5 sums over a ``gib`` GiB buffer
    (larger than any last-level cache) on every core (STREAM's read kernel in spirit)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    buf = torch.ones(int(gib * 2 ** 30) // 4)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(5))
    return buf.numel() * 4 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- the workload


def prompt_words(hf_dir: str, tokens: int) -> int:
    """How many words of ``WORDS`` make a chat prompt of ``tokens`` tokens (template included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    for n in range(1, tokens + 1):
        ids = tok.apply_chat_template([{"role": "user", "content": _text(n)}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) >= tokens:
            return n
    raise ValueError(f"no word count gives a {tokens}-token prompt")


def _text(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def level(url: str, model: str, concurrency: int, requests: int, words: int, max_tokens: int, pid: int,
          idle_pids: tuple[int, ...] = ()) -> dict:
    """One level over HTTP; adds the server's CPU (cores), the idle engines' (``idle_pids``: they
    should take none) and the load average."""
    work = [Work(list(range(words)), max_tokens) for _ in range(requests)]  # Work.text: WORDS in order
    idle0 = sum(tree_cpu_s(p) for p in idle_pids)
    cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
    row = asyncio.run(run_level("", concurrency, work, True, True, 600.0, http=(url, model)))
    wall = time.perf_counter() - t0
    row["server_cpu_cores"] = round((tree_cpu_s(pid) - cpu0) / wall, 2)
    row["idle_engines_cpu_cores"] = round((sum(tree_cpu_s(p) for p in idle_pids) - idle0) / wall, 3)
    row["load"] = round(os.getloadavg()[0], 2)
    return row


def prompt_tokens(url: str, model: str, words: int) -> int | None:
    """The server's own count of the prompt (``usage.prompt_tokens`` of a short request)."""
    body = {"model": model, "messages": [{"role": "user", "content": _text(words)}], "max_tokens": 1,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()).get("usage", {}).get("prompt_tokens")


def run(args) -> dict:
    words = prompt_words(args.hf_dir, args.prompt_tokens)
    bandwidth = read_bandwidth()
    limits = {}
    for gguf in args.gguf:
        weight_bytes = gguf_weight_bytes(gguf)
        limits[gguf_kind(gguf)] = {"weight_bytes": weight_bytes, "step_ms": round(weight_bytes / bandwidth * 1e3, 2),
                                   "tokens_per_s": round(bandwidth / weight_bytes, 1)}
    results = {"workload": {"prompt_tokens": args.prompt_tokens, "words": words, "max_tokens": args.max_tokens,
                            "one_stream_requests": args.one_requests, "streams": args.streams,
                            "requests": args.requests},
               "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "load_at_start": os.getloadavg()[0],
                           "read_gb_per_s": round(bandwidth / 1e9, 1),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
               "bandwidth_limits": limits,
               "engines": {}}
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s; 1-stream limits: {limits}", file=sys.stderr, flush=True)
    servers = {}
    try:
        for name, argv, env in engines(args):  # all started first, then measured in turns (below)
            port = free_port()
            argv = [a.format(port=port, zmq=free_port()) for a in argv]
            print(f"== {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
            server = Server(name, argv, port, env)
            servers[name] = server
            try:
                t0 = time.perf_counter()
                model = server.wait_ready(args.start_timeout)
                results["engines"][name] = {"start_s": round(time.perf_counter() - t0, 1), "model": model,
                                            "prompt_tokens": prompt_tokens(server.url, model, words), "rounds": []}
                level(server.url, model, 1, 2, words, args.max_tokens, server.proc.pid)  # warm-up
            except (RuntimeError, TimeoutError, OSError) as e:
                results["engines"][name] = {"error": str(e)}
                print(f"!! {name}: {e}", file=sys.stderr, flush=True)
                server.stop()
        ready = [n for n, e in results["engines"].items() if "error" not in e]
        for r in range(args.rounds):
            for name in ready[r % len(ready):] + ready[:r % len(ready)]:  # each round starts one engine later
                entry, server = results["engines"][name], servers[name]
                if "error" in entry:
                    continue
                idle = tuple(servers[n].proc.pid for n in ready if n != name)
                try:
                    one = level(server.url, entry["model"], 1, args.one_requests, words, args.max_tokens,
                                server.proc.pid, idle)
                    many = level(server.url, entry["model"], args.streams, args.requests, words, args.max_tokens,
                                 server.proc.pid, idle)
                except (RuntimeError, TimeoutError, OSError) as e:
                    entry["error"] = str(e)
                    print(f"!! {name}: {e}", file=sys.stderr, flush=True)
                    continue
                entry["rounds"].append({"one": one, "many": many})
                print(f"round {r + 1}: " + row_text(name, entry["rounds"][-1]), file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return results


# --------------------------------------------------------------------------- the table


def cpu_name() -> str:
    """The CPU's model name and the flags that pick Tandem's kernel level."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{name} ({' '.join(keep) or 'no AVX2'})"


def row_text(name: str, r: dict) -> str:
    one, many = r["one"], r["many"]
    return (f"{name}: 1 stream {one['output_tokens_per_s']} tok/s ITL p50 {one['itl_ms']['p50']} ms | "
            f"{many['concurrency']} streams {many['output_tokens_per_s']} tok/s TTFT p50 {many['ttft_ms']['p50']} ms "
            f"CPU {many['server_cpu_cores']} (idle engines {many['idle_engines_cpu_cores']}) | "
            f"errors {one['errors'] + many['errors']} (reconnects {one['reconnects'] + many['reconnects']}) | "
            f"load {many['load']}")


def table(results: dict) -> str:
    """One row per engine and round; a peer's ratio is Tandem's over the peer's in the same round
    (measured minutes apart, so a drift in the machine's speed between rounds cancels): the Tandem
    variant named for the peer's weights where there is one (``tandem q8_0`` for ``llama.cpp
    Q8_0``: the same file), else the first."""
    eng = {k: v for k, v in results["engines"].items() if "error" not in v}
    first = next((v for k, v in eng.items() if k.startswith("tandem")), None)
    n = results["workload"]["streams"]
    lines = [f"| engine | round | prompt tokens | 1 stream tok/s | ITL p50 ms | {n} streams tok/s | "
             f"TTFT p50 @{n} ms | server CPU @{n} | errors | load | Tandem / engine (1, {n} streams) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, e in eng.items():
        for i, r in enumerate(e["rounds"]):
            one, many = r["one"], r["many"]
            ratio = "-"
            base = eng.get(f"tandem {name.rpartition(' ')[2].lower()}", first)
            if base is not None and not name.startswith("tandem") and i < len(base["rounds"]):
                t = base["rounds"][i]
                ratio = (f"{t['one']['output_tokens_per_s'] / one['output_tokens_per_s']:.2f}x, "
                         f"{t['many']['output_tokens_per_s'] / many['output_tokens_per_s']:.2f}x")
            lines.append(f"| {name} | {i + 1} | {e['prompt_tokens']} | {one['output_tokens_per_s']} | "
                         f"{one['itl_ms']['p50']} | {many['output_tokens_per_s']} | {many['ttft_ms']['p50']} | "
                         f"{many['server_cpu_cores']} | {one['errors'] + many['errors']} | "
                         f"{one['load']}, {many['load']} | {ratio} |")
    for name, e in results["engines"].items():
        if "error" in e:
            lines.append(f"| {name} | failed: {e['error'][:120]} |")
    m = results["machine"]
    lines.append(f"\n{m['cpu']}, {m['cpus']} CPUs; memory read {m['read_gb_per_s']} GB/s; a 1-stream decode step "
                 "reads every weight once, so at most: " + ", ".join(
                     f"{k} {v['weight_bytes'] / 1e6:.0f} MB -> {v['step_ms']} ms, {v['tokens_per_s']} tok/s"
                     for k, v in results["bandwidth_limits"].items()))
    return "\n".join(lines)


def main(argv=None) -> dict:
    from shared.models.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="Tandem's model (a built-in or a HF directory)")
    ap.add_argument("--hf-dir", default=None, help="the same weights as a HF directory, for vLLM and the "
                                                   "tokenizer (default: Tandem's converted cache directory)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (BENCHMARKS.md Peers)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF of the same weights, for llama.cpp "
                                                                   "(repeatable: one server each)")
    ap.add_argument("--tandem", action="append", default=[], metavar="NAME=ARGS",
                    help="a Tandem server named NAME with the options ARGS (repeatable; default: one, its defaults)")
    ap.add_argument("--tandem-arg", action="append", default=[], help="extra option of every tandem serve (repeatable)")
    ap.add_argument("--prompt-tokens", type=int, default=47)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--one-requests", type=int, default=8, help="requests at 1 stream")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64, help="requests at --streams streams")
    ap.add_argument("--rounds", type=int, default=2, help="measurements of every engine, in turns")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds an engine may take to start (vLLM compiles)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.llama_server and not args.gguf:
        ap.error("--llama-server needs --gguf")
    args.hf_dir = args.hf_dir or str(resolve_model(args.model))
    results = run(args)
    print(table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()

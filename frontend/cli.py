"""The ``tandem`` command line.

Every command prints one readable line on error (``Error: <message>``, no
traceback; ``TANDEM_DEBUG=1`` shows it) and exits 130 on Ctrl-C; ``--help`` on
each command shows examples.

``tandem generate`` runs its request through the same ``Service`` that
``tandem serve`` uses (a worker process, the frontend's commit: detokenization,
stop strings, grammar masks), or through a running server with ``--connect``:
one commit path, whichever way the answer is produced.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from frontend import serve_options
from shared.lora_config import KERNELS

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories; never reach for a hub

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
LOG_LEVELS = ["debug", "info", "warning", "error"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]
CACHE_HELP = ("Models are cached in $TANDEM_CACHE/models if set, else $XDG_CACHE_HOME/tandem/models, "
              "else ~/.cache/tandem/models.")


class _Main(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:  # one line, not a traceback
            if os.environ.get("TANDEM_DEBUG"):
                raise
            raise click.ClickException(str(e) or type(e).__name__) from e


def _set_log_level(ctx, param, value):
    if value is not None:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")  # once (no-op after)
        logging.getLogger().setLevel(value.upper())


def log_level_option(default: str | None = None):
    """``--log-level`` on the group (``tandem --log-level info serve``) and on each command
    (``tandem serve --log-level info``); the command's wins."""
    return click.option("--log-level", type=click.Choice(LOG_LEVELS), default=default, show_default=default is not None,
                        expose_value=False, is_eager=True, callback=_set_log_level,
                        help="Logging on stderr (also the GPU worker's).")


def normalize_endpoint(ctx, param, value: str | None) -> str | None:
    """ZeroMQ endpoints; a bare HOST:PORT means tcp://HOST:PORT."""
    if value is None:
        return None
    scheme, sep, rest = value.rpartition("://")
    if not sep:
        scheme, rest = "tcp", value
    host, colon, port = rest.rpartition(":")
    if scheme == "tcp" and not (colon and host and (port == "*" or port.isdigit() and int(port) < 1 << 16)):
        raise click.BadParameter(f"{value!r}: expected HOST:PORT, tcp://HOST:PORT or ipc://PATH")
    return f"{scheme}://{rest}"


def connect_option(default: str | None, help: str):
    return click.option("--connect", default=default, show_default=default is not None, callback=normalize_endpoint,
                        help=help)


def timeout_option(default: float):
    return click.option("--timeout", default=default, show_default=True, type=click.FloatRange(min=0, min_open=True),
                        help="Seconds to wait for the server's first answer before giving up.")


# Options that configure the in-process engine (the worker that `generate` and `serve` start).
ENGINE_OPTIONS = ["model", "device", "dtype", "no_pipeline", "no_prefix_cache", "max_batch", "max_model_len", "kv_pages",
                  "kv_memory_fraction", "lora", "max_loras", "lora_kernel"]


def engine_options(fn):
    """Options shared by every command that starts a GPU worker."""
    opts = [
        click.option("--model", default="smollm2-135m", show_default=True,
                     help="smollm2-135m | tiny-random | path to a Hugging Face directory"),
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | sim:MS"),
        click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
                     help="Weights and KV cache (auto: bfloat16 on CUDA and on CPUs with native bf16, else float32)."),
        click.option("--no-pipeline", is_flag=True, help="Blocking decode (the baseline)."),
        click.option("--no-prefix-cache", is_flag=True,
                     help="Compute every prompt in full (no KV pages shared between requests; for A/B runs)."),
        click.option("--max-batch", default=64, show_default=True, help="Batch rows (concurrent sequences)."),
        click.option("--max-model-len", default=2048, show_default=True, help="Context length cap."),
        click.option("--kv-pages", type=int, default=None, help="KV cache pages (default: sized to memory)."),
        click.option("--kv-memory-fraction", default=0.5, show_default=True,
                     help="Fraction of free GPU memory for the KV cache (CUDA, without --kv-pages)."),
        click.option("--lora", multiple=True, metavar="NAME=DIR",
                     help="Serve a LoRA adapter (PEFT directory) under NAME (repeatable)."),
        click.option("--max-loras", default=4, show_default=True, type=click.IntRange(min=1),
                     help="Device slots for adapters; more adapters are loaded on demand (LRU)."),
        click.option("--lora-kernel", type=click.Choice(KERNELS), default="gather", show_default=True,
                     help="How each row applies its adapter: gather its own A and B, or multiply by every "
                          "slot's and mask the others (see BENCHMARKS.md)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def service_config(engine_kw: dict, **extra):
    """The ServiceConfig (engine fields + the frontend's) for the engine options of a command."""
    from frontend.service import ServiceConfig

    from shared.lora_config import parse_lora_option

    kw = dict(engine_kw)
    dtype = kw.pop("dtype")
    kw["loras"] = parse_lora_option(kw.pop("lora"))
    return ServiceConfig(pipeline=not kw.pop("no_pipeline"), prefix_cache=not kw.pop("no_prefix_cache"),
                         dtype=None if dtype == "auto" else dtype,
                         log_level=logging.getLevelName(logging.getLogger().level), **kw, **extra)


def given(ctx: click.Context, name: str) -> bool:
    """True if the user set option ``name`` (even to its default value)."""
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@click.group(cls=_Main)
@log_level_option(default="warning")
def main() -> None:
    """Tandem: an inference server whose GPU never waits for the CPU."""


@main.command()
@click.argument("prompt", required=False)
@engine_options
@connect_option(None, "Use a running server (e.g. tcp://127.0.0.1:5557 or 127.0.0.1:5557) instead of "
                      "starting a GPU worker. The engine options (--model aside) belong to that server.")
@timeout_option(30.0)
@click.option("--raw", is_flag=True, help="Send PROMPT as plain text, without the chat template.")
@click.option("--max-tokens", default=256, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable); never part of the output.")
@click.option("--stop-token-id", multiple=True, type=int, help="Stop token id (repeatable).")
@click.option("--ignore-eos", is_flag=True)
@click.option("--grammar", type=click.Choice(["point", "box"]), default=None,
              help="Constrain the answer to points or boxes (normalised coordinates).")
@click.option("--max-objects", default=8, show_default=True, help="With --grammar: most items.")
@click.option("--regex", default=None, help="Constrain the answer to a regular expression.")
@click.option("--json-schema", "json_schema", type=click.File("r"), default=None,
              help="Constrain the answer to a JSON schema (file).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image file for a vision-language model (repeatable). Placed before the prompt's text, or "
                   "at each <image> of a --raw prompt.")
@click.option("--adapter", default=None, help="Answer with this LoRA adapter (one the worker or server has).")
@click.option("--skill", type=click.Choice(["caption", "query", "point", "detect"]), default=None,
              help="A Moondream model's skill on the --image: PROMPT is the question (query) or the object "
                   "(point, detect); caption takes none.")
@click.option("--length", type=click.Choice(["short", "normal", "long"]), default="normal", show_default=True,
              help="With --skill caption.")
@click.option("--reasoning", is_flag=True, help="With --skill query: reason first.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print text as it arrives.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"text", "token_ids", "finish_reason", "usage"} (and "output" for --grammar/--regex/'
                   '--json-schema).')
@serve_options.client_key_options
@log_level_option()
@click.pass_context
def generate(ctx, prompt, connect, timeout, raw, max_tokens, temperature, top_p, top_k, seed, stop, stop_token_id,
             ignore_eos, grammar, max_objects, regex, json_schema, images, adapter, skill, length, reasoning, stream,
             as_json, server_key, client_key, **engine_kw):
    """Generate a completion for PROMPT (or stdin: PROMPT '-' or a pipe).

    Without --connect it starts a GPU worker for this one request, as `tandem serve` would.

    \b
    Examples:
      tandem generate "What is the capital of France?"
      tandem generate "Write a haiku" --temperature 0.8 --seed 1 --json
      echo "Once upon a time" | tandem generate --raw --max-tokens 40
      tandem generate "Point at the cat" --grammar point --max-objects 3
      tandem generate "Hi" --connect 127.0.0.1:5557
      tandem generate "What is in this picture?" --model ./SmolVLM-256M-Instruct --image cat.jpg
      tandem generate "Hi" --lora pirate=./pirate-lora --adapter pirate
      tandem generate cat --skill detect --model ./moondream2 --image cat.jpg --json
    """
    if connect:
        misplaced = [_flag(n) for n in ENGINE_OPTIONS if n != "model" and given(ctx, n)]
        if misplaced:
            raise click.UsageError(f"{', '.join(misplaced)}: options of a local GPU worker, not of --connect "
                                   "(the server's own apply: set them on `tandem serve`)")
    elif given(ctx, "timeout"):
        raise click.UsageError("--timeout applies to --connect only")
    if skill is not None:
        return _generate_skill(ctx, skill, prompt, length, reasoning, max_objects, images, connect, timeout,
                               server_key, client_key, engine_kw, as_json, stream)
    prompt = _read_prompt(prompt)
    kinds = [g for g in (grammar, regex, json_schema) if g is not None]
    if len(kinds) > 1:
        raise click.UsageError("use at most one of --grammar, --regex, --json-schema")
    spec = None
    if grammar:
        spec = {"kind": grammar, "max_objects": max_objects}
    elif regex is not None:
        spec = {"kind": "regex", "pattern": regex}
    elif json_schema is not None:
        spec = {"kind": "json_schema", "schema": json.load(json_schema)}
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    stop_token_ids=list(stop_token_id), ignore_eos=ignore_eos)
    live = stream and not as_json
    echo = (lambda text: click.echo(text, nl=False)) if live else (lambda text: None)
    if connect:
        model = engine_kw["model"] if given(ctx, "model") else None
        curve = serve_options.client_curve(server_key, client_key)
        result = _generate_remote(prompt, raw, sampling, list(stop), spec, echo, connect, timeout, model, curve,
                                  adapter, images)
    else:
        result = _generate_local(prompt, raw, sampling, list(stop), spec, echo, service_config(engine_kw), adapter,
                                 images)
    if live:
        click.echo()
    if as_json:
        click.echo(json.dumps(result))
    elif not live:
        click.echo(result["text"])


def _generate_skill(ctx, skill, prompt, length, reasoning, max_objects, images, connect, timeout, server_key,
                    client_key, engine_kw, as_json, stream) -> None:
    """``--skill``: one skill request (PROTOCOL.md §8a), through a server or a worker of its own."""
    if skill != "caption":
        prompt = _read_prompt(prompt)
    request = {"caption": {"length": length}, "query": {"question": prompt, "reasoning": reasoning or None},
               "point": {"object": prompt, "max_objects": max_objects},
               "detect": {"object": prompt, "max_objects": max_objects}}[skill]
    sampling = {k: ctx.params[k] for k in ("max_tokens", "temperature", "top_p", "seed") if given(ctx, k)}
    live = stream and not as_json
    echo = (lambda text: click.echo(text, nl=False)) if live else (lambda text: None)
    data = [Path(p).read_bytes() for p in images]
    if connect:
        from frontend.client import Client, TandemError
        with Client(connect, curve=serve_options.client_curve(server_key, client_key)) as client:
            _server_info(client, connect, timeout)
            try:
                r = client.generate(skill=skill, **request, images=data or None, **sampling)
            except TandemError as e:
                raise click.ClickException(f"{e.code}: {e}") from None
        done = {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason, "usage": r.usage,
                **({"output": r.output} if r.output is not None else {}),
                **({"reasoning": r.reasoning} if r.reasoning is not None else {})}
    else:
        done = _one_request(service_config(engine_kw), echo, lambda service, on_event: service.submit_skill(
            dict(request, skill=skill), data, **sampling, on_event=on_event))
    result = _result_json(done["text"], done["token_ids"], done["finish_reason"], done["usage"], done.get("output"))
    if "reasoning" in done:
        result["reasoning"] = done["reasoning"]
    if live:
        click.echo()
    if as_json:
        click.echo(json.dumps(result))
    elif not live:
        click.echo(json.dumps(result["output"]) if "output" in result else result["text"])


def _read_prompt(prompt: str | None) -> str:
    """PROMPT, or stdin for '-' or when stdin is piped; one trailing newline (echo's) is dropped."""
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise click.UsageError("missing PROMPT (give it as an argument, or '-' or a pipe to read stdin)")
        prompt = sys.stdin.read()
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    return prompt


def _result_json(text, token_ids, finish_reason, usage, output) -> dict:
    out = {"text": text, "token_ids": list(token_ids), "finish_reason": finish_reason, "usage": usage}
    if output is not None:
        out["output"] = output
    return out


def _server_info(client, endpoint: str, timeout: float) -> dict:
    """The server's info, or a one-line error if nothing answered within ``timeout``."""
    from frontend.client import RequestTimeout

    try:
        return client.info(timeout=timeout)
    except RequestTimeout:
        raise click.ClickException(f"no server answered at {endpoint} within {timeout:g} s "
                                   "(is `tandem serve` running there?)") from None


def _generate_remote(prompt, raw, sampling, stop, spec, echo, endpoint, timeout, model, curve,
                     adapter=None, images=()) -> dict:
    from frontend.client import Client, TandemError

    kw = dict(sampling, stop=stop or None, grammar=spec, adapter=adapter, images=list(images) or None)
    kw["stop_token_ids"] = kw["stop_token_ids"] or None
    if raw:
        kw["prompt"] = prompt
    else:
        kw["messages"] = [{"role": "user", "content": prompt}]
    with Client(endpoint, curve=curve) as client:
        served = _server_info(client, endpoint, timeout).get("model")
        if model is not None and model != served:
            raise click.UsageError(f"the server at {endpoint} serves {served!r}, not {model!r} "
                                   "(--model picks a local worker's model)")
        try:
            stream = client.stream(**kw)
            for chunk in stream:
                echo(chunk.text)
        except TandemError as e:
            raise click.ClickException(f"{e.code}: {e}") from None
        r = stream.result
    return _result_json(r.text, r.token_ids, r.finish_reason, r.usage, r.output)


def _one_request(config, echo, submit) -> dict:
    """One request through a ``Service`` of its own (worker process and the frontend's commit):
    ``submit(service, on_event)`` sends it; chunks are echoed; returns the ``done`` payload."""
    from frontend.service import Service

    service = Service(config, on_progress=_show_worker_progress if sys.stderr.isatty() else None)
    ended: dict = {}

    def on_event(req, kind, payload):
        if kind == "chunk":
            echo(payload["text"])
        else:
            ended[kind] = payload

    try:
        try:
            submit(service, on_event)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        while not ended:
            service.poll(0.1)
    finally:
        service.close()
    if "error" in ended:
        raise click.ClickException(ended["error"]["message"])
    return ended["done"]


def _generate_local(prompt, raw, sampling, stop, spec, echo, config, adapter=None, images=()) -> dict:
    """One request through a ``Service`` of its own."""
    from frontend.images import image_prompt_ids
    from frontend.server import grammar_compiler
    from frontend.tokenization import chat_prompt_ids, image_chat_prompt_ids, text_prompt_ids
    from shared.sampling import SamplingParams

    def submit(service, on_event):
        tok = service.tokenizer
        messages = [{"role": "user", "content": prompt}]
        constraint = grammar_compiler(service).compile(spec).matcher() if spec is not None else None
        kw = dict(stop=stop, constraint=constraint, on_event=on_event, adapter=adapter)
        if images:
            if raw:
                def render(prepared):
                    return image_prompt_ids(tok, prompt, prepared, service.image_params)
            else:
                def render(prepared):
                    return image_chat_prompt_ids(tok, messages, prepared, service.image_params)
            data = [Path(p).read_bytes() for p in images]
            service.submit_images(data, render, SamplingParams(**sampling), **kw)
        else:
            ids = text_prompt_ids(tok, prompt) if raw else chat_prompt_ids(tok, messages)
            service.submit(ids, SamplingParams(**sampling), **kw)

    done = _one_request(config, echo, submit)
    return _result_json(done["text"], done["token_ids"], done["finish_reason"], done["usage"], done.get("output"))


def _bench_models() -> dict[str, str]:
    """The benchmark's random-weight models (built in memory by `tandem bench decode`), with a description."""
    from bench.decode import RANDOM_MODELS

    return {name: f"random weights, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                  f"vocab {c['vocab_size']}, built in memory"
            for name, c in RANDOM_MODELS.items()}


@main.command(help=f"""List the models and whether they are prepared.

Built-in models are converted once into the cache (tandem pull NAME); bench-only
models are random weights that `tandem bench decode --model NAME` builds in memory.
{CACHE_HELP}

\b
Example:
  tandem models
""")
@log_level_option()
def models() -> None:
    from shared.models import cache_root, list_models

    for m in list_models():
        state = "ready" if m["cached"] else "not prepared (tandem pull NAME)"
        click.echo(f"{m['name']:14s} {state:34s} {m['description']}")
    for name, description in _bench_models().items():
        click.echo(f"{name:14s} {'bench-only (tandem bench decode)':34s} {description}")
    click.echo(f"cache: {cache_root()}")


@main.command(help=f"""Prepare a built-in model (convert once into the cache, with progress).

{CACHE_HELP}

\b
Example:
  tandem pull smollm2-135m
""")
@click.argument("name", default="smollm2-135m")
@log_level_option()
def pull(name: str) -> None:
    from shared.models import BUILTIN, resolve_model

    if name in _bench_models():
        raise click.ClickException(f"{name} is bench-only: `tandem bench decode --model {name}` builds its random "
                                   "weights in memory; there is nothing to pull")
    if name not in BUILTIN:
        raise click.ClickException(f"unknown model {name!r}; built-in: {', '.join(BUILTIN)}")
    click.echo(f"{name}: ready at {resolve_model(name)}")


def check_endpoint_free(endpoint: str) -> None:
    """Fail now, not after the model has loaded, if a tcp endpoint's port is taken.

    A check, not a reservation (the server binds later); it binds a plain socket
    with SO_REUSEADDR, as ZeroMQ does, so a port in TIME_WAIT is not "taken".
    Endpoints it cannot interpret (interface names, ipc://) are left to ZeroMQ."""
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return  # an ephemeral port ('*' or 0): always free
    host = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(None if host == "*" else host, int(port),
                                                             type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError):
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            why = "the port is already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise click.ClickException(f"cannot listen on {endpoint}: {why}") from None


@main.command()
@engine_options
@click.option("--bind", default="tcp://127.0.0.1:5557", show_default=True, callback=normalize_endpoint,
              help="ZeroMQ endpoint to listen on (tcp://HOST:PORT, HOST:PORT or ipc://PATH).")
@click.option("--max-queue", default=1024, show_default=True, help="Requests in flight before 'overloaded'.")
@click.option("--drain-timeout", default=20.0, show_default=True,
              help="On SIGTERM/SIGINT: seconds in-flight requests may still finish (new ones get 'overloaded'); "
                   "a second signal stops at once.")
@click.option("--exit-on-worker-failure", is_flag=True,
              help="Exit (non-zero) when the GPU worker dies instead of restarting it (for systemd).")
@click.option("--image-slots", type=int, default=None,
              help="Vision models: shared-memory slots (one tile each) for images on their way to the worker "
                   "(default: room for one request of 8 of the largest images).")
@click.option("--encoder-cache-mb", default=256.0, show_default=True,
              help="Vision models: device memory for image features kept for reuse.")
@click.option("--image-workers", type=click.IntRange(min=1), default=None,
              help="Vision models: processes (at nice 19) that decode and tile images (default: the cores "
                   "less two, 1 to 4).")
@serve_options.network_options
@log_level_option()
def serve(bind, max_queue, drain_timeout, exit_on_worker_failure, image_slots, encoder_cache_mb, image_workers, http,
          api_key, curve_secret_key, curve_clients, insecure, **engine_kw):
    """Serve PROTOCOL.md over ZeroMQ: a frontend process plus one GPU worker.

    \b
    Examples:
      tandem serve                                  # smollm2-135m on tcp://127.0.0.1:5557
      tandem serve --model tiny-random --device cpu --bind ipc:///tmp/tandem.sock
      tandem serve --device cuda --max-batch 128 --kv-memory-fraction 0.8
      tandem serve --dtype float32 --bind 0.0.0.0:5557 --insecure     # a trusted network only
      TANDEM_API_KEY=... tandem serve --http 0.0.0.0:8000 --curve-secret-key s.key_secret --curve-clients keys/
      tandem serve --lora pirate=./pirate-lora --lora legal=./legal-lora --max-loras 2
      tandem serve --model ./SmolVLM-256M-Instruct    # a vision-language model directory
    """
    net = serve_options.resolve(bind, http, api_key, curve_secret_key, curve_clients, insecure)
    from frontend.server import Server, install_signal_handlers
    from frontend.service import Service

    check_endpoint_free(bind)  # before the model load, which can take minutes
    net.listen()
    cfg = service_config(engine_kw, restart=not exit_on_worker_failure, image_slots=image_slots,
                         encoder_cache_mb=encoder_cache_mb, image_workers=image_workers)
    click.echo(f"tandem: starting {cfg.model} on {cfg.device} (worker warm-up) ...", err=True)
    service = Service(cfg, on_progress=_show_worker_progress)
    server = Server(service, bind, max_queue=max_queue, drain_timeout_s=drain_timeout, curve=net.curve)
    listener = net.start_http(server)
    install_signal_handlers(server)
    click.echo(f"tandem: serving {cfg.model} on {server.endpoint}{' and ' + listener.url if listener else ''} "
               f"(device {service.info.get('device')}, pipeline {'on' if cfg.pipeline else 'off'}, "
               f"worker pid {service.worker_pid})", err=True)
    try:
        server.serve_forever()
    finally:
        if listener is not None:
            listener.stop()
    click.echo("tandem: stopped", err=True)


def _show_worker_progress(msg) -> None:
    """Worker start-up stages on stderr; in a terminal a counted stage updates one line."""
    line = f"tandem: worker: {msg.stage}" + (f" {msg.done}/{msg.total}" if msg.total else "")
    if sys.stderr.isatty() and msg.total:
        click.echo("\r" + line, err=True, nl=msg.done == msg.total)
    elif not msg.total or msg.done in (1, msg.total):
        click.echo(line, err=True)


@main.command()
@connect_option("tcp://127.0.0.1:5557", "The server (tcp://HOST:PORT, HOST:PORT or ipc://PATH).")
@timeout_option(10.0)
@serve_options.client_key_options
@log_level_option()
def info(connect, timeout, server_key, client_key):
    """Ask a running server what it serves.

    \b
    Example:
      tandem info --connect 127.0.0.1:5557
    """
    from frontend.client import Client

    with Client(connect, curve=serve_options.client_curve(server_key, client_key)) as client:
        click.echo(json.dumps(_server_info(client, connect, timeout), indent=2))


main.add_command(serve_options.keygen_command())


class _LazyGroup(click.Group):
    """Subcommands imported on use, so `tandem --help` stays fast."""

    lazy = {"decode": ("bench.decode", "decode_command"), "serve": ("bench.serve", "serve_command")}

    def list_commands(self, ctx):
        return sorted(self.lazy)

    def get_command(self, ctx, name):
        if name not in self.lazy:
            return None
        import importlib

        module, attr = self.lazy[name]
        return getattr(importlib.import_module(module), attr)


@main.group(cls=_LazyGroup)
@log_level_option()
def bench():
    """Benchmarks (see BENCHMARKS.md).

    \b
    Examples:
      tandem bench decode --model tiny-random --device sim:2.6 --streams 1,32
      tandem bench serve --connect tcp://127.0.0.1:5557 --concurrency 1,8,32
    """


if __name__ == "__main__":
    main()

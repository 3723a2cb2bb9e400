"""The ``tandem`` command line.

Every command prints one readable line on error (``Error: <message>``, no
traceback; ``TANDEM_DEBUG=1`` shows it) and exits 130 on Ctrl-C; ``--help`` on
each command shows examples.

``tandem generate`` runs its request through the same ``Service`` that
``tandem serve`` uses (a worker process, the frontend's delivery: detokenization,
stop strings, grammar masks), or through a running server with ``--connect``:
one delivery path, whichever way the answer is produced.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import socket
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from frontend import logs
from frontend.cli import serve_options
from frontend.cli.options import (ENGINE_OPTIONS, GroupedCommand, config_file_option, engine_options,
                                  normalize_endpoint, option, sampling_options, server_options)
from frontend.client import DEFAULT_ENDPOINT
from frontend.protocol.wire import DEFAULT_MAX_OBJECTS
from shared.models.registry import DEFAULT_MODEL, REGISTRY, builtin
from shared.sampling import SAMPLING_FIELD_NAMES
from frontend.cluster import MAX_OVERLOAD, NOT_READY_GRACE_S, ROUTERS, SERVE_ONLY

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories; never reach for a hub

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
LOG_LEVELS = ["debug", "info", "warning", "error"]
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
    logs.configure(level=value)


def _set_log_format(ctx, param, value):
    logs.configure(fmt=value)


def log_level_option(default: str | None = None):
    """``--log-level`` on the group (``tandem --log-level info serve``) and on each command
    (``tandem serve --log-level info``); the command's wins."""
    return option("Other", "--log-level", type=click.Choice(LOG_LEVELS), default=default,
                  show_default=default is not None, expose_value=False, is_eager=True, callback=_set_log_level,
                  help="Logging on stderr (also the GPU worker's).")


def log_format_option():
    return option("Other", "--log-format", type=click.Choice(logs.FORMATS), default="text", show_default=True,
                  expose_value=False, is_eager=True, callback=_set_log_format,
                  help="Logging on stderr as text, or one JSON object per line for every record (and for the "
                       "command's status lines); with --log-level info, one line per finished request.")


def connect_option(default: str | None, help: str):
    return option("Connection", "--connect", default=default, show_default=default is not None,
                  callback=normalize_endpoint, help=help)


def timeout_option(default: float):
    return option("Connection", "--timeout", default=default, show_default=True,
                  type=click.FloatRange(min=0, min_open=True),
                  help="Seconds to wait for the server's first answer before giving up.")


def service_config(engine_kw: dict, **extra):
    """The ServiceConfig (engine fields + the frontend's) for the engine options of a command."""
    from frontend.server.service import ServiceConfig

    from shared.lora_config import parse_lora_option

    kw = dict(engine_kw)
    dtype = kw.pop("dtype")
    kw["loras"] = parse_lora_option(kw.pop("lora"))
    kw["quantization_group"] = int(kw["quantization_group"])
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


@main.command(cls=GroupedCommand)
@click.argument("prompt", required=False)
@option("Request", "--raw", is_flag=True, help="Send PROMPT as plain text, without the chat template.")
@option("Request", "--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
        help="An image file for a vision-language model (repeatable). Placed before the prompt's text, or "
             "at each <image> of a --raw prompt.")
@option("Request", "--adapter", default=None, help="Answer with this LoRA adapter (one the worker or server has).")
@option("Request", "--skill", type=click.Choice(["caption", "query", "point", "detect"]), default=None,
        help="A Moondream model's skill on the --image: PROMPT is the question (query) or the object "
             "(point, detect); caption takes none.")
@option("Request", "--length", type=click.Choice(["short", "normal", "long"]), default="normal", show_default=True,
        help="With --skill caption.")
@option("Request", "--reasoning", is_flag=True, help="With --skill query: reason first.")
@sampling_options
@option("Sampling", "--stop", multiple=True, help="Stop string (repeatable); never part of the output.")
@option("Output", "--grammar", type=click.Choice(["point", "box"]), default=None,
        help="Constrain the answer to points or boxes (normalised coordinates).")
@option("Output", "--max-objects", type=int, help=f"The most points or boxes: with --grammar (default {DEFAULT_MAX_OBJECTS}), or "
        "--skill point/detect (default: the model's own).")
@option("Output", "--regex", default=None, help="Constrain the answer to a regular expression.")
@option("Output", "--json-schema", "json_schema", type=click.File("r"), default=None,
        help="Constrain the answer to a JSON schema (file).")
@option("Output", "--stream/--no-stream", default=True, show_default=True, help="Print text as it arrives.")
@option("Output", "--json", "as_json", is_flag=True,
        help='Print {"text", "token_ids", "finish_reason", "usage"} (and "output" for --grammar/--regex/'
             '--json-schema).')
@engine_options
@connect_option(None, "Use a running server (e.g. tcp://127.0.0.1:5557 or 127.0.0.1:5557) instead of "
                      "starting a GPU worker. The engine options (--model aside) belong to that server.")
@timeout_option(30.0)
@serve_options.client_key_options
@log_level_option()
@click.pass_context
def generate(ctx, prompt, connect, timeout, raw, stop, grammar, max_objects, regex, json_schema, images, adapter, skill,
             length, reasoning, stream, as_json, server_key, client_key, **kw):
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
    # Only the sampling options given are sent: the others take the model's defaults (generation_config.json),
    # else the protocol's.
    sampling = {name: value for name in SAMPLING_FIELD_NAMES if (value := kw.pop(name)) is not None and given(ctx, name)}
    engine_kw = kw
    if skill is not None:  # the model renders its own prompt; the sampling fields set override its defaults
        fields = _skill_fields(skill, prompt, length, reasoning, max_objects, images,
                               {k: sampling[k] for k in ("max_tokens", "temperature", "top_p", "seed") if k in sampling})
    else:
        prompt = _read_prompt(prompt)
        kinds = [g for g in (grammar, regex, json_schema) if g is not None]
        if len(kinds) > 1:
            raise click.UsageError("use at most one of --grammar, --regex, --json-schema")
        spec = None
        if grammar:
            spec = {"kind": grammar, "max_objects": max_objects or DEFAULT_MAX_OBJECTS}
        elif regex is not None:
            spec = {"kind": "regex", "pattern": regex}
        elif json_schema is not None:
            spec = {"kind": "json_schema", "schema": json.load(json_schema)}
        fields = _request_fields(prompt, raw, sampling, list(stop), spec, adapter, images)
    live = stream and not as_json
    echo = (lambda text: click.echo(text, nl=False)) if live else (lambda text: None)
    if connect:
        model = engine_kw["model"] if given(ctx, "model") else None
        curve = serve_options.client_curve(server_key, client_key)
        result = _generate_remote(fields, echo, connect, timeout, model, curve)
    else:
        result = _generate_local(fields, echo, service_config(engine_kw))
    if live:
        click.echo()
    if as_json:
        click.echo(json.dumps(result))
    elif not live:
        click.echo(json.dumps(result["output"]) if skill is not None and "output" in result else result["text"])


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


def _result_json(text, token_ids, finish_reason, usage, output, reasoning=None) -> dict:
    out = {"text": text, "token_ids": list(token_ids), "finish_reason": finish_reason, "usage": usage}
    if output is not None:
        out["output"] = output
    if reasoning is not None:
        out["reasoning"] = reasoning
    return out


def _server_info(client, endpoint: str, timeout: float) -> dict:
    """The server's info, or a one-line error if nothing answered within ``timeout``."""
    from frontend.client import RequestTimeout

    try:
        return client.info(timeout=timeout)
    except RequestTimeout:
        raise click.ClickException(f"no server answered at {endpoint} within {timeout:g} s "
                                   "(is `tandem serve` running there?)") from None


def _request_fields(prompt, raw, sampling, stop, spec, adapter, images) -> dict:
    """The generate call of ``tandem generate``, the same with and without --connect."""
    kw = dict(sampling, stop=stop or None, grammar=spec, adapter=adapter, images=list(images) or None)
    kw["stop_token_ids"] = list(kw.get("stop_token_ids") or ()) or None
    if raw:
        kw["prompt"] = prompt
    else:
        kw["messages"] = [{"role": "user", "content": prompt}]
    return kw


def _skill_fields(skill, prompt, length, reasoning, max_objects, images, sampling) -> dict:
    """The generate call of ``tandem generate --skill`` (PROTOCOL.md §8a), the same with and without
    --connect."""
    if skill != "caption":
        prompt = _read_prompt(prompt)
    request = {"caption": {"length": length}, "query": {"question": prompt, "reasoning": reasoning or None},
               "point": {"object": prompt, "max_objects": max_objects},
               "detect": {"object": prompt, "max_objects": max_objects}}[skill]
    return dict(skill=skill, **request, images=list(images) or None, **sampling)


def _generate_remote(kw, echo, endpoint, timeout, model, curve) -> dict:
    from frontend.client import Client, TandemError

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
            raise click.ClickException(f"{e.code}: {e.message}") from None
        r = stream.result
    return _result_json(r.text, r.token_ids, r.finish_reason, r.usage, r.output, r.reasoning)


def _generate_local(kw, echo, config) -> dict:
    """One request through a ``Service`` of its own (worker process and the frontend's delivery), on
    the server's path (``server.Gate``): the same message, checks, rendering and errors as --connect."""
    from frontend.client import generate_message
    from frontend.protocol.parse import ProtocolError
    from frontend.protocol.encode import encode_message
    from frontend.server.zmq_server import Gate
    from frontend.server.service import Service

    service = Service(config, on_progress=_show_worker_progress if sys.stderr.isatty() else None)
    try:
        gate = Gate(service)
        ended: dict = {}

        def on_event(req, kind, payload):
            if kind == "chunk":
                echo(payload["text"])
            else:
                ended[kind] = payload

        try:
            msg = gate.parse(encode_message(generate_message(True, kw.pop("prompt", None), **kw)))
            gate.submit(msg, on_event)
        except ProtocolError as e:
            raise click.ClickException(f"{e.code}: {e.message}") from None
        while not ended:
            service.poll(0.1)
    finally:
        service.close()
    if "error" in ended:
        raise click.ClickException(f"{ended['error']['code']}: {ended['error']['message']}")
    done = ended["done"]
    return _result_json(done["text"], done["token_ids"], done["finish_reason"], done["usage"], done.get("output"),
                        done.get("reasoning"))


@main.command(help=f"""List the built-in models, what each is and whether it is prepared.

Models with files are built or converted once into the cache (tandem pull NAME); the
benchmarks' random models are built in memory (`tandem bench decode --model NAME` for the Llamas).
{CACHE_HELP}

\b
Example:
  tandem models
""")
@log_level_option()
def models() -> None:
    from shared.models.cache import cache_root
    from shared.models.registry import list_models

    for m in list_models():
        state = ("ready" if m["cached"] else "not prepared (tandem pull NAME)") if m["files"] else \
            f"in memory ({m['bench']})"
        also = f" (also: {', '.join(m['aliases'])})" if m["aliases"] else ""
        click.echo(f"{m['name']:26s} {state:38s} {m['description']}{also}")
    click.echo(f"cache: {cache_root()}")


@main.command(help=f"""Prepare a built-in model (convert once into the cache, with progress).

{CACHE_HELP}

\b
Example:
  tandem pull smollm2-135m
""")
@click.argument("name", default=DEFAULT_MODEL)
@log_level_option()
def pull(name: str) -> None:
    from shared.models.registry import resolve_model

    model = builtin(name)
    if model is None:
        raise click.ClickException(f"unknown model {name!r}; built-in: {', '.join(REGISTRY)}")
    if model.build is None:
        raise click.ClickException(f"{name} is built in memory: `{model.bench} --model {name}` builds its "
                                   "random weights; there is nothing to pull")
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


@main.command(cls=GroupedCommand)
@engine_options
@server_options
@serve_options.network_options
@log_level_option()
@log_format_option()
@config_file_option
def serve(bind, max_queue, drain_timeout, exit_on_worker_failure, tile_blocks, encoder_cache_mb, image_workers,
          served_model_name, chat_template, metrics_compat, http, host, port, api_key, curve_secret_key, curve_clients,
          insecure, **engine_kw):
    """Serve PROTOCOL.md over ZeroMQ: a frontend process plus one GPU worker.

    \b
    Examples:
      tandem serve                                  # smollm2-135m on tcp://127.0.0.1:5557
      tandem serve --model tiny-random-smollm2 --device cpu --bind ipc:///tmp/tandem.sock
      tandem serve --device cuda --max-batch 128 --kv-memory-fraction 0.8
      tandem serve --dtype float32 --bind 0.0.0.0:5557 --insecure     # a trusted network only
      TANDEM_API_KEY=... tandem serve --http 0.0.0.0:8000 --curve-secret-key s.key_secret --curve-clients keys/
      tandem serve --lora pirate=./pirate-lora --lora legal=./legal-lora --max-loras 2
      tandem serve --model ./SmolVLM-256M-Instruct    # a vision-language model directory
      tandem serve --config serve.yaml --port 9000    # options from a file (keys: long option names)
      tandem serve --model ./my-llama --served-model-name llama --chat-template chat.jinja --log-format json
    """
    net = serve_options.resolve(bind, http, host, port, api_key, curve_secret_key, curve_clients, insecure)
    from frontend.server.zmq_server import Server, install_signal_handlers
    from frontend.server.service import Service

    check_endpoint_free(bind)  # before the model load, which can take minutes
    net.listen()
    template = None if chat_template is None else Path(chat_template).read_text()
    cfg = service_config(engine_kw, restart=not exit_on_worker_failure, tile_blocks=tile_blocks,
                         encoder_cache_mb=encoder_cache_mb, image_workers=image_workers,
                         served_model_name=served_model_name, chat_template=template)
    logs.status(f"tandem: starting {cfg.model} on {cfg.device} (worker warm-up) ...")
    service = Service(cfg, on_progress=_show_worker_progress)
    server = Server(service, bind, max_queue=max_queue, drain_timeout_s=drain_timeout, curve=net.curve,
                    metrics_compat=metrics_compat)
    listener = net.start_http(server)
    install_signal_handlers(server)
    logs.status(f"tandem: serving {cfg.model}{f' as {served_model_name}' if served_model_name else ''} on "
                f"{server.endpoint}{' and ' + listener.url if listener else ''} (device {service.info.get('device')}, "
                f"pipeline {'on' if cfg.pipeline else 'off'}, context {service.info['max_model_len']} tokens: "
                f"{service.info['max_model_len_reason']}, worker pid {service.worker_pid})")
    try:
        server.serve_forever()
    finally:
        if listener is not None:
            listener.stop()
    logs.status("tandem: stopped")


def _show_worker_progress(msg) -> None:
    """Worker start-up stages on stderr; in a terminal a counted stage updates one line."""
    line = f"tandem: worker: {msg.stage}" + (f" {msg.done}/{msg.total}" if msg.total else "")
    if sys.stderr.isatty() and msg.total:
        logs.status("\r" + line, end="\n" if msg.done == msg.total else "")
    elif not msg.total or msg.done in (1, msg.total):
        logs.status(line)


@main.command()
@connect_option(DEFAULT_ENDPOINT, "The server (tcp://HOST:PORT, HOST:PORT or ipc://PATH).")
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


@main.command()
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(min=1),
              help="Replicas: whole `tandem serve`s, one GPU each on CUDA.")
@click.option("--address", default=None,
              help="A running Ray cluster (HOST:PORT of its head, or auto); default: a local Ray instance, "
                   "stopped on exit.")
@click.option("--not-ready-grace", default=NOT_READY_GRACE_S, show_default=True, type=click.FloatRange(min=0),
              help="Seconds a replica's worker may stay not ready (restarting) before Serve replaces the replica.")
@click.option("--router", type=click.Choice(ROUTERS), default="affinity", show_default=True,
              help="Affinity (sessions, shared prompt prefixes) within a load bound, or Serve's default (power of "
                   "two choices; for A/B runs).")
@click.option("--max-overload", default=MAX_OVERLOAD, show_default=True, type=click.FloatRange(min=0),
              help="The affinity router's bound: a replica takes a request its affinity sends it only while it "
                   "holds at most (1 + this) x the average load; above, the next replica in the request's order.")
@click.pass_context
def cluster(ctx, replicas, address, not_ready_grace, router, max_overload, http, host, port, api_key, insecure,
            **serve_kw):
    """Serve one HTTP address from N replicas of `tandem serve` on Ray Serve (the tandem[cluster] extra).

    Every option of `tandem serve` but --bind and CURVE is passed on to each replica's `tandem serve`;
    requests of a session (X-Session-Id, else OpenAI's user) stay on one replica, and so do prompts that
    mostly repeat one sent before, while that replica's load is within --max-overload of the average.

    \b
    Examples:
      tandem cluster --replicas 2 --model tiny-random --device cpu
      TANDEM_API_KEY=... tandem cluster --address auto --replicas 8 --device cuda --http 0.0.0.0:8000
    """
    http_addr = serve_options.resolve_http(http, host, port, api_key, insecure)
    if http_addr is None:
        raise click.UsageError("tandem cluster serves HTTP: --http none is not possible")
    if importlib.util.find_spec("ray") is None:
        raise click.ClickException("tandem cluster needs Ray Serve: pip install 'tandem[cluster]'")
    from frontend.cluster.run import run

    run(replicas, address, http_addr, {"api_key": api_key, "not_ready_grace_s": not_ready_grace, "router": router,
                                       "max_overload": max_overload,
                                       **{k: v for k, v in serve_kw.items() if given(ctx, k)}})


cluster.params += [p for p in serve.params if p.name not in SERVE_ONLY]  # serve's own definitions


class _LazyGroup(click.Group):
    """Subcommands imported on use, so `tandem --help` stays fast. The benchmarks are not part of the
    installed package: they are imported from the source checkout this ``frontend`` runs from (an
    editable install, as ./install.sh makes), first on the path so no other ``bench`` shadows them."""

    lazy = {"decode": ("bench.decode", "decode_command"), "serve": ("bench.serve", "serve_command"),
            "cluster": ("bench.cluster", "cluster_command")}

    def list_commands(self, ctx):
        return sorted(self.lazy)

    def get_command(self, ctx, name):
        if name not in self.lazy:
            return None
        import importlib

        checkout = str(Path(__file__).resolve().parents[2])
        if not Path(checkout, "bench", "__init__.py").is_file():
            raise click.ClickException("the benchmarks ship with Tandem's source repository, not with the package: "
                                       "run `tandem bench` from an editable install of a checkout (./install.sh)")
        if checkout not in sys.path:
            sys.path.insert(0, checkout)
        module, attr = self.lazy[name]
        return getattr(importlib.import_module(module), attr)


@main.group(cls=_LazyGroup)
@log_level_option()
def bench():
    """Benchmarks (see BENCHMARKS.md).

    \b
    Examples:
      tandem bench decode --model tiny-random-llama-vocab4k --device sim:2.6 --streams 1,32
      tandem bench serve --connect tcp://127.0.0.1:5557 --concurrency 1,8,32
    """


if __name__ == "__main__":
    main()

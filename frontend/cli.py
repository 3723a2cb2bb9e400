"""The ``tandem`` command line.

Every command prints one readable line on error (no traceback); ``--help`` on
each command shows examples.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import click

from frontend import serve_options

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories; never reach for a hub


class _Main(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # one line, not a traceback
            if os.environ.get("TANDEM_DEBUG"):
                raise
            raise click.ClickException(f"{type(e).__name__}: {e}") from e


@click.group(cls=_Main)
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """Tandem: an inference server whose GPU never waits for the CPU."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def engine_options(fn):
    """Options shared by every command that builds an in-process engine."""
    opts = [
        click.option("--model", default="smollm2-135m", show_default=True,
                     help="smollm2-135m | tiny-random | path to a Hugging Face directory"),
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | sim:MS"),
        click.option("--no-pipeline", is_flag=True, help="Blocking decode (the baseline)."),
        click.option("--max-batch", default=64, show_default=True, help="Batch rows (concurrent sequences)."),
        click.option("--max-model-len", default=2048, show_default=True, help="Context length cap."),
        click.option("--kv-pages", type=int, default=None, help="KV cache pages (default: sized to memory)."),
        click.option("--kv-memory-fraction", default=0.5, show_default=True,
                     help="Fraction of free GPU memory for the KV cache (CUDA, without --kv-pages)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def build_engine_config(model, device, no_pipeline, max_batch, max_model_len, kv_pages, kv_memory_fraction, **extra):
    from shared.config import EngineConfig

    return EngineConfig(model=model, device=device, pipeline=not no_pipeline, max_batch=max_batch,
                        max_model_len=max_model_len, kv_pages=kv_pages, kv_memory_fraction=kv_memory_fraction,
                        **extra)


@main.command()
@click.argument("prompt", required=False)
@engine_options
@click.option("--connect", default=None, help="Use a running server (e.g. tcp://127.0.0.1:5557) instead of "
              "an in-process engine.")
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
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print text as it arrives.")
@click.option("--json", "as_json", is_flag=True, help='Print {"text", "token_ids", "finish_reason", "usage"}.')
@serve_options.client_key_options
def generate(prompt, connect, raw, max_tokens, temperature, top_p, top_k, seed, stop, stop_token_id, ignore_eos,
             grammar, max_objects, regex, json_schema, stream, as_json, server_key, client_key, **engine_kw):
    """Generate a completion (in-process, or from a server with --connect).

    \b
    Examples:
      tandem generate "What is the capital of France?"
      tandem generate "Write a haiku" --temperature 0.8 --seed 1 --json
      echo "Once upon a time" | tandem generate - --raw --max-tokens 40
      tandem generate "Point at the cat" --grammar point --max-objects 3
      tandem generate "Hi" --connect tcp://127.0.0.1:5557 --stream
    """
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read() if prompt == "-" or not sys.stdin.isatty() else "What is the capital of France?"
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
    run = _generate_remote if connect else _generate_local
    connect = connect and (connect, serve_options.client_curve(server_key, client_key))
    result = run(prompt, raw, sampling, list(stop), spec, echo, connect=connect, engine_kw=engine_kw)
    if live:
        click.echo()
    if as_json:
        click.echo(json.dumps(result))
    elif not live:
        click.echo(result["text"])
    if "output" in result and not as_json:
        click.echo(json.dumps(result["output"]), err=True)


def _generate_remote(prompt, raw, sampling, stop, spec, echo, connect, engine_kw) -> dict:
    from frontend.client import Client

    kw = dict(sampling, stop=stop or None, grammar=spec)
    kw["stop_token_ids"] = kw["stop_token_ids"] or None
    if raw:
        kw["prompt"] = prompt
    else:
        kw["messages"] = [{"role": "user", "content": prompt}]
    endpoint, curve = connect
    with Client(endpoint, curve=curve) as client:
        stream = client.stream(**kw)
        for chunk in stream:
            echo(chunk.text)
        r = stream.result
    out = {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason, "usage": r.usage}
    if r.output is not None:
        out["output"] = r.output
    return out


def _generate_local(prompt, raw, sampling, stop, spec, echo, connect, engine_kw) -> dict:
    import numpy as np

    from frontend.detokenizer import IncrementalDetokenizer
    from frontend.grammars import GrammarCompiler
    from frontend.tokenization import chat_prompt_ids, text_prompt_ids
    from gpu_worker.engine import Engine
    from shared.models import load_tokenizer
    from shared.sampling import SamplingParams

    params = SamplingParams(**sampling)
    tokenizer = load_tokenizer(engine_kw["model"])
    ids = text_prompt_ids(tokenizer, prompt) if raw else chat_prompt_ids(tokenizer, [{"role": "user",
                                                                                      "content": prompt}])
    config = build_engine_config(**engine_kw)
    matcher = None
    provider = None
    if spec is not None:
        from shared.models import resolve_model

        model_cfg = json.loads((resolve_model(config.model) / "config.json").read_text())
        eos = model_cfg.get("eos_token_id")
        compiler = GrammarCompiler(tokenizer, model_cfg["vocab_size"], tuple(eos if isinstance(eos, list) else [eos]))
        matcher = compiler.compile(spec).matcher()

        def provider(seqs, step):  # called after the previous token's commit: never stale
            words = np.empty((len(seqs), (model_cfg["vocab_size"] + 31) // 32), dtype=np.int32)
            matcher.fill_mask(words[0])
            return words, None

    engine = Engine(config, mask_provider=provider)
    detok = IncrementalDetokenizer(tokenizer, stop=stop)

    def on_token(seq, token):
        if matcher is not None:
            matcher.accept(token)
        echo(detok.add(token))
        if detok.stopped:
            engine.cancel(seq, "stop")  # a stop string ends the request at once

    try:
        seq = engine.submit(ids, params, on_token=on_token, constrained=matcher is not None)
        engine.run_until_idle()
    finally:
        engine.close()
    if seq.error:
        raise click.ClickException(seq.error)
    echo(detok.finish())
    out = {"text": detok.text, "token_ids": seq.output_ids, "finish_reason": seq.finish_reason,
           "usage": {"prompt_tokens": len(ids), "completion_tokens": len(seq.output_ids)}}
    if matcher is not None and seq.finish_reason == "stop":
        out["output"] = matcher.output(detok.text)
    return out


@main.command()
def models() -> None:
    """List the built-in models and whether they are prepared.

    \b
    Example:
      tandem models
    """
    from shared.models import list_models

    for m in list_models():
        state = "ready" if m["cached"] else "not prepared (tandem pull NAME)"
        click.echo(f"{m['name']:14s} {state:34s} {m['description']}")


@main.command()
@click.argument("name", default="smollm2-135m")
def pull(name: str) -> None:
    """Prepare a built-in model (convert once into the cache, with progress).

    \b
    Example:
      tandem pull smollm2-135m
    """
    from shared.models import BUILTIN, resolve_model

    if name not in BUILTIN:
        raise click.ClickException(f"unknown model {name!r}; built-in: {', '.join(BUILTIN)}")
    click.echo(f"{name}: ready at {resolve_model(name)}")


@main.command()
@engine_options
@click.option("--bind", default="tcp://127.0.0.1:5557", show_default=True, help="ZeroMQ endpoint to listen on.")
@click.option("--max-queue", default=1024, show_default=True, help="Requests in flight before 'overloaded'.")
@click.option("--drain-timeout", default=20.0, show_default=True,
              help="On SIGTERM/SIGINT: seconds in-flight requests may still finish (new ones get 'overloaded'); "
                   "a second signal stops at once.")
@click.option("--exit-on-worker-failure", is_flag=True,
              help="Exit (non-zero) when the GPU worker dies instead of restarting it (for systemd).")
@serve_options.network_options
def serve(bind, max_queue, drain_timeout, exit_on_worker_failure, http, api_key, curve_secret_key, curve_clients,
          insecure, **engine_kw):
    """Serve PROTOCOL.md over ZeroMQ: a frontend process plus one GPU worker.

    \b
    Examples:
      tandem serve                                  # smollm2-135m on tcp://127.0.0.1:5557
      tandem serve --model tiny-random --device cpu --bind ipc:///tmp/tandem.sock
      tandem serve --device cuda --max-batch 128 --kv-memory-fraction 0.8
      TANDEM_API_KEY=... tandem serve --http 0.0.0.0:8000 --curve-secret-key s.key_secret --curve-clients keys/
    """
    net = serve_options.resolve(bind, http, api_key, curve_secret_key, curve_clients, insecure)
    from frontend.server import Server, install_signal_handlers
    from frontend.service import Service, ServiceConfig

    level = logging.getLogger().level
    cfg = ServiceConfig(model=engine_kw["model"], device=engine_kw["device"], pipeline=not engine_kw["no_pipeline"],
                        max_batch=engine_kw["max_batch"], max_model_len=engine_kw["max_model_len"],
                        kv_pages=engine_kw["kv_pages"], kv_memory_fraction=engine_kw["kv_memory_fraction"],
                        restart=not exit_on_worker_failure, log_level=logging.getLevelName(level))
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
@click.option("--connect", default="tcp://127.0.0.1:5557", show_default=True)
@click.option("--timeout", default=10.0, show_default=True)
@serve_options.client_key_options
def info(connect, timeout, server_key, client_key):
    """Ask a running server what it serves.

    \b
    Example:
      tandem info --connect tcp://127.0.0.1:5557
    """
    from frontend.client import Client

    with Client(connect, timeout=timeout, curve=serve_options.client_curve(server_key, client_key)) as client:
        click.echo(json.dumps(client.info(), indent=2))


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
def bench():
    """Benchmarks (see BENCHMARKS.md).

    \b
    Examples:
      tandem bench decode --model tiny-random --device sim:2.6 --streams 1,32
      tandem bench serve --connect tcp://127.0.0.1:5557 --concurrency 1,8,32
    """


if __name__ == "__main__":
    main()

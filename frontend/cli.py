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
    from gpu_worker.engine import EngineConfig

    return EngineConfig(model=model, device=device, pipeline=not no_pipeline, max_batch=max_batch,
                        max_model_len=max_model_len, kv_pages=kv_pages, kv_memory_fraction=kv_memory_fraction,
                        **extra)


@main.command()
@click.argument("prompt", required=False)
@engine_options
@click.option("--raw", is_flag=True, help="Send PROMPT as plain text, without the chat template.")
@click.option("--max-tokens", default=256, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable); never part of the output.")
@click.option("--stop-token-id", multiple=True, type=int, help="Stop token id (repeatable).")
@click.option("--ignore-eos", is_flag=True)
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print text as it arrives.")
@click.option("--json", "as_json", is_flag=True, help='Print {"text", "token_ids", "finish_reason", "usage"}.')
def generate(prompt, raw, max_tokens, temperature, top_p, top_k, seed, stop, stop_token_id, ignore_eos, stream,
             as_json, **engine_kw):
    """Generate a completion in-process.

    \b
    Examples:
      tandem generate "What is the capital of France?"
      tandem generate "Write a haiku" --temperature 0.8 --seed 1 --json
      echo "Once upon a time" | tandem generate - --raw --max-tokens 40
    """
    from frontend.detokenizer import IncrementalDetokenizer
    from frontend.tokenization import chat_prompt_ids, text_prompt_ids
    from gpu_worker.engine import Engine
    from shared.models import load_tokenizer
    from shared.sampling import SamplingParams

    if prompt is None or prompt == "-":
        prompt = sys.stdin.read() if prompt == "-" or not sys.stdin.isatty() else "What is the capital of France?"
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop_token_ids=stop_token_id, ignore_eos=ignore_eos)
    tokenizer = load_tokenizer(engine_kw["model"])
    ids = text_prompt_ids(tokenizer, prompt) if raw else chat_prompt_ids(tokenizer, [{"role": "user",
                                                                                      "content": prompt}])
    engine = Engine(build_engine_config(**engine_kw))
    detok = IncrementalDetokenizer(tokenizer, stop=list(stop))
    live = stream and not as_json

    def on_token(seq, token):
        text = detok.add(token)
        if live and text:
            click.echo(text, nl=False)
        if detok.stopped:
            engine.cancel(seq, "stop")  # a stop string ends the request at once

    try:
        seq = engine.submit(ids, params, on_token=on_token)
        engine.run_until_idle()
    finally:
        engine.close()
    if seq.error:
        raise click.ClickException(seq.error)
    tail = detok.finish()
    if live:
        click.echo(tail)
    text = detok.text
    if as_json:
        click.echo(json.dumps({"text": text, "token_ids": seq.output_ids, "finish_reason": seq.finish_reason,
                               "usage": {"prompt_tokens": len(ids), "completion_tokens": len(seq.output_ids)}}))
    elif not live:
        click.echo(text)


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


if __name__ == "__main__":
    main()

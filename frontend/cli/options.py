"""The command line's option definitions, each written once, and help grouped in sections.

- Defaults and help of the engine options are :class:`shared.config.EngineConfig`'s,
  of the sampling options :class:`shared.sampling.SamplingParams`'s; the list of
  built-in models under ``--model`` is the registry's (``shared.models.registry``).
- :func:`option` is ``click.option`` with a help section (``group``);
  :class:`GroupedCommand` prints the options section by section, in
  :data:`GROUPS` order.
- Commands combine the decorators: ``tandem generate`` takes the engine
  options, ``tandem serve`` the engine and server options, and a new command
  that starts workers takes the same ones.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from frontend.client import DEFAULT_ENDPOINT
from frontend.server.metrics import COMPAT
from shared.config import ATTENTIONS, INT4_GROUPS, QUANTIZATIONS, EngineConfig, config_field
from shared.lora_config import KERNELS
from shared.generation_config import SAMPLING_DEFAULTS
from shared.models.registry import REGISTRY
from shared.sampling import SAMPLING_FIELDS

MODEL_DEFAULTS = frozenset(SAMPLING_DEFAULTS.values())  # the sampling fields a model's generation_config.json sets

DTYPES = ["auto", "float32", "bfloat16", "float16"]
MAX_QUEUE = 1024  # requests in flight before 'overloaded' (the Server's default too)
GROUPS = ("Request", "Sampling", "Output", "Engine", "Server", "Connection", "Other")


class GroupedOption(click.Option):
    """A ``click.Option`` listed under a section of the help (``group``)."""

    def __init__(self, *args, group: str = "Other", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """A command whose --help lists its options in sections (:data:`GROUPS`)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                sections.setdefault(getattr(param, "group", "Other"), []).append(record)
        for name in sorted(sections, key=lambda g: GROUPS.index(g) if g in GROUPS else len(GROUPS)):
            with formatter.section(f"{name} options"):
                formatter.write_dl(sections[name])


def option(group: str, *decls: str, **kw) -> Callable:
    return click.option(*decls, cls=GroupedOption, group=group, **kw)


def apply(fn: Callable, opts: list[Callable]) -> Callable:
    """Decorate ``fn`` with ``opts``, the first listed first in the help."""
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def engine_option(flag: str, name: str, group: str = "Engine", config: type = EngineConfig, **kw) -> Callable:
    """An option whose default and help are the config field ``name``'s (EngineConfig by default)."""
    f = config_field(name, config)
    kw.setdefault("default", f.default)
    kw.setdefault("show_default", kw["default"] is not None)
    return option(group, flag, help=f.metadata["help"], **kw)


MODEL_HELP = (f"{config_field('model').metadata['help']} Built in: {', '.join(REGISTRY)} "
              "(`tandem models` says what each is).")


def engine_options(fn: Callable) -> Callable:
    """Options shared by every command that starts a GPU worker."""
    no = {"no_pipeline": "pipeline", "no_prefix_cache": "prefix_cache"}  # flags that turn a field off
    return apply(fn, [
        option("Engine", "--model", default=config_field("model").default, show_default=True, help=MODEL_HELP),
        engine_option("--device", "device"),
        engine_option("--dtype", "dtype", type=click.Choice(DTYPES), default="auto"),
        engine_option("--quantization", "quantization", type=click.Choice(QUANTIZATIONS)),
        engine_option("--quantization-group", "quantization_group", type=click.Choice([str(g) for g in INT4_GROUPS]),
                      default=str(config_field("quantization_group").default)),
        engine_option("--generation-config", "generation_config", metavar="auto|vllm|FOLDER"),
        *(option("Engine", "--" + flag.replace("_", "-"), is_flag=True, help=config_field(field).metadata["help"])
          for flag, field in no.items()),
        engine_option("--max-batch", "max_batch"),
        engine_option("--max-model-len", "max_model_len", type=click.IntRange(min=2)),
        engine_option("--prefill-budget", "prefill_budget", type=click.IntRange(min=1)),
        engine_option("--kv-pages", "kv_pages", type=int),
        engine_option("--kv-memory-fraction", "kv_memory_fraction"),
        option("Engine", "--lora", multiple=True, metavar="NAME=DIR", help=config_field("loras").metadata["help"]),
        engine_option("--max-loras", "max_loras", type=click.IntRange(min=1)),
        engine_option("--lora-kernel", "lora_kernel", type=click.Choice(KERNELS)),
        engine_option("--attention", "attention", type=click.Choice(ATTENTIONS)),
    ])


# The options that configure the in-process engine (the worker that `generate` and `serve` start), by
# their parameter names: read from ``engine_options`` itself, so a new engine option is never left out.
# (click.option appends each decorator's parameter to ``__click_params__``, the last applied first.)
ENGINE_OPTIONS = [p.name for p in reversed(engine_options(lambda: None).__click_params__)]


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


def server_options(fn: Callable) -> Callable:
    """What a serving command adds to the engine options: its endpoint, queue, drain, supervision and
    the frontend's image processing."""
    return apply(fn, [
        option("Server", "--bind", default=DEFAULT_ENDPOINT, show_default=True, callback=normalize_endpoint,
               help="ZeroMQ endpoint to listen on (tcp://HOST:PORT, HOST:PORT or ipc://PATH)."),
        option("Server", "--max-queue", default=MAX_QUEUE, show_default=True,
               help="Requests in flight before 'overloaded'."),
        option("Server", "--drain-timeout", default=20.0, show_default=True,
               help="On SIGTERM/SIGINT: seconds in-flight requests may still finish (new ones get 'overloaded'); "
                    "a second signal stops at once."),
        option("Server", "--exit-on-worker-failure", is_flag=True,
               help="Exit (non-zero) when the GPU worker dies instead of restarting it (for systemd)."),
        # --image-slots: the option's earlier name, still accepted (existing command lines)
        option("Engine", "--tile-blocks", "--image-slots", "tile_blocks", type=int, default=None,
               help="Vision models: shared-memory tile blocks (one tile each) for images on their way to the worker "
                    "(default: room for one request of 8 of the largest images)."),
        engine_option("--encoder-cache-mb", "encoder_cache_mb"),
        option("Engine", "--image-workers", type=click.IntRange(min=1), default=None,
               help="Vision models: processes (at nice 19) that decode and tile images (default: the cores "
                    "less two, 1 to 4)."),
        option("Server", "--served-model-name", default=None, metavar="NAME",
               help="The model's name for HTTP clients: what /v1/models lists and what requests' model must be "
                    "(--model's value is still accepted). Default: --model's value."),
        option("Server", "--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
               metavar="FILE", help="A Jinja chat template (file) rendering chat messages in place of the "
                                    "tokenizer's own."),
        option("Server", "--metrics-compat", type=click.Choice(COMPAT), default=None,
               help="Also export /metrics' running, waiting and KV-usage figures under these names (vllm: "
                    "for routers and dashboards made for vLLM)."),
    ])


def _token_map(ctx, param, values: tuple[str, ...]) -> dict[int, float]:
    """``("50256=-100", ...)`` -> ``{50256: -100.0}``."""
    out = {}
    for v in values:
        token, _, bias = v.partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise click.BadParameter(f"{v!r} is not TOKEN=BIAS (an integer = a number)", param=param) from None
    return out


def sampling_options(fn: Callable) -> Callable:
    """One option per sampling field (SamplingParams' names, defaults and help)."""
    opts = []
    for f in SAMPLING_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:  # on by default: --no-NAME turns it off
            opts.append(option("Sampling", f"{flag}/--no-{flag[2:]}" if f.default else flag, is_flag=True,
                               default=f.default, help=f.help))
        elif f.type is tuple:  # stop_token_ids: one --stop-token-id per id
            opts.append(option("Sampling", "--stop-token-id", f.name, multiple=True, type=int, help=f.help))
        elif f.type is dict:  # logit_bias: one --logit-bias TOKEN=BIAS per token
            opts.append(option("Sampling", flag, multiple=True, metavar="TOKEN=BIAS", callback=_token_map,
                               help=f.help))
        else:  # left out, a field the model's generation_config.json sets takes its value first
            model = " Left out: the model's generation_config.json value, if any." if f.name in MODEL_DEFAULTS else ""
            opts.append(option("Sampling", flag, type=f.type, default=f.default, show_default=f.default is not None,
                               help=f.help + model))
    return apply(fn, opts)


def config_file_option(fn: Callable) -> Callable:
    """``--config FILE.yaml``: the command's options from a YAML mapping whose keys are the long option
    names (``max-model-len: 4096``, ``lora: [a=./a]``, ``insecure: true``). Flags on the command line
    (and environment variables) win over the file; an unknown key is an error naming it."""
    return option("Other", "--config", type=click.Path(exists=True, dir_okay=False), default=None, metavar="FILE",
                  is_eager=True, expose_value=False, callback=_load_config_file,
                  help="Options from a YAML file (keys: the long option names); the command line wins.")(fn)


def _load_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    if path is None:
        return
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise click.BadParameter(f"{path} is not valid YAML: {e}", ctx, param) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold a mapping of option names to values", ctx, param)
    by_name = {opt[2:]: p for p in ctx.command.params if isinstance(p, click.Option) and p is not param
               for opt in p.opts if opt.startswith("--")}
    values = {}
    for key, value in data.items():
        opt = by_name.get(str(key))
        if opt is None:
            raise click.BadParameter(f"unknown key {key!r} in {path}: not an option of `{ctx.command_path}` "
                                     "(keys are the long option names, e.g. max-model-len)", ctx, param)
        if value is None:  # null: the option's default
            continue
        if opt.multiple:
            value = value if isinstance(value, list) else [value]
        elif not opt.is_flag and not isinstance(value, str):
            value = str(value)  # as typed on a command line: the option's own type converts and checks it
        values[opt.name] = value
    ctx.default_map = {**(ctx.default_map or {}), **values}

"""The request fields of ``/v1/chat/completions`` and ``/v1/completions``: every field OpenAI or
vLLM defines for them, and what this server does with it. The one table that the OpenAPI document
(``openapi.py``: each field's JSON type and description), the refusals (:func:`refuse_unsupported`)
and the protocol's pass-through (``PASS_THROUGH``) are built from; docs/HTTP.md lists the same
fields (a test checks that it names each one).

A field is one of:

- ``PASS``: the protocol's sampling field of the same name, sent on as it came (its schema and help
  are ``shared.sampling.SAMPLING_FIELDS``'; the server checks its range);
- ``READ``: read by the route (``openai.py``: the prompt, ``stop``, ``n``, logprobs, structured
  outputs, ...);
- ``NO_EFFECT``: accepted, and has no effect on the answer, where that is what it means here too
  (``store``, ``metadata``, ...: the description says why);
- ``REFUSED``: a value other than the ``accepted`` ones (none: any value) is a 400 naming the field,
  never dropped in silence.

Fields neither OpenAI nor vLLM defines are ignored, as OpenAI does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.sampling import SAMPLING_FIELDS

from ..protocol.wire import MAX_CHOICES
from .errors import bad_request

PASS, READ, NO_EFFECT, REFUSED = "passed to the sampler", "read by the route", "no effect", "refused"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BOTH = (CHAT, COMPLETIONS)
MAX_REQUEST_ID_CHARS = 100  # the protocol's ids hold 128 characters: the answer's prefix, a unique suffix, a choice's


@dataclass(frozen=True)
class Field:
    name: str
    fate: str  # PASS, READ, NO_EFFECT or REFUSED
    schema: dict  # the JSON schema of its value, with a description (PASS: from SAMPLING_FIELDS)
    routes: tuple[str, ...] = BOTH
    accepted: tuple = ()  # REFUSED: the values that ask for nothing unsupported (the defaults)
    why: str = ""  # REFUSED: what the server does instead, for the 400's message


def _t(kind: str | None, description: str, **more) -> dict[str, Any]:
    return {**({"type": kind} if kind else {}), "description": description, **more}


def _sampling(name: str, routes: tuple[str, ...] = BOTH) -> Field:
    f = next(f for f in SAMPLING_FIELDS if f.name == name)
    kind = {int: "integer", float: "number", bool: "boolean", dict: "object", tuple: "array"}[f.type]
    more = {"items": {"type": "integer", "minimum": 0}} if f.type is tuple else {}
    if f.default is not None and f.type is not tuple:
        more["default"] = f.default
    return Field(name, PASS, _t(kind, f.help, **more), routes)


def _refused(name: str, kind: str | None, why: str, accepted: tuple = (), routes: tuple[str, ...] = BOTH,
             **more) -> Field:
    allowed = f" or {' or '.join(map(_show, accepted))}" if accepted else ""
    schema = _t(kind, f"Not supported: a 400 unless left out{allowed}. {why}", **more)
    if accepted and all(isinstance(v, (bool, int, float, str)) for v in accepted):
        schema["enum"] = list(accepted)
    return Field(name, REFUSED, schema, routes, accepted, why)


def _show(v: Any) -> str:
    return json.dumps(v)


_STRINGS = {"type": "array", "items": {"type": "string"}}
_SCHEMA = {"anyOf": [{"type": "object"}, {"type": "string"}]}

FIELDS: tuple[Field, ...] = (
    # ------------------------------------------------------------------ OpenAI's
    Field("model", READ, _t("string", "The served model's name (GET /v1/models) or a LoRA adapter's.")),
    Field("messages", READ, _t("array", "The conversation, rendered with the model's chat template."), (CHAT,)),
    Field("prompt", READ, _t(None, "A string or token ids (or an array of one of these)."), (COMPLETIONS,)),
    Field("max_tokens", READ, _t("integer", "Most tokens to generate (default: the model's max_new_tokens, "
                                            "else the rest of the context, as vLLM).")),
    Field("max_completion_tokens", READ, _t("integer", "max_tokens' newer name."), (CHAT,)),
    *(_sampling(name) for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                                   "logit_bias")),
    Field("stop", READ, _t(None, "Stop strings (not part of the answer unless include_stop_str_in_output).")),
    Field("stream", READ, _t("boolean", "Server-sent events.")),
    Field("stream_options", READ, _t("object", "With stream: include_usage (a boolean).",
                                     properties={"include_usage": {"type": "boolean"}})),
    Field("n", READ, _t("integer", f"Choices per request (1 to {MAX_CHOICES}); with seed, choice i samples as seed + i.")),
    Field("logprobs", READ, _t("boolean", "The chosen tokens' log probabilities."), (CHAT,)),
    Field("top_logprobs", READ, _t("integer", "With logprobs: each token's most likely alternatives (0 to 20)."),
          (CHAT,)),
    Field("logprobs", READ, _t("integer", "The chosen tokens' log probabilities and this many alternatives "
                                          "(0 to 20)."), (COMPLETIONS,)),
    Field("response_format", READ, _t("object", "text, json_object, or json_schema with json_schema.schema.",
                                      required=["type"], properties={
                                          "type": {"enum": ["text", "json_object", "json_schema"]},
                                          "json_schema": {"type": "object"}})),
    Field("tools", READ, _t("array", "Tool calling is not served: a request with tools is a 400 unless "
                                     "tool_choice is \"none\"."), (CHAT,)),
    Field("tool_choice", READ, _t(None, "Only \"none\" is served."), (CHAT,)),
    Field("user", READ, _t("string", "The client's session (a cluster routes by it).")),
    Field("parallel_tool_calls", NO_EFFECT, _t("boolean", "No tools are called (vLLM ignores it too)."), (CHAT,)),
    Field("store", NO_EFFECT, _t("boolean", "OpenAI's stored completions: nothing is stored here."), (CHAT,)),
    Field("metadata", NO_EFFECT, _t("object", "OpenAI's tags for stored completions: nothing is stored here."),
          (CHAT,)),
    Field("service_tier", NO_EFFECT, _t("string", "OpenAI's processing tier: one tier here."), (CHAT,)),
    Field("prediction", NO_EFFECT, _t("object", "OpenAI's predicted output: a latency hint that never changes "
                                                "the answer; not used here."), (CHAT,)),
    _refused("suffix", "string", "No insertion: the answer follows the prompt.", ("",), (COMPLETIONS,)),
    _refused("echo", "boolean", "The prompt is not repeated in the answer.", (False,)),
    _refused("best_of", "integer", "One sequence per choice (use n).", (1,)),
    _refused("functions", "array", "Tool calling is not served.", routes=(CHAT,)),
    _refused("function_call", None, "Tool calling is not served.", ("none",), (CHAT,)),
    _refused("modalities", "array", "Text only.", (["text"],), (CHAT,), items={"type": "string"}),
    _refused("audio", "object", "Text only.", routes=(CHAT,)),
    _refused("reasoning_effort", "string", "No reasoning parser or effort setting.", routes=(CHAT,)),
    _refused("web_search_options", "object", "No web search.", routes=(CHAT,)),
    # ------------------------------------------------------------------ vLLM's extras
    *(_sampling(name) for name in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
                                   "min_tokens", "include_stop_str_in_output", "skip_special_tokens")),
    Field("grammar", READ, _t("object", "Tandem's grammar map (docs/PROTOCOL.md): kind point, box, regex or "
                                        "json_schema.")),
    Field("guided_json", READ, {**_SCHEMA, "description": "vLLM's: the answer follows this JSON schema."}),
    Field("guided_regex", READ, _t("string", "vLLM's: the answer matches this regular expression.")),
    Field("guided_choice", READ, _t("array", "vLLM's: the answer is one of these strings.", items={"type": "string"},
                                    minItems=1)),
    Field("guided_grammar", READ, _t("string", "vLLM's: the answer follows this EBNF grammar (xgrammar's, from "
                                               "rule root).")),
    Field("structured_outputs", READ, _t("object", "vLLM's: one of json, regex, choice, grammar or json_object.")),
    Field("return_tokens_as_token_ids", READ, _t("boolean", "With logprobs: tokens as \"token_id:ID\".")),
    Field("request_id", READ, _t("string", f"The answer's id is the route's prefix and this (1 to "
                                           f"{MAX_REQUEST_ID_CHARS} characters), as vLLM's.")),
    _refused("use_beam_search", "boolean", "No beam search.", (False,)),
    _refused("length_penalty", "number", "Beam search only.", (1.0,)),
    _refused("spaces_between_special_tokens", "boolean", "Special tokens' text is the tokenizer's decode "
                                                         "(as vLLM's fast tokenizers).", (True,)),
    Field("truncate_prompt_tokens", READ, _t("integer", "Keep only the prompt's last k tokens (vLLM's; k >= 1; "
                                                        "not with images).")),
    _refused("prompt_logprobs", "integer", "No prompt logprobs."),
    _refused("allowed_token_ids", "array", "Use logit_bias or a grammar.", items={"type": "integer"}),
    _refused("bad_words", "array", "Use logit_bias or a grammar.", ([],), items={"type": "string"}),
    _refused("add_special_tokens", "boolean", "Prompts are tokenized without special tokens: the chat template "
                                              "or the prompt has them.", (False,)),
    Field("add_generation_prompt", READ, _t("boolean", "End the rendered chat with the assistant's opening "
                                                       "(vLLM's; default true).", default=True), (CHAT,)),
    Field("continue_final_message", READ, _t("boolean", "Continue the final (assistant) message instead of opening "
                                                        "a new one; needs add_generation_prompt: false (vLLM's).",
                                             default=False), (CHAT,)),
    Field("chat_template_kwargs", READ, _t("object", "Variables for the chat template (e.g. enable_thinking), "
                                                     "not its own arguments (vLLM's)."), (CHAT,)),
    _refused("chat_template", "string", "The server's chat template (--chat-template) renders every request.",
             routes=(CHAT,)),
    _refused("documents", "array", "The template renders messages only.", routes=(CHAT,)),
    _refused("mm_processor_kwargs", "object", "Images are prepared as the model's processor does.",
             routes=(CHAT,)),
    _refused("include_reasoning", "boolean", "No reasoning parser: the answer is all content.", (True,), (CHAT,)),
    _refused("structural_tag", "string", "No structural tags.", routes=(CHAT,)),
    _refused("guided_decoding_backend", "string", "One backend (xgrammar)."),
    _refused("guided_whitespace_pattern", "string", "JSON whitespace is the grammar's own."),
    _refused("priority", "integer", "One priority (first come, first served).", (0,)),
    _refused("logits_processors", "array", "No custom logits processors."),
    _refused("cache_salt", "string", "The prefix cache is not salted."),
    _refused("kv_transfer_params", "object", "No disaggregated serving."),
    _refused("vllm_xargs", "object", "No custom extensions."),
)

PASS_THROUGH = tuple(f.name for f in FIELDS if f.fate == PASS)


def route_fields(route: str) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if route in f.routes}


_REFUSED = {route: [f for f in route_fields(route).values() if f.fate == REFUSED] for route in BOTH}


def refuse_unsupported(route: str, body: Any) -> None:
    """A 400 naming the first field of ``body`` (the route's Struct, ``openapi.body_types``, or the
    JSON object it was decoded from) that asks for what this server does not do."""
    get = body.get if isinstance(body, dict) else lambda name: getattr(body, name)
    for f in _REFUSED[route]:
        value = get(f.name)
        if value is not None and not any(_same(value, a) for a in f.accepted):
            send = f" (send {' or '.join(map(_show, f.accepted))}, or leave it out)" if f.accepted else ""
            raise bad_request(f"{f.name}: {_show(value)[:60]} is not supported by this server{send}: {f.why}")


def _same(value: Any, accepted: Any) -> bool:
    """The same JSON value: 1 and 1.0 are one number, but true is not 1."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted and (type(value) is type(accepted) or isinstance(value, (int, float)))

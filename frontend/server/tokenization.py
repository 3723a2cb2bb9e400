"""Prompt rendering shared by the CLI and the server (text, and text with images)."""
from __future__ import annotations

from jinja2 import TemplateError

from frontend.images.idefics3 import PreparedImage, image_prompt_ids


def chat_prompt_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    """Token ids of ``messages`` (text only) rendered with the model's chat template (``--chat-template``
    replaces the tokenizer's); ``options``: the request's (``protocol.template_options``: by default the
    assistant's opening is added)."""
    out = _apply_chat_template(tokenizer, text_only(messages), tokenize=True, **options)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def decode_ids(tokenizer, ids: list[int]) -> str:
    """Text of token ids; ids the tokenizer lacks (a vocabulary larger than it) decode to nothing."""
    n = len(tokenizer)
    return tokenizer.decode([t for t in ids if 0 <= t < n])


def _apply_chat_template(tokenizer, messages: list[dict], tokenize: bool, add_generation_prompt: bool = True,
                         **options):
    """ValueError (a bad request) when the model has no template or its template refuses the
    conversation: many do, with ``raise_exception`` (e.g. roles that do not alternate)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; send a plain prompt")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=tokenize, **options)
    except TemplateError as e:
        raise ValueError(f"messages: the model's chat template refuses them: {e}") from None


TEXT_PARTS_SEPARATOR = "\n"  # vLLM's rule for text parts; every door (ZeroMQ, HTTP) renders through here


def text_only(messages: list[dict]) -> list[dict]:
    """Content given as a list of text parts joined into one string (any chat template takes that),
    with newlines between the parts."""
    return [m if isinstance(m["content"], str) else
            {**m, "content": TEXT_PARTS_SEPARATOR.join(p.get("text", "") for p in m["content"])} for m in messages]


def place_images(messages: list[dict], count: int) -> list[dict]:
    """Messages whose image parts mark where the images go. Without any image part,
    the images go before the text of the first user message."""
    if any(p["type"] == "image" for m in messages if not isinstance(m["content"], str) for p in m["content"]):
        return messages
    out = list(messages)
    for i, m in enumerate(out):
        if m["role"] == "user":
            text = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            out[i] = {**m, "content": [{"type": "image"}] * count + text}
            return out
    raise ValueError("messages: images need a user message to go into")


def image_chat_prompt_ids(tokenizer, messages: list[dict], images: list[PreparedImage], params,
                          **options) -> list[int]:
    """Token ids of ``messages`` with ``images`` (chat template, then each <image> expanded)."""
    text = _apply_chat_template(tokenizer, place_images(messages, len(images)), tokenize=False, **options)
    return image_prompt_ids(tokenizer, text, images, params)

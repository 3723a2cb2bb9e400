"""Prompt rendering shared by the CLI and the server."""
from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; send a plain prompt")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

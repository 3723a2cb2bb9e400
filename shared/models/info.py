"""``ModelInfo``: a model's facts, read once from its directory."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from shared import generation_config as generation_defaults
from shared.families import Family, family_of, read_config
from shared.models.registry import DEFAULT_MODEL, resolve_model


@dataclass(frozen=True)
class ModelInfo:
    """A model's facts, read once from its directory (both processes use them: ``load`` is the one
    place the family, the EOS ids and the generation defaults are read)."""
    path: Path
    family: Family  # which code serves it (shared/families): vision, skills, the worker's loader
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, once each
    max_context: int  # max_position_embeddings
    has_chat_template: bool
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's (shared/generation_config.py)

    @property
    def vision(self) -> bool:
        """The model takes images."""
        return self.family.vision

    @classmethod
    def load(cls, name_or_path: str | os.PathLike = DEFAULT_MODEL, generation_config: str = "auto") -> "ModelInfo":
        """Resolve (building a built-in model once) and read config.json, generation_config.json (where
        ``generation_config`` says: auto, vllm or a folder) and the tokenizer config. An unsupported
        architecture or quantization raises ``UnsupportedModel``."""
        path = resolve_model(name_or_path)
        config = read_config(path)
        family = family_of(config)
        text = family.text_config(config)
        generation = generation_defaults.read(path, generation_config)
        tok_cfg = path / "tokenizer_config.json"
        template = (path / "chat_template.jinja").exists() or (path / "chat_template.json").exists() or (
            tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text()))
        return cls(path=path, family=family, vocab_size=int(text["vocab_size"]),
                   eos_token_ids=tuple(dict.fromkeys(family.eos_token_ids(config)
                                                     + generation_defaults.eos_token_ids(generation))),
                   max_context=int(text.get("max_position_embeddings", 4096)), has_chat_template=bool(template),
                   sampling_defaults=generation_defaults.sampling_defaults(generation, generation_config))

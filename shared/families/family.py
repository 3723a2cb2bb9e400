"""The :class:`Family` record every family module fills in (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class UnsupportedModel(ValueError):
    """A checkpoint no family can serve as it is (its architecture, its quantization)."""


def _flat(config: dict) -> dict:
    return config


def _never(config: dict) -> bool:
    return False


@dataclass(frozen=True)
class Family:
    name: str  # also what ``info`` reports as ``family``
    architectures: tuple[str, ...]  # config.json's architectures this family serves
    model_types: tuple[str, ...] = ()  # model_type, for a config.json without architectures
    # config.json -> the language model's config in transformers' flat names (vocab_size,
    # max_position_embeddings, eos_token_id, ...): a vision-language model nests it.
    text_config: Callable[[dict], dict] = _flat
    vision: bool = False  # takes images
    # Renders its own skill prompts (a ``skill`` request: the server's Moondream templates); its
    # images come with a skill only. Else a skill is a prompted chat request (frontend/skills.py).
    native_skills: bool = False
    # A config.json with neither architectures nor model_type; or, where families share an
    # architecture, one of this family's (with model_types, what tells them apart).
    recognises: Callable[[dict], bool] = _never
    skill_rules: Any = None  # a native-skills family: its shared.moondream_config.SkillRules

    def eos_token_ids(self, config: dict) -> tuple[int, ...]:
        """config.json's EOS ids, its language model's and its own top-level ones (a vision-language
        config may carry either), in that order, once each."""
        ids: list[int] = []
        for eos in (self.text_config(config).get("eos_token_id"), config.get("eos_token_id")):
            ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return tuple(dict.fromkeys(int(i) for i in ids))

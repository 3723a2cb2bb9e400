"""Model families: which code serves a checkpoint, decided once from its ``config.json``.

A checkpoint's family is looked up by ``architectures`` (the class transformers would build),
else by ``model_type``; Moondream's override-format config (``text``/``vision``/``region``, no
architectures) is recognised by its sections. :func:`family_of` refuses, naming what it read and
listing what is supported, an architecture no family serves and a ``quantization_config`` the
engine cannot honour (FP8, AWQ, GPTQ...: their weights need scales this engine does not apply).
The GGUF path and ``--quantization`` are separate: they never write a ``quantization_config``.

Both processes go through here (``shared.models.info.ModelInfo.load``, the worker's model loading), so
they agree on the family, the language model's facts and the EOS ids (``shared/generation_config.py``
adds generation_config.json's). Torch-free.

A family is one module in this package with one :class:`Family`; a new one implements:

- here: its architectures / model types and ``text_config`` (its config.json -> the language
  model's config in transformers' flat names: ``vocab_size``, ``max_position_embeddings``,
  ``eos_token_id``, and, for a Llama-like text model, the rest ``LlamaConfig`` parses), and
  whether it takes images (``vision``) or renders its own skill prompts (``native_skills``);
- on the worker: its model and a loader in ``gpu_worker/families.py`` (``WORKER_FAMILIES``, by name);
- on the frontend, if it takes images: its ``IntakeFamily`` (``frontend/images/intake.py``,
  ``INTAKES``) and, on the worker, its ``ImageFamily`` (``gpu_worker/image_prefill.py``).

Callers ask the family (``family.vision``, ``family.native_skills``), never compare its name.
Invariants (tests/models/test_families.py): every family has its worker loader and each vision family
its intake; an architecture is served by one family at most, unless the families sharing it tell
their configs apart (``model_types``/``recognises``: Moondream 2 and 3 are both ``HfMoondream``).
"""
from __future__ import annotations

import json
from pathlib import Path

from .family import Family, UnsupportedModel
from .idefics3 import IDEFICS3
from .llama import LLAMA
from .moondream import MOONDREAM, MOONDREAM3
from .qwen3 import QWEN3

__all__ = ["FAMILIES", "Family", "UnsupportedModel", "family_of", "family_named", "native_skills", "read_config",
           "HONOURED_QUANTIZATIONS"]

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN3, IDEFICS3, MOONDREAM, MOONDREAM3)}
_BY_ARCHITECTURE: dict[str, list[Family]] = {}
for _f in FAMILIES.values():
    for _a in _f.architectures:
        _BY_ARCHITECTURE.setdefault(_a, []).append(_f)
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}

# quantization_config methods whose weights this engine loads as they are: none yet. (A GGUF file's
# blocks and --quantization int8/int4 are Tandem's own formats and carry no quantization_config.)
HONOURED_QUANTIZATIONS: frozenset[str] = frozenset()


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def family_named(name: str | None) -> Family | None:
    """The family of that name (``info``'s ``family``, from a server); None for a name unknown here."""
    return FAMILIES.get(name or "")


def native_skills(family_name: str | None) -> bool:
    """Whether a server whose ``info`` names this family renders its own skill prompts (False for a
    family unknown here: it is sent prompted skills)."""
    family = family_named(family_name)
    return family is not None and family.native_skills


def _by_architecture(architecture: str, config: dict) -> list[Family]:
    """The family serving this architecture; where several share it, the one the config names."""
    found = _BY_ARCHITECTURE.get(architecture, [])
    if len(found) > 1:
        found = [f for f in found if config.get("model_type") in f.model_types or f.recognises(config)]
    return found[:1]


def family_of(config: dict) -> Family:
    """The family serving a config.json dict; ``UnsupportedModel`` naming the architecture (or the
    quantization method) when none can."""
    architectures = config.get("architectures") or ()
    family = next((f for a in architectures for f in _by_architecture(a, config)), None)
    if family is None and not architectures:
        family = _BY_MODEL_TYPE.get(config.get("model_type")) or next(
            (f for f in FAMILIES.values() if f.recognises(config)), None)
    if family is None:
        what = f"architecture {', '.join(architectures)}" if architectures else \
            f"model_type {config.get('model_type')!r}" if config.get("model_type") else "a config.json without architectures"
        supported = ", ".join(_BY_ARCHITECTURE)
        raise UnsupportedModel(f"{what} is not supported (supported architectures: {supported})")
    quantization = config.get("quantization_config") or family.text_config(config).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unnamed"
        if method not in HONOURED_QUANTIZATIONS:
            raise UnsupportedModel(
                f"quantization_config with quant_method {method!r} is not supported: its weights need scales this "
                "engine does not apply (serve the unquantized checkpoint, a GGUF file, or quantize at load with "
                "--quantization int8|int4)")
    return family

"""A model's ``generation_config.json``: its extra EOS ids and its default sampling parameters.

``--generation-config`` says where the file is read from, as vLLM's option of that name does:

- ``auto`` (the default): the model directory's file; its sampling values are the defaults of
  every request: a field the request sets wins, a field it leaves out takes the model's value
  (the protocol's defaults apply only where the file says nothing);
- ``vllm``: the file's sampling values are ignored (Tandem's own defaults); its EOS ids still stop
  generation, as in vLLM (they describe the model's vocabulary, not a sampling policy);
- a folder: that folder's ``generation_config.json`` instead of the model's, for both.

The sampling values are validated at start-up (an out-of-range value names the file). Only the
fields :data:`SAMPLING_DEFAULTS` names are taken: a sampling field joins by adding its name there
(the file's name if it differs, ``max_new_tokens`` -> ``max_tokens``). ``do_sample`` is ignored,
as vLLM ignores it. Torch-free: both processes read it (the worker for EOS, the frontend for both).
"""
from __future__ import annotations

import json
from pathlib import Path

from shared.sampling import SamplingParams

GENERATION_CONFIG = "generation_config.json"
AUTO, VLLM = "auto", "vllm"
# generation_config.json's name -> SamplingParams' name, for the defaults taken from the file.
SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read(model_dir: str | Path, source: str = AUTO) -> dict:
    """The generation_config.json ``source`` names for the model in ``model_dir`` ({} if there is none);
    a folder that does not exist is an error."""
    folder = Path(model_dir) if source in (AUTO, VLLM) else Path(source).expanduser()
    if source not in (AUTO, VLLM) and not folder.is_dir():
        raise FileNotFoundError(f"--generation-config {source}: not a folder (auto, vllm or a folder with "
                                f"{GENERATION_CONFIG})")
    path = folder / GENERATION_CONFIG
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def eos_token_ids(generation: dict) -> tuple[int, ...]:
    eos = generation.get("eos_token_id")
    return () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)


def sampling_defaults(generation: dict, source: str = AUTO) -> dict:
    """The model's default sampling values (SamplingParams' names); {} with ``vllm``. A value out of
    range raises ValueError naming the file's field."""
    if source == VLLM:
        return {}
    defaults = {ours: generation[theirs] for theirs, ours in SAMPLING_DEFAULTS.items()
                if generation.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{GENERATION_CONFIG}: {e}") from None
    return defaults

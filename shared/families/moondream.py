"""Moondream 2: its own text, vision and region models (``gpu_worker/moondream.py``), its own skill
prompts (``frontend/moondream_prompts.py``) and crops (``frontend/moondream_images.py``).

config.json is the hub's (``HfMoondream``, ``model_type`` moondream1) or the reference's override
format (``shared/moondream_config.py``), which the random built-ins use.
"""
from shared.moondream_config import EOS_ID, HUB_MODEL_TYPE, MoondreamConfig, is_moondream_config

from .family import Family


def text_config(config: dict) -> dict:
    t = MoondreamConfig.from_dict(config).text
    return {"vocab_size": t.vocab_size, "max_position_embeddings": t.max_context, "eos_token_id": EOS_ID}


MOONDREAM = Family(name="moondream", architectures=("HfMoondream",), model_types=(HUB_MODEL_TYPE,),
                   text_config=text_config, vision=True, native_skills=True, recognises=is_moondream_config)

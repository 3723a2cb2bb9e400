"""Moondream 2 and 3: their own text, vision and region models (``gpu_worker/moondream.py``), their own
skill prompts (``frontend/moondream/prompts.py``) and crops (``frontend/moondream/images.py``).

config.json is the hub's (``HfMoondream``, ``model_type`` moondream1 or moondream3: one
architecture, two families told apart by the model type) or the reference's override format
(``shared/moondream_config.py``; a ``text.moe`` section makes it Moondream 3), which the random
built-ins use. Where the versions' skills differ is their :class:`SkillRules`.
"""
from shared.moondream_config import (EOS_ID, HUB_MODEL_TYPE, MD3_MODEL_TYPE, MOONDREAM2_RULES, MOONDREAM3_RULES,
                                     MoondreamConfig, is_moondream3_config, is_moondream_config)

from .family import Family


def text_config(config: dict) -> dict:
    t = MoondreamConfig.from_dict(config).text
    return {"vocab_size": t.vocab_size, "max_position_embeddings": t.max_context, "eos_token_id": EOS_ID}


MOONDREAM = Family(name="moondream", architectures=("HfMoondream",), model_types=(HUB_MODEL_TYPE,),
                   text_config=text_config, vision=True, native_skills=True, recognises=is_moondream_config,
                   skill_rules=MOONDREAM2_RULES)
MOONDREAM3 = Family(name="moondream3", architectures=("HfMoondream",), model_types=(MD3_MODEL_TYPE,),
                    text_config=text_config, vision=True, native_skills=True, recognises=is_moondream3_config,
                    skill_rules=MOONDREAM3_RULES)

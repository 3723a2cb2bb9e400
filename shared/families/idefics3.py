"""Idefics3 / SmolVLM: a SigLIP encoder and pixel-shuffle connector (``gpu_worker/vision.py``) in
front of a Llama text model (``config.json``'s ``text_config``); images are tiled as transformers'
Idefics3 processor does (``frontend/images.py``, ``shared/vision_config.py``).
"""
from .family import Family


def text_config(config: dict) -> dict:
    """The text model's config; the head's tying is the outer config's."""
    return {"tie_word_embeddings": config.get("tie_word_embeddings", False), **config.get("text_config", {})}


IDEFICS3 = Family(name="idefics3", architectures=("Idefics3ForConditionalGeneration",), model_types=("idefics3",),
                  text_config=text_config, vision=True)

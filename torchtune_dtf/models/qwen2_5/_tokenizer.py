"""A Qwen2.5 tokenizer for base (pretrained, not chat-tuned) models: messages become their plain text.

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

from typing import Any, List, Mapping, Optional, Tuple

from torchtune.data import Message, truncate
from torchtune.models.qwen2_5._model_builders import _get_prompt_template
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS, Qwen2_5Tokenizer
from torchtune.modules.transforms.tokenizers import parse_hf_tokenizer_json


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

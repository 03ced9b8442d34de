"""Model builders: {dense, mod, sdt, stt} × Qwen2.5 {0.5B, 1.5B, 3B, 7B, tiny}, each with a LoRA twin.

Each builder maps one-to-one onto a config's ``model._component_``, e.g.
``torchtune_dtf.models.qwen2_5.stt_qwen2_5_0_5b``. Routing hyperparameters are passed through as
keyword arguments and are all required (no defaults; see :func:`routed_qwen2`). LoRA builders
(``lora_stt_qwen2_5_0_5b``…) additionally require ``lora_attn_modules``, ``apply_lora_to_mlp``,
``lora_rank``, ``lora_alpha`` and ``lora_dropout``.

The architecture numbers are Qwen2.5's (as torchtune's ``qwen2_5_*`` builders). ``tiny`` is a small shape
for tests and CPU smoke runs; it takes ``vocab_size`` (to match a tokenizer) and ``max_seq_len``.
"""

from typing import Any, Callable, Dict

from torchtune_dtf.models.qwen2_5._component_builders import lora_routed_qwen2, routed_qwen2
from torchtune_dtf.modules.decoder import RoutedTransformerDecoder

_COMMON = dict(attn_dropout=0.0, norm_eps=1e-6, rope_base=1_000_000.0)

QWEN2_5_SHAPES: Dict[str, Dict[str, Any]] = {
    "0_5b": dict(vocab_size=151936, num_layers=24, num_heads=14, num_kv_heads=2, embed_dim=896,
                 intermediate_dim=4864, max_seq_len=32768, tie_word_embeddings=True, **_COMMON),
    "1_5b": dict(vocab_size=151936, num_layers=28, num_heads=12, num_kv_heads=2, embed_dim=1536,
                 intermediate_dim=8960, max_seq_len=131072, tie_word_embeddings=True, **_COMMON),
    "3b": dict(vocab_size=151936, num_layers=36, num_heads=16, num_kv_heads=2, embed_dim=2048,
               intermediate_dim=11008, max_seq_len=32768, tie_word_embeddings=True, **_COMMON),
    "7b": dict(vocab_size=152064, num_layers=28, num_heads=28, num_kv_heads=4, embed_dim=3584,
               intermediate_dim=18944, max_seq_len=131072, tie_word_embeddings=False, **_COMMON),
    "tiny": dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                 max_seq_len=256, tie_word_embeddings=True, **_COMMON),
}


def _builder(variant: str, size: str) -> Callable[..., RoutedTransformerDecoder]:
    shape = QWEN2_5_SHAPES[size]

    def build(**routing) -> RoutedTransformerDecoder:
        arch = dict(shape)
        if size == "tiny":
            arch["vocab_size"] = routing.pop("vocab_size", 512)
            arch["max_seq_len"] = routing.pop("max_seq_len", arch["max_seq_len"])
        return routed_qwen2(variant, **arch, **routing)

    build.__name__ = build.__qualname__ = f"{variant}_qwen2_5_{size}"
    build.__doc__ = (
        f"{variant.upper()} Qwen2.5-{size} decoder. Keyword arguments: the variant's routing hyperparameters "
        "(all required; see torchtune_dtf.models.qwen2_5.routed_qwen2)."
    )
    return build


def _lora_builder(variant: str, size: str) -> Callable[..., RoutedTransformerDecoder]:
    shape = QWEN2_5_SHAPES[size]

    def build(
        lora_attn_modules, apply_lora_to_mlp: bool, *, lora_rank: int, lora_alpha: float, lora_dropout: float, **routing
    ) -> RoutedTransformerDecoder:
        arch = dict(shape)
        if size == "tiny":
            arch["vocab_size"] = routing.pop("vocab_size", 512)
            arch["max_seq_len"] = routing.pop("max_seq_len", arch["max_seq_len"])
        return lora_routed_qwen2(
            variant,
            lora_attn_modules,
            apply_lora_to_mlp,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            **arch,
            **routing,
        )

    build.__name__ = build.__qualname__ = f"lora_{variant}_qwen2_5_{size}"
    build.__doc__ = (
        f"LoRA twin of {variant}_qwen2_5_{size}: LoRA on lora_attn_modules (and the MLP if apply_lora_to_mlp), "
        "routing modules fully trainable adapter parameters."
    )
    return build


dense_qwen2_5_0_5b = _builder("dense", "0_5b")
dense_qwen2_5_1_5b = _builder("dense", "1_5b")
dense_qwen2_5_3b = _builder("dense", "3b")
dense_qwen2_5_7b = _builder("dense", "7b")
dense_qwen2_5_tiny = _builder("dense", "tiny")
mod_qwen2_5_0_5b = _builder("mod", "0_5b")
mod_qwen2_5_1_5b = _builder("mod", "1_5b")
mod_qwen2_5_3b = _builder("mod", "3b")
mod_qwen2_5_7b = _builder("mod", "7b")
mod_qwen2_5_tiny = _builder("mod", "tiny")
sdt_qwen2_5_0_5b = _builder("sdt", "0_5b")
sdt_qwen2_5_1_5b = _builder("sdt", "1_5b")
sdt_qwen2_5_3b = _builder("sdt", "3b")
sdt_qwen2_5_7b = _builder("sdt", "7b")
sdt_qwen2_5_tiny = _builder("sdt", "tiny")
stt_qwen2_5_0_5b = _builder("stt", "0_5b")
stt_qwen2_5_1_5b = _builder("stt", "1_5b")
stt_qwen2_5_3b = _builder("stt", "3b")
stt_qwen2_5_7b = _builder("stt", "7b")
stt_qwen2_5_tiny = _builder("stt", "tiny")

lora_dense_qwen2_5_0_5b = _lora_builder("dense", "0_5b")
lora_dense_qwen2_5_1_5b = _lora_builder("dense", "1_5b")
lora_dense_qwen2_5_3b = _lora_builder("dense", "3b")
lora_dense_qwen2_5_7b = _lora_builder("dense", "7b")
lora_dense_qwen2_5_tiny = _lora_builder("dense", "tiny")
lora_mod_qwen2_5_0_5b = _lora_builder("mod", "0_5b")
lora_mod_qwen2_5_1_5b = _lora_builder("mod", "1_5b")
lora_mod_qwen2_5_3b = _lora_builder("mod", "3b")
lora_mod_qwen2_5_7b = _lora_builder("mod", "7b")
lora_mod_qwen2_5_tiny = _lora_builder("mod", "tiny")
lora_sdt_qwen2_5_0_5b = _lora_builder("sdt", "0_5b")
lora_sdt_qwen2_5_1_5b = _lora_builder("sdt", "1_5b")
lora_sdt_qwen2_5_3b = _lora_builder("sdt", "3b")
lora_sdt_qwen2_5_7b = _lora_builder("sdt", "7b")
lora_sdt_qwen2_5_tiny = _lora_builder("sdt", "tiny")
lora_stt_qwen2_5_0_5b = _lora_builder("stt", "0_5b")
lora_stt_qwen2_5_1_5b = _lora_builder("stt", "1_5b")
lora_stt_qwen2_5_3b = _lora_builder("stt", "3b")
lora_stt_qwen2_5_7b = _lora_builder("stt", "7b")
lora_stt_qwen2_5_tiny = _lora_builder("stt", "tiny")

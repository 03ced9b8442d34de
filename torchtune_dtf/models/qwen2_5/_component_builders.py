"""Component builders for routed Qwen2 decoders (dense, MoD, SDT, STT) and their LoRA twins.

Blocks are built exactly as torchtune's ``qwen2`` builds them, so every pretrained weight keeps its
dense key name; routed layers add only their routing modules (see ``ROUTING_MODULE_NAMES``).
"""

from functools import partial
from typing import Callable, List, Optional

from torch import nn
from torchtune.models.qwen2._component_builders import lora_qwen2_mlp, lora_qwen2_self_attention, qwen2_mlp
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import MultiHeadAttention, RMSNorm, TiedLinear, TransformerSelfAttentionLayer
from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_dtf.models.routing_config import RoutingSpec, validate_routing
from torchtune_dtf.modules.decoder import RoutedTransformerDecoder
from torchtune_dtf.modules.layers import (
    DroppedLayer,
    MoDLayer,
    RandomRoutedLayer,
    SDTDecisionLayer,
    SDTDynamicLayer,
    STTLayer,
)
from torchtune_dtf.modules.predictors import ResidualPredictor, predictor_width
from torchtune_dtf.modules.routers import CausalRouter, MoDRouter
from torchtune_dtf.modules.surprise import PredictiveRouter


def qwen2_self_attention(
    *, embed_dim: int, num_heads: int, num_kv_heads: int, max_seq_len: int, attn_dropout: float, rope: nn.Module
) -> MultiHeadAttention:
    """Qwen2 attention block exactly as in ``torchtune.models.qwen2.qwen2`` (q/k/v biases, no o bias)."""
    head_dim = embed_dim // num_heads
    return MultiHeadAttention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=True),
        k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=True),
        v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=True),
        output_proj=nn.Linear(embed_dim, embed_dim, bias=False),
        pos_embeddings=rope,
        kv_cache=None,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
    )


def causal_router(spec: RoutingSpec, embed_dim: int, norm_eps: float) -> CausalRouter:
    """The student router of one routed layer."""
    return CausalRouter(
        embed_dim=embed_dim,
        hidden_dim=spec.causal_router_hidden_dim,
        use_previous_token=spec.causal_router_input == "current_previous",
        norm_eps=norm_eps,
        init_std=spec.routing_init_std,
    )


def residual_predictor(spec: RoutingSpec, embed_dim: int, norm_eps: float) -> ResidualPredictor:
    """PriorFFN (SDT) or TPN (STT) of width max(2, ceil(f·d)) rounded to even (DESIGN §3.3)."""
    return ResidualPredictor(
        embed_dim=embed_dim,
        hidden_dim=predictor_width(spec.prior_factor, embed_dim),
        norm_eps=norm_eps,
        init_std=spec.routing_init_std,
    )


def predictive_router(spec: RoutingSpec) -> PredictiveRouter:
    return PredictiveRouter(o_ce_init=spec.o_ce_init, m_cu_init=spec.m_cu_init, ma_window=spec.ma_window)


def _routed_decoder(
    spec: RoutingSpec,
    *,
    make_attn: Callable[[], MultiHeadAttention],
    make_mlp: Callable[[], nn.Module],
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    embed_dim: int,
    max_seq_len: int,
    norm_eps: float,
    tie_word_embeddings: bool,
) -> RoutedTransformerDecoder:
    capacity_of = dict(zip(spec.routed_layers, spec.capacity))
    decision_layers = {i - 1 for i in spec.routed_layers} if spec.variant == "sdt" else set()
    layers = nn.ModuleList()
    for i in range(num_layers):
        block = dict(
            attn=make_attn(),
            mlp=make_mlp(),
            sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
        )
        if i in spec.dropped_layers:
            layer = DroppedLayer(**block)
        elif i in capacity_of and spec.variant == "random":
            layer = RandomRoutedLayer(
                **block,
                layer_idx=i,
                capacity=capacity_of[i],
                always_run_first_token=spec.always_run_first_token,
                skipped_tokens_write_kv=spec.skipped_tokens_write_kv,
            )
        elif i in capacity_of:
            routed = dict(
                layer_idx=i,
                capacity=capacity_of[i],
                causal_router=causal_router(spec, embed_dim, norm_eps),
                student_routing_mode=spec.student_routing_mode,
                student_threshold=spec.student_threshold,
                gate=spec.gate,
                always_run_first_token=spec.always_run_first_token,
                allow_noncausal_student_topk=spec.allow_noncausal_student_topk,
                skipped_tokens_write_kv=spec.skipped_tokens_write_kv,
                skip_update=spec.skip_update,
            )
            if spec.variant == "mod":
                layer = MoDLayer(**block, **routed, mod_router=MoDRouter(embed_dim, spec.routing_init_std))
            else:
                surprise = dict(
                    predictive_router=predictive_router(spec),
                    teacher_selection=spec.teacher_selection,
                    gate_threshold=spec.gate_threshold,
                )
                if spec.variant == "stt":
                    layer = STTLayer(**block, **routed, **surprise, transition=residual_predictor(spec, embed_dim, norm_eps))
                else:
                    layer = SDTDynamicLayer(**block, **routed, **surprise)
        elif i in decision_layers:
            layer = SDTDecisionLayer(**block, layer_idx=i, prior_ffn=residual_predictor(spec, embed_dim, norm_eps))
        else:
            layer = TransformerSelfAttentionLayer(**block)
        layers.append(layer)

    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    output = TiedLinear(tok_embeddings) if tie_word_embeddings else nn.Linear(embed_dim, vocab_size, bias=False)
    return RoutedTransformerDecoder(
        variant=spec.variant,
        routing_layer_indices=sorted(set(spec.routed_layers) | decision_layers),
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=embed_dim // num_heads,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


def routed_qwen2(
    variant: str,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    tie_word_embeddings: bool,
    **routing,
) -> RoutedTransformerDecoder:
    """Qwen2 decoder of the given variant (``dense``, ``layerdrop``, ``random``, ``mod``, ``sdt``, ``stt``).

    With ``variant="dense"`` and no routing arguments it is torchtune's ``qwen2`` (same modules, same
    keys), run through the same decoder class so every comparison shares one code path.

    Args:
        variant (str): model family.
        vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, intermediate_dim, max_seq_len,
        attn_dropout, norm_eps, rope_base, tie_word_embeddings: Qwen2 architecture, as ``qwen2``.
        **routing: every routing hyperparameter of the variant, all required (see
            :mod:`torchtune_dtf.models.routing_config`): ``routed_layers``, ``capacity``,
            ``student_routing_mode``, ``student_threshold``, ``causal_router_input``,
            ``causal_router_hidden_dim``, ``routing_init_std``, ``gate``, ``always_run_first_token``,
            ``allow_noncausal_student_topk``, ``skipped_tokens_write_kv``, ``skip_update``; SDT/STT also ``prior_factor``,
            ``ma_window``, ``o_ce_init``, ``m_cu_init``, ``teacher_selection``, ``gate_threshold``.
            The baselines: ``layerdrop`` takes ``dropped_layers``; ``random`` takes ``routed_layers``,
            ``capacity``, ``always_run_first_token``, ``skipped_tokens_write_kv``.

    Raises:
        ValueError: listing every missing, unknown or invalid routing hyperparameter.
    """
    spec = validate_routing(variant, num_layers, **routing)
    rope = Qwen2RotaryPositionalEmbeddings(dim=embed_dim // num_heads, max_seq_len=max_seq_len, base=rope_base)
    return _routed_decoder(
        spec,
        make_attn=partial(
            qwen2_self_attention,
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            rope=rope,
        ),
        make_mlp=partial(qwen2_mlp, dim=embed_dim, hidden_dim=intermediate_dim),
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        tie_word_embeddings=tie_word_embeddings,
    )


def lora_routed_qwen2(
    variant: str,
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    tie_word_embeddings: bool,
    **routing,
) -> RoutedTransformerDecoder:
    """LoRA twin of :func:`routed_qwen2`: the base is frozen by the recipe, LoRA sits on the chosen
    projections of every block (routed ones included), and every routing module reports all of its
    parameters through ``adapter_params()``, so torchtune's ``get_adapter_params`` trains them fully.

    Args:
        variant (str): model family.
        lora_attn_modules (List[str]): attention projections with LoRA (``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``).
        apply_lora_to_mlp (bool): LoRA on the MLP projections too.
        lora_rank (int), lora_alpha (float), lora_dropout (float): LoRA settings.
        Other arguments: as :func:`routed_qwen2`.
    """
    spec = validate_routing(variant, num_layers, **routing)
    lora = dict(lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout)
    make_attn = partial(
        lora_qwen2_self_attention,
        lora_attn_modules,
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        rope_base=rope_base,
        **lora,
    )
    if apply_lora_to_mlp:
        make_mlp = partial(lora_qwen2_mlp, dim=embed_dim, hidden_dim=intermediate_dim, **lora)
    else:
        make_mlp = partial(qwen2_mlp, dim=embed_dim, hidden_dim=intermediate_dim)
    return _routed_decoder(
        spec,
        make_attn=make_attn,
        make_mlp=make_mlp,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        tie_word_embeddings=tie_word_embeddings,
    )
